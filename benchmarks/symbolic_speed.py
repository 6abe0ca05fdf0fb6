"""Cost of a symbolic profile against a concrete one, and of evaluating its formulas.

In one process, alternating, medians of --repeat runs, in CPU seconds (time.process_time: the
machine this was measured on is shared, and wall time there moves by 2x with the load), garbage
collected before each run:
  bare       FakeTensorMode with a ShapeEnv, batch and seq symbolic: forward + backward + AdamW step
             of the same model, nothing recorded (what any symbolic fake trace pays)
  concrete   tapescope.profile at one batch and sequence length
  symbolic   tapescope.profile(..., symbolic=("batch", "seq")): formulas for every size
  1000 sizes p.at(batch=b, seq=s) for 1,000 (b, s) pairs
Prints a Markdown table (docs/benchmarks.md keeps the last one).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import tapescope
from tapescope.capture.model import build_on_meta, fake_copy, fake_inputs, fake_tensor_like
from tapescope.capture.session import _symbols
from tapescope.capture.step import train_step
from tapescope.zoo import resolve


def bare_symbolic(meta_model, m) -> float:
    shape_env = ShapeEnv(duck_shape=False)
    with FakeTensorMode(shape_env=shape_env):
        model = fake_copy(meta_model, lambda t: fake_tensor_like(t, torch.device("cpu"), None))
        sizes, _ = _symbols(shape_env, ("batch", "seq"), m.inputs)
        args, kwargs = fake_inputs((m.inputs, m.input_kwargs), torch.device("cpu"), None, sizes)
        opt = torch.optim.AdamW(model.parameters())
        t = time.process_time()
        train_step(model, args, kwargs, m.loss_fn, opt)
        return time.process_time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print("| model | bare symbolic fake trace | concrete profile | symbolic profile (batch, seq) "
          "| symbolic / concrete | symbolic / bare symbolic | 1,000 sizes evaluated |")
    print("|---|---|---|---|---|---|---|")
    for spec, batch, seq in (("zoo:gpt2", 8, 1024), ("zoo:llama", 4, 2048)):
        m = resolve(spec, batch=batch, seq=seq)
        meta = build_on_meta(m.build)

        def concrete():
            t = time.process_time()
            tapescope.profile(meta, *m.inputs, loss_fn=m.loss_fn)
            return time.process_time() - t

        def symbolic():
            t = time.process_time()
            p = tapescope.profile(meta, *m.inputs, loss_fn=m.loss_fn, symbolic=("batch", "seq"))
            return time.process_time() - t, p

        concrete()
        symbolic()
        bare_symbolic(meta, m)
        b, c, s = [], [], []
        for _ in range(args.repeat):
            # garbage collected before each run: a full collection (0.25-0.3 s here) otherwise
            # lands in whichever run crosses the collector's threshold, whatever made the garbage
            gc.collect()
            b.append(bare_symbolic(meta, m))
            gc.collect()
            c.append(concrete())
            gc.collect()
            dt, p = symbolic()
            s.append(dt)
        hi = p.symbolic.ranges["seq"][1] or 4096
        t = time.process_time()
        for i in range(1000):
            p.at(batch=2 + i % 100, seq=2 + (37 * i) % (hi - 1))
        evals = time.process_time() - t
        mb, mc, ms = statistics.median(b), statistics.median(c), statistics.median(s)
        print(f"| {spec} ({batch} x {seq}) | {mb:.2f} s | {mc:.2f} s | {ms:.2f} s | {ms / mc:.2f}x "
              f"| {ms / mb:.2f}x | {evals * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
