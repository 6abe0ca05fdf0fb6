"""How long simulating every rank of a large job takes, and how much memory: the scale goals of
distributed profiles (docs/distributed.md keeps the last table).

Each case runs in a fresh process (so that its resident-memory peak is its own): a Llama-3-like
model on device cuda (H100 rules) with bf16 mixed precision, the preset parallelisation (TP inside
a node with torchtitan's plan, FSDP2 over the rest), AdamW, two steps. Reported: wall and CPU time
of the whole profile (the CPU time is what the machine's other load does not inflate), the CPU
time to trace rank 0 alone (one rank's trace: its fake world, parallelisation, steps and
analysis), the ratio of the whole to it, the rank classes traced, the peak resident memory, and
the predicted per-rank peak.

    python benchmarks/distributed_scale.py [--case 70b-64] [--case 405b-1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    # name: (spec, fsdp, tp, batch, seq)
    "70b-64": ("zoo:llama-70b", 8, 8, 1, 4096),
    "405b-1024": ("zoo:llama3-405b", 128, 8, 1, 8192),
}

_CHILD = r"""
import json, resource, sys, time
import torch, tapescope
from tapescope.zoo import resolve
from tapescope.distributed.presets import Layout, preset_parallelize
spec, fsdp, tp, batch, seq = json.loads(sys.argv[1])
m = resolve(spec, batch=batch, seq=seq)
layout = Layout(fsdp=fsdp, tp=tp)
wall, cpu = time.perf_counter(), time.process_time()
p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                      device="cuda", gpu="h100", mesh=layout.mesh,
                      parallelize=preset_parallelize(layout, torch.bfloat16))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
d = p.distributed
print(json.dumps({"wall": wall, "cpu": cpu, "rank0": d.trace_seconds[0],
                  "rank0_cpu": d.trace_cpu_seconds[0],
                  "traced": len(d.profiles), "ranks": d.mesh.world_size,
                  "classes": [len(c) for c in d.classes.members],
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": p.peak_bytes, "ops": len(p.ops), "step_s": p.time.seconds,
                  "mfu": p.time.mfu}))
"""


def run(name: str) -> dict:
    spec, fsdp, tp, batch, seq = CASES[name]
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([spec, fsdp, tp, batch, seq])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    args = ap.parse_args()
    print("| case | ranks | traced (classes) | wall | CPU | rank 0 alone, CPU | N ranks / one rank "
          "(CPU) | peak RSS | per-rank peak | ops per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.case or list(CASES):
        r = run(name)
        print(f"| {name} | {r['ranks']} | {r['traced']} ({'+'.join(map(str, r['classes']))}) "
              f"| {r['wall']:.1f} s | {r['cpu']:.1f} s | {r['rank0_cpu']:.1f} s "
              f"| {r['cpu'] / r['rank0_cpu']:.2f}x | {r['rss'] / 2**30:.2f} GiB "
              f"| {r['peak'] / 2**30:.1f} GiB | {r['ops']} |", flush=True)


if __name__ == "__main__":
    main()
