"""Fuzz tapescope with random module stacks against the CPU allocator (tests/fuzz_models.py).

    python benchmarks/fuzz_models.py --examples 1000 --seed 0

Every example runs the real step on the CPU under torch.profiler and tapescope's prediction of it.
Outcomes: match (equal, up to the 0-d scalar tensors of Python-number operands measured in the
same run), refused (PyTorch raised, and tapescope raised a TapescopeError quoting PyTorch's
message), refused differently (both raised, for different reasons), mismatch (explained
when every op whose inside differs from the allocator's is a named mechanism, a known gap or one
modelled elsewhere whose heuristic the profile reports: tests/fuzz_models.py explain_mismatch;
else unexplained, counted apart), crash (tapescope raised something else), false refusal
(tapescope refused a step PyTorch runs), missed refusal (tapescope profiled a step PyTorch
refuses). Prints a markdown summary for docs/fuzz.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.fuzz_models import check, fuzz_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kinds: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    unexplained, worst = [], []
    t0 = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(losses=("mean", "cross-entropy", "sum")))
    def run(case):
        o = check(case)
        kinds[o.kind] += 1
        if o.kind == "mismatch":
            kinds["mismatch, unexplained" if not o.detail else "mismatch, explained"] += 1
            reasons[o.detail or "(unexplained)"] += 1
            err = max(abs(p - m) / m for p, m in zip(o.predicted, o.measured))
            worst.append((err, o.detail, case.describe(), o.predicted, o.measured))
            if not o.detail:
                unexplained.append((case.describe(), o.predicted, o.measured))
        elif o.kind not in ("match", "refused"):
            unexplained.append((case.describe(), o.kind, o.detail))
        n = sum(v for k, v in kinds.items() if not k.startswith("mismatch,"))
        if n % 50 == 0:
            print(f"  {n} examples, {dict(kinds)}", file=sys.stderr, flush=True)

    run()
    total = sum(v for k, v in kinds.items() if not k.startswith("mismatch,"))
    print(f"{total} examples (hypothesis seed {args.seed}) in {time.perf_counter() - t0:.0f} s\n")
    print("| outcome | examples |\n|---|---|")
    for k in ("match", "refused", "refused differently", "mismatch", "mismatch, explained",
              "mismatch, unexplained", "crash", "false refusal", "missed refusal"):
        print(f"| {k} | {kinds.get(k, 0)} |")
    if reasons:
        print("\n| mismatch explained by | examples | largest error |\n|---|---|---|")
        for why, n in reasons.most_common():
            big = max(e for e, d, *_ in worst if (d or "(unexplained)") == why)
            print(f"| {why} | {n} | {big:.1%} |")
    for u in unexplained:
        print(f"\nUNEXPLAINED: {u}")


if __name__ == "__main__":
    main()
