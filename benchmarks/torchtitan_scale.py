"""torchtitan's own Llama 3 at full size with its own `parallelize_llama` (its ParallelDims builds
the mesh inside the parallelisation; FSDP2 with bf16 mixed precision, selective activation
checkpointing), profiled GPU-less on device="cuda" for an H100, per rank: how long it takes and
how much memory tapescope needs (issue 20's "8B, per rank, in under 60 s on this machine").

Each case runs in a fresh process (its resident-memory peak is its own). The model is
torchtitan's `llama3_configs[size]` with each layer given torchtitan's SDPA wrapper (its language
models otherwise take flex attention, compiled, or varlen attention fed by its data loader), as
tests/test_torchtitan.py does at reduced size. Reported: wall and CPU time of the whole profile
(CPU time is what other load on a shared machine inflates least), the rank classes traced, the
peak resident memory, ops per rank, the tensor-parallel collectives per rank, and what tapescope
predicts (peak reserved per rank, step time, tokens/s per GPU).

The step is torchtitan's trainer's: `set_spmd_backend` first, forward, loss and backward inside
the trainer's `train_context` (`get_spmd_context(parallel_dims=...)`, which registers the SPMD
meshes: under spmd_types a module's input and output redistributions - sequence parallelism's
all-gathers and reduce-scatters - are skipped when no mesh is registered, silently), and its
cross-entropy (sum over tokens, loss-parallel over the vocabulary under TP) over the tokens.
`--spmd-backend` picks torchtitan's backend: spmd_types (its default), partial_dtensor (DTensor
for the model-parallel axes) or full_dtensor (DTensor on every axis: the trainer's
`parallelize_inputs` makes the tokens DTensors, here in a forward pre-hook and in the loss); all
three run the same program, so their profiles must agree.
`--layers N` keeps the first N layers (reduced size). A case with a CP degree (8b-fsdp4-cp2-32k)
is torchtitan's `context_parallel_degree` (its apply_cp_to_forward around each SDPA; needs
`--spmd-backend partial_dtensor`), each rank given its 1/cp of the sequence. `--compile` is torchtitan's
`--compile.enable` (apply_compile: each block `.compile(fullgraph=True)`), profiled with
compile=True; `--float8 RECIPE` is its float8 converter (`Float8LinearConverter`, "rowwise" or
"rowwise_with_gw_hp"), made inside the build, where the GPU's capability is the H100's.

    python benchmarks/torchtitan_scale.py [--case 8b-fsdp8] [--spmd-backend partial_dtensor]
        [--layers 8] [--compile] [--float8 rowwise] [--json]

Needs torchtitan 0.3.0: `pip install --no-deps torchtitan==0.3.0 spmd_types tyro einops
docstring_parser typeguard`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASES = {
    # name: (torchtitan config, FSDP degree, TP degree, per-rank batch, sequence[, CP degree])
    "8b-fsdp8": ("8B", 8, 1, 2, 8192),
    "8b-fsdp128": ("8B", 128, 1, 2, 8192),
    "8b-fsdp4-tp2": ("8B", 4, 2, 2, 8192),
    "70b-fsdp32-tp8": ("70B", 32, 8, 2, 8192),
    # context parallelism: each rank holds 1/cp of the sequence (torchtitan's trainer shards the
    # batch with prepare_context_parallel_input); FSDP shards over fsdp x cp, as torchtitan does.
    # torchtitan refuses SDPA + CP under spmd_types: run with --spmd-backend partial_dtensor
    "8b-fsdp4-cp2-32k": ("8B", 4, 1, 1, 32768, 2),
}

_CHILD = r"""
import contextlib, json, resource, sys, time
import torch, tapescope
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import full_dtensor, utils as dist_utils
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

case, backend, layers, compiled, float8 = json.loads(sys.argv[1])
(size, fsdp, tp, batch, seq), cp = case[:5], (case[5:] or [1])[0]
world = fsdp * tp * cp
dist_utils.set_spmd_backend(backend)  # the trainer's first step: torchtitan reads it per call
cfg = llama3_configs[size](attn_backend="varlen")
cfg.layers = cfg.layers[:layers or None]
for layer in cfg.layers:
    layer.attention.inner_attention = ScaledDotProductAttention.Config()


def build():
    # torchtitan's model_registry converts the config before the trainer sets its sharding
    c = cfg
    if float8:
        from torchtitan.components.quantization.float8 import Float8LinearConverter
        c = Float8LinearConverter(Float8LinearConverter.Config(recipe_name=float8)).convert(c)
    set_llama3_sharding_config(c, enable_sp=True)
    return c.build()


# the trainer's train_context of the rank being traced, open while tapescope traces its step
train_context = contextlib.ExitStack()
traced = {}  # the ParallelDims of the rank being traced


