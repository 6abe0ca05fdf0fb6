"""Proven lower bounds on a pipelined candidate's per-rank live bytes, before its own trace.

A pipelined candidate costs 2-4 unpipelined ones to trace (its stages' micro-batches), and at
70B most pipelined layouts run out of memory on every stage whatever their micro-batch and
checkpointing. A floor on what a stage's rank provably holds at one instant of the step, above
what the GPU's caching allocator can ever hand out, rules such a candidate out as out of memory
without tracing it (runner.py's gate; its memory rules then extend it to the rest of the
family). Each floor is a small rule over the model's parameters on meta (no trace); the largest
applies. Like bounds.py's BOUNDS, a rule returns None where its proof does not hold.

What "out of memory" compares with: analysis/gpu_memory.py replays the step's allocations on
the caching allocator with `capacity` = the GPU's memory less the CUDA context
(`allocator_capacity`); every live tensor storage is an allocation of at least its bytes (the
allocator rounds up), so live bytes above the capacity at any instant cannot be served, and
the replay runs out there (a freed cached block is released and the request retried before
it reports out of memory, so nothing but live tensors can be counted on).

Rules:
- `fsdp2_state_across_micro_batches`: a stage sharded by FSDP2 keeps every block's unsharded
  parameters and unsharded gradients from its first backward to the step's gradient reduction
  (torch's pipelining runs every backward without gradient sync or resharding), plus the
  sharded parameters. The instant: the end of any of the stage's backward actions.

Left out (not proven here, so not counted): the saved activations of the micro-batches in
flight, the embedding, the final norm and the output layer (FSDP2's root group: when its
post-backward runs differs), the optimizer state (it exists from the first step's optimizer
on), the gradients' and parameters' padding. Not applied to schedules with several stages a
rank or split backwards (interleaved, looped, zero-bubble, V), to compiled candidates, float8
(its all-gather may run in float8) or a stage that FSDP2 does not shard.

tests/test_memory_floors.py checks every floor against brute force: on every pipelined
candidate of a reduced space, each rank class's traced peak live bytes are at least the
floor, and the gate rules out only candidates whose trace runs out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .space import Candidate

__all__ = ["MemoryFloor", "ModelParameters", "model_parameters", "memory_floor",
           "allocator_capacity", "FLOORS", "fsdp2_state_across_micro_batches"]


@dataclass(frozen=True)
class MemoryFloor:
    bytes: int
    stage: int      # the pipeline rank that holds at least `bytes`
    reason: str     # what proves it


@dataclass(frozen=True)
class ModelParameters:
    """The model's trainable parameters as the rules need them, read once off a meta build:
    per transformer block in the model's order, each parameter's shape."""

    blocks: tuple          # per block: tuple of parameter shapes (tuples of ints)
    dtype: torch.dtype     # the parameters' dtype as built (the sharded fp32 master copy)
    param_dtype: torch.dtype | None   # FSDP2's MixedPrecisionPolicy: the unsharded parameters'
    reduce_dtype: torch.dtype | None  # and the gradients' (None: no policy, the parameters')


def model_parameters(source) -> ModelParameters:
    """The ModelParameters of a search's `Source`, with the mixed-precision policy the search's
    candidates shard with (evaluate.candidate_options: FSDP2 gathers in the amp dtype, reduces
    in fp32)."""
    from ..capture.model import model_of, transformer_blocks
    from ..options import resolve_dtype

    workload, _ = source.workload(1)
    model = model_of(workload.model)
    dtype = resolve_dtype(source.dtype)
    built = next((p.dtype for p in model.parameters()), torch.float32)
    mp = resolve_dtype(source.amp) if source.amp else None
    blocks = tuple(tuple(tuple(p.shape) for p in b.parameters() if p.requires_grad)
                   for b in transformer_blocks(model))
    return ModelParameters(blocks, dtype or built, mp, torch.float32 if mp is not None else None)


def _least_tp_chunk(shape: tuple, tp: int) -> int:
    """The fewest elements any tensor-parallel rank holds of a parameter of `shape`, whatever
    the TP plan: replicated (all of it) or sharded on one dimension as torch.chunk splits it
    (DTensor's Shard: chunks of ceil(n / tp), the last ones smaller or empty)."""
    numel = 1
    for n in shape:
        numel *= n
    if tp == 1:
        return numel
    least = numel
    for n in shape:
        if n:
            step = -(-n // tp)
            least = min(least, numel // n * max(0, n - (tp - 1) * step))
    return least


def fsdp2_state_across_micro_batches(c: Candidate, model: ModelParameters) -> MemoryFloor | None:
    """Each stage's rank holds, at the end of each of its backward actions, every block's
    FSDP2-unsharded parameters (the mixed-precision param dtype) and unsharded gradients (the
    reduce dtype, or the parameters' without a policy), and its sharded parameters.

    Why (torch 2.14's pipelining/stage.py and fsdp/_fully_shard): before every backward action
    `backward_maybe_with_nosync` sets `set_is_last_backward(False)`,
    `set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)` on an FSDP
    stage (the last backward too: the reduction is `perform_reduce_grad`, the schedule's step
    after every backward). So each block's FSDPParamGroup.pre_backward gathers its parameters
    (all-gather outputs of at least the TP-local elements, in param_dtype) and its post_backward
    (reduce_grads False) neither reshards them nor reduce-scatters: `to_accumulated_grad_if_needed`
    keeps the gradient as `unsharded_accumulated_grad` in reduce_dtype (the TP-local elements),
    and later backwards add into it (`accumulate_unsharded_grad_if_needed`); both live until
    `perform_reduce_grad`. A GPipe / 1F1B stage's backward action is a full backward through
    every block of the stage, so at its end all of them hold both. The sharded parameters live
    the whole step (FSDP2 pads each rank's shard to ceil(dim 0 / shard degree) rows: at least
    1 / shard degree of the TP-local elements). The blocks of stage s are
    distributed/pipeline.py's `block_range`; a TP rank holds at least `_least_tp_chunk` of each
    parameter."""
    layout = c.layout
    if layout.pp == 1 or c.schedule not in ("1f1b", "gpipe") or layout.shard_degree == 1 \
            or c.compile or c.float8 is not None or len(model.blocks) < layout.pp:
        return None
    from ..distributed.pipeline import block_range

    gathered = (model.param_dtype or model.dtype).itemsize
    reduced = (model.reduce_dtype or model.param_dtype or model.dtype).itemsize
    best = None
    for s in range(layout.pp):
        blocks = block_range(s, layout.pp, len(model.blocks))
        local = [_least_tp_chunk(shape, layout.tp) for b in blocks for shape in model.blocks[b]]
        unsharded = sum(local) * gathered
        grads = sum(local) * reduced
        shards = sum(n // layout.shard_degree for n in local) * model.dtype.itemsize
        total = unsharded + grads + shards
        if best is None or total > best.bytes:
            best = MemoryFloor(total, s, (
                f"stage {s}'s blocks {blocks.start}-{blocks.stop - 1} keep their FSDP2-unsharded "
                f"parameters ({_gib(unsharded)}) and gradients ({_gib(grads)}) from the first "
                f"backward to the step's gradient reduction (torch's pipelining backward: no "
                f"reshard, no gradient sync), beside their shards ({_gib(shards)})"))
    return best


FLOORS = (fsdp2_state_across_micro_batches,)


def memory_floor(c: Candidate, model: ModelParameters) -> MemoryFloor | None:
    """The largest floor the rules give `c` (None: no rule applies)."""
    floors = [f for rule in FLOORS if (f := rule(c, model)) is not None]
    return max(floors, key=lambda f: f.bytes, default=None)


def allocator_capacity(gpu) -> int:
    """The bytes analysis/gpu_memory.py's replay lets the caching allocator take from `gpu` (a
    devices.gpus.GPU): its memory as torch reports it, less the CUDA context
    (predict_cuda_memory)."""
    from ..devices.gpus import cuda_context_bytes

    return (gpu.reported_memory_bytes or gpu.memory_bytes) - cuda_context_bytes(gpu)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
