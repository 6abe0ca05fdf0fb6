"""bf16 `bmm` on random shapes and thread counts: bytes inside each product, allocator vs trace.

Draws batched products (batch, M, K, N, threads, mat1 plain or transposed), runs each one-step
forward for real on this CPU (validate.real) and profiles it, and compares the bytes allocated
inside the forward `bmm` (validate.per_op): on AVX512-BF16 the oneDNN scratchpad and operand copies
of capture/fidelity/batched_matmul.py, elsewhere ATen's split path.

    python benchmarks/bf16_bmm_sweep.py --shapes 40 --seed 1 [--json]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import tapescope
from tapescope.validate.per_op import compare_ops
from tapescope.validate.real import run_real_steps


class _Batch(torch.nn.Module):
    """One bf16 batched product of two parameters, mat1 stored transposed where asked."""

    def __init__(self, batch, m, k, n, transposed):
        super().__init__()
        self.transposed = transposed
        shape = (batch, k, m) if transposed else (batch, m, k)
        self.a = torch.nn.Parameter(torch.randn(shape))
        self.w = torch.nn.Parameter(torch.randn(batch, k, n))

    def forward(self, x):
        return torch.bmm(self.a.transpose(1, 2) if self.transposed else self.a, self.w) * x


def _draw(rng: random.Random) -> dict:
    while True:
        case = dict(batch=rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 32]), m=rng.randint(1, 300),
                    k=rng.randint(1, 600), n=rng.randint(1, 300), transposed=rng.random() < 0.4,
                    threads=rng.randint(1, 4))
        if case["batch"] * case["m"] * case["k"] * case["n"] <= 3e7:  # seconds, not minutes
            return case


def _measure(case: dict) -> tuple[int, int]:
    """(allocator, trace) bytes inside the forward bmm, the result included."""
    before = torch.get_num_threads()
    torch.set_num_threads(case["threads"])
    try:
        args = (case["batch"], case["m"], case["k"], case["n"], case["transposed"])
        x = tapescope.spec((1, 1, 1))
        p = tapescope.profile(lambda: _Batch(*args), x, optimizer="sgd", dtype=torch.bfloat16,
                              steps=1)
        real = run_real_steps(lambda: _Batch(*args), (x,), optimizer="sgd", dtype=torch.bfloat16,
                              steps=1)
    finally:
        torch.set_num_threads(before)
    (op,) = [o for o in compare_ops(p, real, 1) if o.name == "aten.bmm" and o.phase == "forward"]
    return op.measured_excess, op.predicted_excess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    exact = 0
    for _ in range(args.shapes):
        case = _draw(rng)
        measured, predicted = _measure(case)
        exact += measured == predicted
        if args.json:
            print(json.dumps(dict(case, measured=measured, predicted=predicted)), flush=True)
        elif measured != predicted:
            print(f"{case}: allocator {measured:,} B, trace {predicted:,} B", flush=True)
    if not args.json:
        print(f"{exact} / {args.shapes} exact (seed {args.seed})")


if __name__ == "__main__":
    main()
