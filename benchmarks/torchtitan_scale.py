"""torchtitan's own Llama 3 at full size with its own `parallelize_llama` (its ParallelDims builds
the mesh inside the parallelisation; FSDP2 with bf16 mixed precision, selective activation
checkpointing), profiled GPU-less on device="cuda" for an H100, per rank: how long it takes and
how much memory tapescope needs (issue 20's "8B, per rank, in under 60 s on this machine").

Each case runs in a fresh process (its resident-memory peak is its own). The model is
torchtitan's `llama3_configs[size]` with each layer given torchtitan's SDPA wrapper (its language
models otherwise take flex attention, compiled, or varlen attention fed by its data loader), as
tests/test_torchtitan.py does at reduced size. Reported: wall and CPU time of the whole profile
(CPU time is what other load on a shared machine inflates least), the rank classes traced, the
peak resident memory, ops per rank, and what tapescope predicts (peak reserved per rank, step
time, tokens/s per GPU).

    python benchmarks/torchtitan_scale.py [--case 8b-fsdp8] [--json]

Needs torchtitan 0.3.0: `pip install --no-deps torchtitan==0.3.0 spmd_types tyro einops
docstring_parser typeguard`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    # name: (torchtitan config, FSDP degree, TP degree, per-rank batch, sequence)
    "8b-fsdp8": ("8B", 8, 1, 2, 8192),
    "8b-fsdp128": ("8B", 128, 1, 2, 8192),
    "70b-fsdp32-tp8": ("70B", 32, 8, 2, 8192),
}

_CHILD = r"""
import json, resource, sys, time
import torch, tapescope
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

size, fsdp, tp, batch, seq = json.loads(sys.argv[1])
world = fsdp * tp
cfg = llama3_configs[size](attn_backend="varlen")
for layer in cfg.layers:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()
set_llama3_sharding_config(cfg, enable_sp=True)


def parallelize(model, mesh):
    parallelism = ParallelismConfig(data_parallel_shard_degree=fsdp, tensor_parallel_degree=tp)
    dims = ParallelDims.from_config(parallelism, world_size=world)
    dims.build_mesh()
    return parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                             parallelism=parallelism, compile_config=CompileConfig(),
                             ac_config=SelectiveAC.Config(), dump_folder="/tmp")


def loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


wall, cpu = time.perf_counter(), time.process_time()
p = tapescope.profile(cfg.build, tapescope.spec((batch, seq), dtype=torch.long), loss_fn=loss,
                      mesh={"fsdp": fsdp, "tp": tp} if tp > 1 else {"fsdp": fsdp}, parallelize=parallelize, device="cuda", gpu="h100")
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
d = p.distributed
print(json.dumps({"wall": wall, "cpu": cpu, "ranks": d.mesh.world_size,
                  "traced": len(d.profiles), "classes": [len(c) for c in d.classes.members],
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "ops": len(p.ops), "peak_allocated": p.peak_bytes,
                  "peak_reserved": p.cuda_memory.max_reserved,
                  "step_s": p.time.seconds,
                  # TP ranks share their batch: each TP group of tp GPUs processes batch x seq
                  "tokens_per_s_per_gpu": batch * seq / tp / p.time.seconds}))
"""


def run(name: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES[name])],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="run only these cases (repeatable); default: all")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    results = {name: run(name) for name in args.case or CASES}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| case | ranks | traced | wall | CPU | resident | ops/rank | peak allocated | "
          "peak reserved | step | tokens/s/GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gib = 2 ** 30
    for name, r in results.items():
        print(f"| {name} | {r['ranks']} | {r['traced']} | {r['wall']:.1f} s | {r['cpu']:.1f} s | "
              f"{r['rss'] / gib:.2f} GiB | {r['ops']:,} | {r['peak_allocated'] / gib:.2f} GiB | "
              f"{r['peak_reserved'] / gib:.2f} GiB | {r['step_s']:.2f} s | "
              f"{r['tokens_per_s_per_gpu']:,.0f} |")


if __name__ == "__main__":
    main()
