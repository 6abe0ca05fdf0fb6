"""The winner as something to run: tapescope's own command line that profiles exactly that
candidate, and a torchtitan job config with its launch line.

torchtitan's names (torchtitan/config/configs.py, TrainingConfig and ParallelismConfig):
`training.local_batch_size` is one data-parallel rank's batch per optimizer step (with pipeline
parallelism, split into micro-batches of `parallelism.pipeline_parallel_microbatch_size`),
`training.global_batch_size` adds gradient accumulation when larger than local batch x data
parallel degree. Releases up to 0.2 read these as a TOML file (`--job.config_file`); 0.3 takes a
registered config (`--module llama3 --config llama3_70b`) and the same fields as flags.
Activation checkpointing: torchtitan's "full" is tapescope's full; its "selective" (op level)
recomputes every second matmul, tapescope's "selective" keeps every matmul's output, so that
line is a starting point, not the profiled step.
"""

from __future__ import annotations

import json
import shlex

from .evaluate import Source
from .space import Candidate

__all__ = ["tapescope_command", "torchtitan_toml", "torchtitan_command"]

_TITAN_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B",
                    "looped-bfs": "LoopedBFS", "interleaved-zb": "InterleavedZeroBubble",
                    "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}


def tapescope_command(source: Source, c: Candidate) -> str:
    """`tapescope profile ...` with the candidate's flags: the same profile the search made."""
    from .space import CHECKPOINTING

    layout = c.layout
    args = ["tapescope", "profile", source.spec, "--gpu", source.gpu,
            "--batch", str(c.rank_batch if layout.pp > 1 else c.micro_batch)]
    if source.seq is not None:
        args += ["--seq", str(source.seq)]
    for flag, value in (("--amp", source.amp), ("--dtype", source.dtype)):
        if value:
            args += [flag, value]
    if source.optimizer != "adamw":
        args += ["--optimizer", source.optimizer]
    for flag, n in (("--pp", layout.pp), ("--hsdp", layout.dp_replicate), ("--fsdp", layout.fsdp),
                    ("--cp", layout.cp), ("--tp", layout.tp)):
        if n > 1:
            args += [flag, str(n)]
    if layout.pp > 1:
        args += ["--pp-schedule", c.schedule, "--microbatches", str(c.steps)]
    elif c.steps > 1:
        args += ["--accumulate", str(c.steps)]
    if c.compile:
        args.append("--compile")
    if c.float8:
        args += ["--float8", c.float8]
    line = shlex.join(args)
    if CHECKPOINTING[c.checkpointing] is not None:
        # profile's --checkpoint does not combine with a mesh (a distributed step checkpoints
        # in its parallelize, as torchtitan's does): the API profiles it
        line += (f"  # plus {c.checkpointing} activation checkpointing of every block: "
                 "tapescope.layout_search.profile_candidate(...) profiles it")
    return line


def _titan_fields(c: Candidate, seq: int | None, global_batch: int) -> dict:
    layout = c.layout
    training = {"local_batch_size": c.rank_batch, "global_batch_size": global_batch}
    if seq is not None:
        training["seq_len"] = seq
    parallelism = {"data_parallel_replicate_degree": layout.dp_replicate,
                   "data_parallel_shard_degree": layout.fsdp,
                   "context_parallel_degree": layout.cp,
                   "tensor_parallel_degree": layout.tp,
                   "pipeline_parallel_degree": layout.pp}
    if layout.pp > 1:
        parallelism["pipeline_parallel_schedule"] = _TITAN_SCHEDULES.get(c.schedule, c.schedule)
        parallelism["pipeline_parallel_microbatch_size"] = c.micro_batch
    elif c.steps > 1:
        # accumulation: the global batch is local x dp x steps; torchtitan derives the steps
        training["local_batch_size"] = c.micro_batch
    return {"training": training, "parallelism": parallelism,
            "activation_checkpoint": {"mode": c.checkpointing},
            "compile": {"enable": c.compile}}


def torchtitan_toml(source: Source, c: Candidate, global_batch: int) -> str:
    """A job config (torchtitan's TOML, releases up to 0.2) with the candidate's layout."""
    lines = [f"# tapescope search: {c.label()} on {c.layout.world_size} x {source.gpu}"]
    fields = _titan_fields(c, source.seq, global_batch)
    if source.amp:
        fields["training"]["mixed_precision_param"] = _titan_dtype(source.amp)
    fields.update(_titan_float8(c))
    for section, values in fields.items():
        lines += ["", f"[{section}]"]
        for k, v in values.items():
            text = str(v).lower() if isinstance(v, bool) else \
                f'"{v}"' if isinstance(v, str) else \
                json.dumps(v) if isinstance(v, list) else str(v)  # a TOML array of strings
            lines.append(f"{k} = {text}")
    return "\n".join(lines) + "\n"


def _titan_float8(c: Candidate) -> dict:
    """torchtitan's float8 converter as its TOML releases register and configure it
    (components/quantization/float8.py: `register_model_converter(Float8LinearConverter,
    "quantize.linear.float8")`): tensorwise is no recipe name, with the float8 all-gather and
    precomputed scales under FSDP (only without a recipe: torchtitan asserts so); rowwise is
    `recipe_name`. The output head is filtered as its configs filter it. In 0.3 a registered
    config with `Float8LinearConverter` in its model's converters does the same."""
    if not c.float8:
        return {}
    settings: dict = {"filter_fqns": ["output"]}
    if c.float8 == "tensorwise":
        fsdp = c.layout.fsdp > 1
        settings.update(enable_fsdp_float8_all_gather=fsdp,
                        precompute_float8_dynamic_scale_for_fsdp=fsdp)
    else:
        settings["recipe_name"] = c.float8
    return {"model": {"converters": ["quantize.linear.float8"]},
            "quantize.linear.float8": settings}


def _titan_dtype(amp: str) -> str:
    return {"bf16": "bfloat16", "fp32": "float32"}.get(amp, amp)


def torchtitan_command(source: Source, c: Candidate, global_batch: int, gpus_per_node: int,
                       toml_path: str = "tapescope_search.toml") -> str:
    """The launch line: torchrun over the nodes, torchtitan's trainer reading the TOML, and the
    same fields as flags for releases that take `--module/--config` instead."""
    world = c.layout.world_size
    nodes, per_node = max(1, world // gpus_per_node), min(world, gpus_per_node)
    flags = []
    for section, values in _titan_fields(c, source.seq, global_batch).items():
        if section == "activation_checkpoint":
            continue  # a config class in 0.3, chosen by --config
        for k, v in values.items():
            if isinstance(v, bool):
                if v:
                    flags.append(f"--{section}.{k}")
            else:
                flags += [f"--{section}.{k}", str(v)]
    return (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} -m torchtitan.train "
            f"--job.config_file {toml_path}\n"
            f"# torchtitan 0.3: torchrun ... -m torchtitan.train --module MODULE --config CONFIG "
            + " ".join(flags))
