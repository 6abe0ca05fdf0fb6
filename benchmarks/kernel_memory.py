"""Memory inside each op, real step against the trace: where a kernel's scratch is missing.

For each model, runs the step for real on this CPU (validate.real) and profiles it, then lists the
ops whose allocations inside the op (highest live bytes minus the live bytes before it) differ
between the allocator and the trace (validate.per_op), largest difference first, with how close
each came to the step's peak. A WORKSPACE rule (capture/fidelity) closes such a gap.

    python benchmarks/kernel_memory.py torchvision:resnet18 --batch 4 --seq 64 [--step 2]
"""

from __future__ import annotations

import argparse

import tapescope
from tapescope.validate.per_op import compare_ops
from tapescope.validate.real import run_real_steps
from tapescope.zoo import resolve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="+")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--step", type=int, default=1, choices=(1, 2))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--min-bytes", type=int, default=64,
                    help="ignore differences this small (Python-number temporaries)")
    args = ap.parse_args()
    optimizer = None if args.optimizer == "none" else args.optimizer
    for spec in args.spec:
        m = resolve(spec, batch=args.batch, seq=args.seq)
        p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                              loss_fn=m.loss_fn, optimizer=optimizer, name=m.name)
        real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn,
                              optimizer=optimizer)
        peak = real.peaks[args.step]
        predicted = p.first_step_peak_bytes if args.step == 1 else p.peak_bytes
        print(f"{m.name}: step {args.step} peak measured {peak:,} predicted {predicted:,} "
              f"({(predicted - peak) / peak:+.3%}); {p.run.cpu}")
        ops = [o for o in compare_ops(p, real, args.step)
               if abs(o.measured_excess - o.predicted_excess) >= args.min_bytes]
        ops.sort(key=lambda o: -abs(o.measured_excess - o.predicted_excess))
        print("| # | phase | op | measured inside | predicted inside | difference | below peak |")
        print("|---|---|---|---|---|---|---|")
        for o in ops[:args.top]:
            print(f"| {o.position} | {o.phase} | {o.name} | {o.measured_excess:,} | "
                  f"{o.predicted_excess:,} | {o.predicted_excess - o.measured_excess:+,} | "
                  f"{peak - o.measured_peak:,} |")
        for topic, texts in p.run.heuristics.items():
            for text in texts:
                print(f"estimate: {topic}: {text}")
        print()


if __name__ == "__main__":
    main()
