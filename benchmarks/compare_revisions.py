"""Is a change slower? tapescope.profile of two source trees, measured in the same run.

Two worker processes, one importing each tree (PYTHONPATH), warm their caches, then profile the
same models in alternation: round r asks worker A then B, round r+1 B then A, so that a slow stretch
of a noisy machine hits both. Times are the worker's CPU time (time.process_time: a shared machine's
waiting does not count); ratios are medians of per-round ratios (after / before).

    git worktree add /tmp/before <old commit>
    python benchmarks/compare_revisions.py /tmp/before/src src --repeat 8 [--device cuda]

`--device cuda` traces the steps for an H100 (no GPU needed): AdamW is then foreach, as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import gc, json, sys, time
import tapescope
from tapescope.capture.model import build_on_meta
from tapescope.zoo import resolve
models = {}
device = json.loads(sys.argv[1])
for line in sys.stdin:
    spec, batch, seq = json.loads(line)
    key = (spec, batch, seq)
    if key not in models:
        m = resolve(spec, batch=batch, seq=seq)
        models[key] = (m, build_on_meta(m.build))
        tapescope.profile(models[key][1], *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          **device)
    m, meta = models[key]
    gc.collect()
    t = time.process_time()  # CPU time: what a loaded machine's waiting does not inflate
    tapescope.profile(meta, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn, **device)
    print(json.dumps(time.process_time() - t), flush=True)
"""

MODELS = (("zoo:gpt2", 8, 1024), ("torchvision:vit_b_16", 32, None))


class Worker:
    def __init__(self, src: str, device: dict):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(device)],
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        self.src = src

    def run(self, model) -> float:
        self.p.stdin.write(json.dumps(model) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before", help="src folder of the old tree")
    ap.add_argument("after", help="src folder of the new tree")
    ap.add_argument("--repeat", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the steps traced for an H100 without a GPU (a foreach AdamW)")
    args = ap.parse_args()
    device = {"device": "cuda", "gpu": "h100"} if args.device == "cuda" else {}
    workers = {"before": Worker(args.before, device), "after": Worker(args.after, device)}
    print("| model | before | after | after / before |")
    print("|---|---|---|---|")
    try:
        for model in MODELS:
            times = {"before": [], "after": []}
            for r in range(args.repeat):
                order = ("before", "after") if r % 2 == 0 else ("after", "before")
                for name in order:
                    times[name].append(workers[name].run(model))
            ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"]))
            print(f"| {model[0]} (batch {model[1]}) | {statistics.median(times['before']):.3f} s "
                  f"| {statistics.median(times['after']):.3f} s | {ratio:.3f}x |", flush=True)
    finally:
        for w in workers.values():
            w.close()


if __name__ == "__main__":
    main()
