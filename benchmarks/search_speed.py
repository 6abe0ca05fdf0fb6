"""The pruned search against brute force over the same space: candidates traced, CPU and wall
seconds, the ranking of the candidates both traced, the winner.

One process each, in this process (workers=1), after an uncounted warm-up trace of each
pipeline degree (a process's first traces pay one-time costs), so that CPU time (time.process_time: this
machine is shared, and wall time moves with the load) counts every trace. Default space: a
Llama 3 8B-like model cut to 2 blocks (dim 4,096, 32 heads, 8 KV heads, FFN 14,336, the
128,256-token vocabulary: its matmuls and logits are the 8B's; a trace's cost is its ops, so two
blocks keep it short) on 8 L4s (24 GB, 4 per node) at 4,096 tokens, PP 1-2, TP 1-2-4, FSDP or
HSDP, checkpointing none / selective / full, at most 8 micro-batches per step; branch and bound
keeps the top 3 exact (--top; several, 3,1: a pruned search each against one brute force).
Prints a Markdown table (docs/benchmarks.md keeps the last ones). Issue 35's runs:

    python benchmarks/search_speed.py --gpus 8 --global-batch 16 --max-steps 4 --top 3,1
    python benchmarks/search_speed.py --gpus 64 --global-batch 128 --max-steps 4 --top 3,1
"""

from __future__ import annotations

import argparse
import time

import tapescope

SPEC = ("zoo:llama:n_layers=2,dim=4096,n_heads=32,n_kv_heads=8,ffn_dim=14336,"
        "vocab_size=128256,max_seq_len=8192")


def run(args, brute: bool, top: int):
    cpu, wall = time.process_time(), time.perf_counter()
    r = tapescope.search(args.spec, gpus=args.gpus, gpu=args.gpu, global_batch=args.global_batch,
                         seq=args.seq, pp=(1, 2), tp=(1, 2, 4), max_steps=args.max_steps,
                         gpus_per_node=args.gpus_per_node, brute_force=brute, top=top)
    return r, time.process_time() - cpu, time.perf_counter() - wall


def warm_up(args):
    """Trace one candidate of each pipeline degree first, uncounted: a process's first traces
    pay one-time costs (imports, torch's dispatch caches) that would fall on whichever search
    ran first."""
    from tapescope.layout_search import Source, SearchSpace, candidate_grid
    from tapescope.layout_search.evaluate import evaluate

    source = Source(args.spec, args.seq, args.gpu)
    space = SearchSpace(args.gpus, args.global_batch, args.gpus_per_node, (1, 2), (1, 2, 4),
                        checkpointing=("none",), max_steps=args.max_steps)
    seen = set()
    for c in candidate_grid(space).candidates:
        if c.layout.pp not in seen:
            seen.add(c.layout.pp)
            evaluate(source, c, args.global_batch * args.seq)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default=SPEC)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=4)
    ap.add_argument("--gpu", default="l4")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--top", default="3", help="rows kept exact by branch and bound; several "
                    "(3,1): one pruned search each, against one brute force")
    args = ap.parse_args()
    tops = [int(t) for t in args.top.split(",")]
    warm_up(args)
    pruned = [run(args, False, top) for top in tops]
    brute, b_cpu, b_wall = run(args, True, tops[0])
    print(f"{args.spec} on {args.gpus} x {args.gpu}, global batch {args.global_batch} x "
          f"{args.seq}\n")
    print("| search | traced | ruled out | fit | CPU s | wall s | winner |")
    print("|---|---|---|---|---|---|---|")
    for name, (r, cpu, wall) in [*((f"pruned, top {t}", p) for t, p in zip(tops, pruned)),
                                 ("brute force", (brute, b_cpu, b_wall))]:
        w = r.winner
        print(f"| {name} | {len(r.outcomes)} | {len(r.pruned)} | {len(r.ranked)} | {cpu:.1f} | "
              f"{wall:.1f} | {w.candidate.label()} ({w.tokens_per_second:,.0f} tokens/s) |"
              if w else f"| {name} | {len(r.outcomes)} | {len(r.pruned)} | 0 | {cpu:.1f} | "
              f"{wall:.1f} | - |")
    for top, (r, cpu, wall) in zip(tops, pruned):
        print()
        compare(args, top, r, cpu, wall, brute, b_cpu, b_wall)


def compare(args, top, pruned, p_cpu, p_wall, brute, b_cpu, b_wall):
    """What the pruned search at `top` got right against brute force, and what it ruled out."""
    traced = {o.candidate for o in pruned.outcomes}
    same = [o.candidate.label() for o in pruned.ranked] == \
        [o.candidate.label() for o in brute.ranked if o.candidate in traced]
    equal = [o.candidate for o in pruned.ranked[:top]] == \
        [o.candidate for o in brute.ranked[:top]]
    by = {o.candidate: o for o in brute.outcomes}
    bounds_hold = all(by[c].status != "fits" or by[c].step_seconds >= b
                      for c, b in pruned.bounds.items())
    rules = {}
    for _, why in pruned.pruned:
        rule = why.split(":")[0]
        rules[rule] = rules.get(rule, 0) + 1
    oom = {o.candidate for o in brute.outcomes if o.status == "oom"}
    rules_hold = all(c in oom for c, why in pruned.pruned if why.startswith("out of memory"))
    print(f"top {top}: speed-up {b_cpu / p_cpu:.2f}x CPU, {b_wall / p_wall:.2f}x wall; top {top} "
          f"equal: {equal}; ranking of the candidates both traced equal: {same}; winner equal: "
          f"{pruned.winner.candidate == brute.winner.candidate}; every out-of-memory rule "
          f"confirmed by brute force: {rules_hold}; every bound at most the traced step: "
          f"{bounds_hold}\nruled out by rule: "
          + ", ".join(f"{k} {v}" for k, v in sorted(rules.items())))
    # what caps the ratio: a bound transfers within a layout's model split (bounds.py), so each
    # split that may enter the top is traced once at least
    splits = {(c.layout.tp, c.layout.pp, c.layout.cp, c.schedule) for c in by}
    print(f"layouts: {len({c.layout for c in by})}, model splits (TP, PP, CP): {len(splits)}; "
          f"the pruned search traced {len(pruned.outcomes)} of {len(by)} candidates")


if __name__ == "__main__":
    main()