def parallelize(model, mesh):
    parallelism = ParallelismConfig(data_parallel_shard_degree=fsdp, tensor_parallel_degree=tp,
                                    context_parallel_degree=cp, spmd_backend=backend)
    dims = ParallelDims.from_config(parallelism, world_size=world)
    dims.build_mesh()
    model = parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                              parallelism=parallelism,
                              compile_config=CompileConfig(enable=compiled, components=["model"]),
                              ac_config=SelectiveAC.Config(), dump_folder="/tmp")
    train_context.close()  # the previous traced rank's
    train_context.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
    traced["dims"] = dims
    if backend == "full_dtensor":  # the trainer's parallelize_inputs: the tokens as DTensors
        model.register_forward_pre_hook(lambda module, args: (as_dtensor(args[0]), *args[1:]))
    return model


def as_dtensor(tokens):
    return full_dtensor.parallelize_inputs(traced["dims"], tokens, tokens, {})[0]


def loss(logits, tokens):
    # torchtitan's CrossEntropyLoss: a sum, divided by the tokens (global_valid_tokens)
    labels = as_dtensor(tokens) if backend == "full_dtensor" else tokens
    return cross_entropy_loss(logits, labels, global_vocab_size=cfg.vocab_size) / tokens.numel()


wall, cpu = time.perf_counter(), time.process_time()
with train_context:
    mesh = {"fsdp": fsdp, **({"cp": cp} if cp > 1 else {}), **({"tp": tp} if tp > 1 else {})}
    p = tapescope.profile(build, tapescope.spec((batch, seq // cp), dtype=torch.long),
                          loss_fn=loss, mesh=mesh,
                          parallelize=parallelize, device="cuda", gpu="h100",
                          compile=True if compiled else None)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
d = p.distributed
tp_collectives = [r for r in p.collective_table if r.group == "tp"]
cp_collectives = [r for r in p.collective_table if r.group == "cp"]
print(json.dumps({"wall": wall, "cpu": cpu, "ranks": d.mesh.world_size,
                  "traced": len(d.profiles), "classes": [len(c) for c in d.classes.members],
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "ops": len(p.ops), "peak_allocated": p.peak_bytes,
                  "regions": p.compiled.regions if compiled else None,
                  "graph_breaks": len(p.compiled.graph_breaks) if compiled else None,
                  "float8_gemms": sum(o.name.startswith("aten._scaled_mm") for o in p.ops),
                  "tp_collectives": sum(r.count for r in tp_collectives),
                  "tp_bytes": sum(r.count * r.nbytes for r in tp_collectives),
                  "cp_collectives": sum(r.count for r in cp_collectives),
                  "cp_bytes": sum(r.count * r.nbytes for r in cp_collectives),
                  "peak_reserved": p.cuda_memory.max_reserved,
                  # no step time for a compiled step yet (issue 33)
                  "step_s": p.time.seconds if p.time is not None else None,
                  # TP ranks share their batch: each TP group of tp GPUs processes batch x seq
                  # a CP rank holds seq / cp of the batch's tokens
                  "tokens_per_s_per_gpu": batch * seq / tp / cp / p.time.seconds
                  if p.time is not None else None}))
"""


BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")


def run(name: str, backend: str = "spmd_types", layers: int | None = None,
        compiled: bool = False, float8: str | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD,
                          json.dumps([CASES[name], backend, layers, compiled, float8])],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="run only these cases (repeatable); default: all")
    ap.add_argument("--spmd-backend", choices=BACKENDS, default="spmd_types",
                    help="torchtitan's parallelism.spmd_backend (default: spmd_types, its own)")
    ap.add_argument("--layers", type=int, help="keep only the model's first N layers")
    ap.add_argument("--compile", action="store_true",
                    help="torchtitan's --compile.enable, profiled with compile=True")
    ap.add_argument("--float8", choices=("rowwise", "rowwise_with_gw_hp"),
                    help="torchtitan's float8 converter with this recipe")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args()
    results = {name: run(name, args.spmd_backend, args.layers, args.compile, args.float8)
               for name in args.case or CASES}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"spmd_backend={args.spmd_backend}" + (f", {args.layers} layers" if args.layers else "")
          + (", compiled" if args.compile else "") + (f", float8 {args.float8}" if args.float8 else ""))
    print("| case | ranks | traced | wall | CPU | resident | ops/rank | TP collectives | "
          "peak allocated | peak reserved | step | tokens/s/GPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    gib = 2 ** 30
    for name, r in results.items():
        print(f"| {name} | {r['ranks']} | {r['traced']} | {r['wall']:.1f} s | {r['cpu']:.1f} s | "
              f"{r['rss'] / gib:.2f} GiB | {r['ops']:,} | {r['tp_collectives']} | "
              f"{r['peak_allocated'] / gib:.2f} GiB | "
              f"{r['peak_reserved'] / gib:.2f} GiB | "
              + (f"{r['step_s']:.2f} s | {r['tokens_per_s_per_gpu']:,.0f} |"
                 if r["step_s"] is not None else "- | - |"))


if __name__ == "__main__":
    main()
