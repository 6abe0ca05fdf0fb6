"""A pipelined step's cost against its micro-batches (issue 35): tapescope traces a schedule's
micro-batches until its steady state repeats (distributed/pipeline.py, capture/repeats.py), so a
step of 128 micro-batches should cost little more than one of 4. Both are timed in this run, on
the same model (a small Llama; the ratio is about op counts, not sizes), and the per-rank peaks
of the long step are checked against tracing every one of its micro-batches.

    python benchmarks/pipeline_repeats.py [--schedule 1f1b] [--pp 2] [--many 128] [--few 4]
        [--no-check]
"""

from __future__ import annotations

import argparse
import time

import torch

import tapescope
import tapescope.distributed.pipeline as pipeline
from tapescope.zoo.llama import Llama, LlamaConfig


def build():
    return Llama(LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=64))


def profile(schedule: str, pp: int, microbatches: int):
    spec = tapescope.spec((microbatches, 32), dtype=torch.long, high=512)
    start = time.perf_counter()
    p = tapescope.profile(build, spec, spec, mesh={"pp": pp},
                          pipeline={"schedule": schedule, "microbatches": microbatches})
    return time.perf_counter() - start, p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--many", type=int, default=128)
    ap.add_argument("--few", type=int, default=4)
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    profile(args.schedule, args.pp, args.few)   # warm-up: imports, first-call caches
    few, _ = profile(args.schedule, args.pp, args.few)
    many, p = profile(args.schedule, args.pp, args.many)
    traced = {r: q.distributed.pipeline_traced_microbatches
              for r, q in p.distributed.profiles.items()}
    print(f"{args.schedule} pp={args.pp}: {args.few} micro-batches {few:.2f} s, {args.many} "
          f"{many:.2f} s, ratio {many / few:.2f} (micro-batches traced per rank: {traced})")
    if args.no_check:
        return
    shortened = pipeline.traced_microbatches
    pipeline.traced_microbatches = lambda n, *_: n   # every micro-batch traced
    try:
        full_s, full = profile(args.schedule, args.pp, args.many)
    finally:
        pipeline.traced_microbatches = shortened
    same = [(a.peak_bytes, a.first_step_peak_bytes) == (b.peak_bytes, b.first_step_peak_bytes)
            for a, b in zip(p.ranks, full.ranks)]
    print(f"every micro-batch traced: {full_s:.2f} s; per-rank peaks equal: {all(same)} "
          f"{[(r.rank, r.peak_bytes, r.first_step_peak_bytes) for r in p.ranks]}")


if __name__ == "__main__":
    main()
