"""Why the for-loop optimizer cannot be replayed one parameter at a time (issue 25, candidate 1).

Replaying a parameter's recorded op sequence for the other parameters of its shape would have to
run (or stand in for) torch's for-loop `_single_tensor_adam` one parameter at a time. This script
does exactly that, with torch's own function called on one-parameter lists, and compares the
step-2 memory with the whole loop's and with the real allocator's:

    python benchmarks/optimizer_replay.py

torch's loop binds each parameter's `denom` to a local that the next parameter's `denom`
replaces, so the real step holds two at once; the per-parameter calls free each one at the
call's return. It also times the two optimizer steps of GPT-2 and ViT-B/16 profiles (their share of it is
what candidate 1 would remove).
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.optim.adam as adam_module

import tapescope
from tapescope.capture.model import build_on_meta
from tapescope.validate.real import run_real_steps
from tapescope.zoo import resolve


class ThreeSquareLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 1024, bias=False)
        self.b = nn.Linear(1024, 1024, bias=False)
        self.c = nn.Linear(1024, 8, bias=False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def for_loop_adamw(params):
    return torch.optim.AdamW(params, foreach=False)


def step2(x):
    p = tapescope.profile(ThreeSquareLinears, x, optimizer=for_loop_adamw)
    t = p.trace
    seg = next(s for s in t.segments if s.step == 2 and s.label == "optimizer")
    return p.peak_bytes, t.events[seg.events.start:seg.events.stop]


def per_parameter(loop):
    """torch's for-loop Adam called once per parameter, in order (what a replay would do)."""
    def run(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *args, **kwargs):
        for i in range(len(params)):
            loop(params[i:i + 1], grads[i:i + 1], exp_avgs[i:i + 1], exp_avg_sqs[i:i + 1],
                 max_exp_avg_sqs[i:i + 1], state_steps[i:i + 1], *args, **kwargs)
    return run


def optimizer_share(spec: str, batch: int, seq: int | None, repeat: int = 5) -> tuple[float, float]:
    """(share of the profile, seconds) spent in the two optimizer steps: the median of `repeat`
    warm profiles, by share (the machine's load moves seconds more than shares)."""
    m = resolve(spec, batch=batch, seq=seq)
    meta = build_on_meta(m.build)
    tapescope.profile(meta, *m.inputs, loss_fn=m.loss_fn)  # warm
    # AdamW is what profile() makes, and torch wraps each optimizer class's own step
    spent, step = [], torch.optim.AdamW.step

    def timed(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return step(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t)

    rounds = []
    torch.optim.AdamW.step = timed
    try:
        for _ in range(repeat):
            spent.clear()
            t = time.perf_counter()
            tapescope.profile(meta, *m.inputs, loss_fn=m.loss_fn)
            rounds.append((sum(spent) / (time.perf_counter() - t), sum(spent)))
    finally:
        torch.optim.AdamW.step = step
    return sorted(rounds)[len(rounds) // 2]  # the median round by share


def main():
    x = torch.randn(2, 1024)
    whole_peak, whole_events = step2(x)
    loop = adam_module._single_tensor_adam
    adam_module._single_tensor_adam = per_parameter(loop)
    try:
        split_peak, split_events = step2(x)
    finally:
        adam_module._single_tensor_adam = loop
    real = run_real_steps(ThreeSquareLinears, (x,), optimizer=for_loop_adamw)
    print(f"step-2 peak: real allocator {real.peaks[2]:,} B, whole loop traced {whole_peak:,} B, "
          f"per-parameter calls {split_peak:,} B ({split_peak - real.peaks[2]:+,} B)")
    print(f"step-2 optimizer events, whole loop:         {whole_events}")
    print(f"step-2 optimizer events, per-parameter calls: {split_events}")
    for spec, batch, seq in (("zoo:gpt2", 8, 1024), ("torchvision:vit_b_16", 32, None)):
        share, seconds = optimizer_share(spec, batch, seq)
        print(f"{spec} (batch {batch}): the two optimizer steps {seconds:.3f} s, {share:.0%} of "
              "the profile (median of 5)")


if __name__ == "__main__":
    main()
