"""torchtune's compiled README rows (PR #2003's optimization flags: Llama 3.2 3B, A100 80GB, batch 2,
packed to 4096) as tokens/s, GPU-less: the compiled step's own time (Profile.time, the kernels
inductor's wrappers launch: analysis/compiled_time.py) beside the eager "+ packed" row.

The rows, their builders and the 2-and-3-block extrapolation are benchmarks/published_runs.py's
(its `predict` times steps with estimate_step_time on the ops alone, which has no compiled
kernels; this script goes through Profile.time instead). Held-out rows: nothing here is fitted to
them. Prints one JSON object per row and a Markdown table.

    python benchmarks/compiled_torchtune.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))

import published_runs as pr  # noqa: E402

import tapescope  # noqa: E402

# the README's tokens/s per GPU after each flag (the "+ packed" row is published_runs.py's
# torchtune-3b-packed-speed)
PUBLISHED = {"packed": 7075, "packed-compile": 8998, "packed-compile-chunkedce": 9174,
             "packed-compile-chunkedce-ac": 7210, "packed-compile-chunkedce-ac-optinbwd": 7309}
BATCH, SEQ, LAYERS, GPU = 2, 4096, 28, "a100-sxm-80gb"


def step_seconds(opts: dict, extra: dict, layers: int) -> tuple[float, float, float]:
    cfg = replace(pr._L32_3B, n_layers=layers)
    inputs = [tapescope.spec((BATCH, SEQ), dtype=torch.long)] * 2
    p = tapescope.profile(pr.tune_llama(**opts)(cfg), *inputs, device="cuda",
                          gpu=pr.get_gpu(GPU), **extra)
    return p.time.seconds, p.time.host, p.time.gpu_busy


def main() -> None:
    results = {}
    for suffix, technique, _, opts, _ in pr._TUNE_STEPS:
        extra = {"compile": True} if opts.get("compile") else {}
        if suffix.endswith("optinbwd"):
            extra.update(pr._OPT_IN_BWD)
        t0 = time.time()
        a, b = step_seconds(opts, extra, 2), step_seconds(opts, extra, 3)
        seconds, host, busy = (x + (LAYERS - 2) * (y - x) for x, y in zip(a, b))
        tps = BATCH * SEQ / seconds
        results[suffix] = {"technique": technique, "published": PUBLISHED[suffix],
                           "predicted": tps, "error": tps / PUBLISHED[suffix] - 1,
                           "seconds": seconds, "host": host, "gpu_busy": busy,
                           "trace_s": time.time() - t0}
        print(json.dumps({suffix: results[suffix]}), flush=True)
    eager = results["packed"]
    print("\n| row | published tokens/s | predicted | error | speed-up over + packed "
          "(published / predicted) |\n|---|---|---|---|---|")
    for suffix, r in results.items():
        print(f"| torchtune-3b-{suffix} | {r['published']:,} | {r['predicted']:,.0f} | "
              f"{r['error']:+.1%} | {r['published'] / eager['published']:.3f} / "
              f"{r['predicted'] / eager['predicted']:.3f} |")


if __name__ == "__main__":
    main()
