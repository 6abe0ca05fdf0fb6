"""How long a profile takes, against the bare fake trace it builds on and against the rivals.

In one process, for each model, alternating (the order turning each round, garbage collected
before each run) so that machine noise hits all methods alike (ratios are medians of per-round
ratios):
  bare       FakeTensorMode: forward + backward + AdamW step of the same fake model, nothing recorded
  tapescope  tapescope.profile (two steps: first and steady state, analyses included)
  rivals     MemTracker + FlopCounterMode around forward + backward + AdamW step
Also: tapescope at batch 1 vs batch 1e10, and (in a subprocess) the resident memory of profiling a
70B-parameter Llama. Prints a Markdown table (docs/benchmarks.md keeps the last one).

    python benchmarks/trace_speed.py [--repeat 5] [--clock cpu]

`--clock cpu` times with time.process_time (the process's CPU time: what a shared machine's other
jobs do not inflate; the default, `wall`, is time.perf_counter). The 70B footprint's seconds are
wall time either way.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import tapescope
from tapescope.capture.model import build_on_meta, fake_copy, fake_inputs, fake_tensor_like
from tapescope.capture.step import train_step
from tapescope.zoo import resolve

CPU = torch.device("cpu")


def bare(meta_model, m, clock=time.perf_counter):
    with FakeTensorMode():
        model = fake_copy(meta_model, lambda t: fake_tensor_like(t, CPU, None))
        args, kwargs = fake_inputs((m.inputs, m.input_kwargs), CPU, None)
        opt = torch.optim.AdamW(model.parameters())
        t = clock()
        train_step(model, args, kwargs, m.loss_fn, opt)
        return clock() - t


def rivals(meta_model, m, clock=time.perf_counter):
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode():
        model = fake_copy(meta_model, lambda t: fake_tensor_like(t, CPU, None))
        args, kwargs = fake_inputs((m.inputs, m.input_kwargs), CPU, None)
        opt = torch.optim.AdamW(model.parameters())
        t = clock()
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt, FlopCounterMode(display=False):
            train_step(model, args, kwargs, m.loss_fn, opt)
        return clock() - t


def ours(meta_model, m, clock=time.perf_counter):
    t = clock()
    tapescope.profile(meta_model, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)
    return clock() - t


def footprint(spec: str, batch: int, seq: int) -> dict:
    """Peak resident memory of a fresh process that profiles `spec` (run as a subprocess)."""
    code = f"""
import json, resource, time, tapescope
from tapescope.zoo import resolve
m = resolve({spec!r}, batch={batch}, seq={seq})
t = time.perf_counter()
p = tapescope.profile(m.build, *m.inputs, loss_fn=m.loss_fn)
print(json.dumps(dict(seconds=time.perf_counter() - t, ops=len(p.ops), peak=p.peak_bytes,
      params=p.run.parameters, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} time\n")
    print("| model | bare fake trace (fwd+bwd+AdamW) | tapescope.profile | ratio | "
          "MemTracker + FlopCounterMode | ratio | tapescope batch 1e10 / batch 1 |")
    print("|---|---|---|---|---|---|---|")
    for spec, batch, seq in (("zoo:gpt2", 8, 1024), ("torchvision:vit_b_16", 32, None)):
        m = resolve(spec, batch=batch, seq=seq)
        huge = resolve(spec, batch=10**10, seq=seq)
        meta_model = build_on_meta(m.build)
        for f in (bare, ours, rivals):  # warm caches once
            f(meta_model, m)
        times = {"bare": [], "ours": [], "rivals": [], "huge": []}
        runs = {"bare": lambda: bare(meta_model, m, clock),
                "ours": lambda: ours(meta_model, m, clock),
                "huge": lambda: ours(meta_model, huge, clock),
                "rivals": lambda: rivals(meta_model, m, clock)}
        for r in range(args.repeat):
            # the order turns each round and garbage is collected before each run, so that no
            # method pays for the previous one's garbage
            names = list(runs)
            for name in names[r % len(names):] + names[:r % len(names)]:
                gc.collect()
                times[name].append(runs[name]())
        med = {k: statistics.median(v) for k, v in times.items()}

        def ratio(a, b):  # per round, so that a slow stretch of a noisy machine hits both
            return statistics.median(x / y for x, y in zip(times[a], times[b]))

        print(f"| {spec} (batch {batch}) | {med['bare']:.3f} s | {med['ours']:.3f} s | "
              f"{ratio('ours', 'bare'):.2f}x | {med['rivals']:.3f} s | "
              f"{ratio('rivals', 'bare'):.2f}x | {ratio('huge', 'ours'):.2f} |")
    f = footprint("zoo:llama-70b", 1, 4096)
    print(f"\nzoo:llama-70b ({f['params'] / 1e9:.1f}B parameters, batch 1, seq 4096, AdamW): "
          f"{f['ops']} ops profiled in {f['seconds']:.1f} s, predicted peak "
          f"{f['peak'] / 2**30:.0f} GiB; tapescope's process peaked at {f['rss'] / 2**30:.2f} GiB "
          f"resident (torch included).")


if __name__ == "__main__":
    main()
