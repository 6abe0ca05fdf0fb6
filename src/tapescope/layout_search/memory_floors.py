"""Proven lower bounds on a pipelined candidate's per-rank live bytes, before its own trace.

A pipelined candidate costs 2-4 unpipelined ones to trace (its stages' micro-batches), and at
70B most pipelined layouts run out of memory on every stage whatever their micro-batch and
checkpointing. A floor on what a stage's rank provably holds at one instant of the step, above
what the GPU's caching allocator can ever hand out, rules such a candidate out as out of memory
without tracing it (runner.py's gate; its memory rules then extend it to the rest of the
family). Each floor is a small rule over the model's parameters on meta and the unpipelined
traces so far; the largest applies. Like bounds.py's BOUNDS, a rule returns None where its
proof does not hold.

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
  sharded parameters. The instant: the end of any of the stage's backward actions. From the
  model alone: it applies before any trace.
- `activations_in_flight`: at the end of each of the stage's actions, the saved tensors of the
  micro-batches in flight (the schedule's own order), each at least what the unpipelined
  twin's trace shows the stage's blocks (and on the last stage the head: final norm, output
  layer, loss) keep for their backward (`Outcome.saved_bytes`, `saved_block_bytes`), beside
  the FSDP2 state alive at that instant.

Left out (not proven here, so not counted): the embedding's, the final norm's and the output
layer's parameters and gradients (FSDP2's root group: when its post-backward runs differs),
the embedding's saved tensors, every temporary, the optimizer state (it exists from the first
step's optimizer on), the gradients' and parameters' padding. Not applied to schedules with several stages a rank
or split backwards (interleaved, looped, zero-bubble, V); the FSDP2 part not to compiled
candidates, float8 (its all-gather may run in float8) or a stage that FSDP2 does not shard.

tests/test_memory_floors.py checks every floor against brute force: on every pipelined
candidate of a reduced space, each rank class's traced peak live bytes are at least the
floor, and the gate rules out only candidates whose trace runs out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .space import Candidate

__all__ = ["MemoryFloor", "ModelParameters", "Twins", "model_parameters", "memory_floor",
           "saved_block_bytes", "allocator_capacity", "FLOORS",
           "fsdp2_state_across_micro_batches", "activations_in_flight"]


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


@dataclass
class Twins:
    """Unpipelined traces with `Outcome.saved_bytes`, by what decides a block's saved tensors
    whatever the pipeline and data-parallel degrees (bounds._pipeline_twin: the TP / CP split,
    whether FSDP2's mixed precision applies, compile, float8)."""

    by_split: dict = field(default_factory=dict)
    added: int = 0     # how many were added (a cached floor is stale once this grows)

    def add(self, o) -> None:
        if o.saved_bytes and o.candidate.layout.pp == 1:
            self.by_split.setdefault(_pipeline_twin(o.candidate), []).append(o)
            self.added += 1

    def for_candidate(self, c: Candidate) -> list:
        return self.by_split.get(_pipeline_twin(c), [])


def saved_block_bytes(q, blocks: list) -> tuple:
    """Per block (fqns in the model's order), the bytes of the storages its forward ops made in
    the rank's first forward that no free ends before the first backward op after it (q: the
    rank's Profile): what autograd (or the blocks after it, the loss) keeps of the block for
    the backward; then the same for the forward ops after the last block that belong to no
    block (the head: the final norm, the output layer, the loss). Each storage counts once,
    however many tensors view it; only the profiled device's (checkpointing stashes the CPU
    generator's state, 5,056 bytes, on the host); storages with a role
    (parameters, gradients, optimizer state, FSDP2's unsharded parameters and buffers, inputs)
    are left out: FSDP2 resizes its unsharded parameters away and back (a block that keeps
    them after forward, the last, would count them)."""
    from ..capture.records import BACKWARD, FORWARD
    from .bounds import enclosing

    block = enclosing({fqn: i for i, fqn in enumerate(blocks)})   # module -> block index

    head = len(blocks)
    made: dict = {}            # record index -> block (head: after the last), the first forward's
    backward = None            # record index of the first backward op after them
    last_ran = False           # the last block's forward has begun
    for op in q.ops:
        if op.phase == FORWARD and not op.recompute and backward is None:
            b = block(op.module)
            last_ran = last_ran or b == head - 1
            if b is not None or last_ran:
                made[op.record.index] = head if b is None else b
        elif op.phase == BACKWARD and made:
            backward = op.record.index
            break
    if backward is None:
        return ()
    trace = q.trace
    born: dict = {}            # storage -> block
    for i, sid, delta in trace.events:
        if i >= backward:
            break
        if delta > 0:
            st = trace.storages[sid]
            if i in made and sid not in born and not st.roles and st.device == trace.device:
                born[sid] = made[i]
        else:
            born.pop(sid, None)
    out = [0] * (len(blocks) + 1)
    for sid, b in born.items():
        out[b] += trace.storages[sid].nbytes
    return tuple(out)


def _pipeline_twin(c: Candidate) -> tuple:
    from .bounds import _pipeline_twin as twin

    return twin(c)


def _fsdp2_applies(c: Candidate, model: ModelParameters) -> bool:
    """Whether the stages' FSDP2 behaviour below is proven for `c`: a one-stage-a-rank
    schedule with full backwards, FSDP2 sharding the stage, no compile, no float8."""
    return c.layout.pp > 1 and c.schedule in ("1f1b", "gpipe") and \
        c.layout.shard_degree > 1 and not c.compile and c.float8 is None and \
        len(model.blocks) >= c.layout.pp


def _stage_state(c: Candidate, model: ModelParameters, s: int) -> tuple:
    """(unsharded parameters, unsharded gradients, shards) bytes of stage s's blocks on each of
    its ranks (fsdp2_state_across_micro_batches' docstring)."""
    from ..distributed.pipeline import block_range

    layout = c.layout
    blocks = block_range(s, layout.pp, len(model.blocks))
    local = [_least_tp_chunk(shape, layout.tp) for b in blocks for shape in model.blocks[b]]
    gathered = (model.param_dtype or model.dtype).itemsize
    reduced = (model.reduce_dtype or model.param_dtype or model.dtype).itemsize
    return (sum(local) * gathered, sum(local) * reduced,
            sum(n // layout.shard_degree for n in local) * model.dtype.itemsize)


def _state_reason(c: Candidate, model: ModelParameters, s: int, state: tuple) -> str:
    from ..distributed.pipeline import block_range

    blocks = block_range(s, c.layout.pp, len(model.blocks))
    unsharded, grads, shards = state
    return (f"stage {s}'s blocks {blocks.start}-{blocks.stop - 1} keep their FSDP2-unsharded "
            f"parameters ({_gib(unsharded)}) and gradients ({_gib(grads)}) from the first "
            f"backward to the step's gradient reduction (torch's pipelining backward: no "
            f"reshard, no gradient sync), beside their shards ({_gib(shards)})")


def fsdp2_state_across_micro_batches(c: Candidate, model: ModelParameters,
                                     twins: Twins | None = None) -> MemoryFloor | None:
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
    if not _fsdp2_applies(c, model):
        return None
    best = None
    for s in range(c.layout.pp):
        state = _stage_state(c, model, s)
        if best is None or sum(state) > best.bytes:
            best = MemoryFloor(sum(state), s, _state_reason(c, model, s, state))
    return best


def activations_in_flight(c: Candidate, model: ModelParameters,
                          twins: Twins | None = None) -> MemoryFloor | None:
    """At the end of each compute action of stage s, the rank holds the saved tensors of every
    micro-batch whose forward ran on it and whose backward has not, each at least the stage's
    blocks' `Outcome.saved_bytes` (the last stage's with the head's: the final norm, the output
    layer and the loss, which torch's schedule computes in the last stage's forward action,
    `_maybe_compute_loss`, and whose graph it keeps for that micro-batch's backward) of an
    unpipelined twin (the same TP / CP split, mixed
    precision, compile and float8; a micro-batch as small or smaller, as much recompute or
    more); with FSDP2 (`_fsdp2_applies`), beside its state at that instant: after a backward,
    the unsharded parameters, gradients and shards (fsdp2_state_across_micro_batches); after a
    forward, the unsharded gradients once a backward has run (they live to the step's
    reduction; the unsharded parameters may be resharded after forward) and the shards.

    Why the activations: the micro-batches in flight come from the schedule's own order
    (distributed/pipeline.py's `_single_stage_kinds`: torch's GPipe and 1F1B
    `_step_microbatches`, one stage a rank). A block of the stage runs the twin's ops at the
    twin's shapes on a micro-batch of the same size (the same TP plan, checkpointing and FSDP2
    mixed precision: evaluate.candidate_options), so it makes the same storages; what keeps
    them in the twin from the block's forward to the first backward op is the autograd graph
    of the blocks and the loss, or a stage boundary (torch's stage keeps its outputs in
    `fwd_cache` until the micro-batch's backward on it): untouched on the stage until its
    backward of that micro-batch. Micro-batches hold distinct storages. A smaller micro-batch,
    or more recompute, saves no more (the premise of the runner's memory rules: memory grows
    with the micro-batch, checkpointing saves memory). The least of the twin's rank classes is
    read. Not with several stages a rank or split backwards (interleaved, zero-bubble, V)."""
    from ..distributed.pipeline import _single_stage_kinds, block_range
    from .space import RECOMPUTE_ORDER

    layout = c.layout
    if layout.pp == 1 or c.schedule not in ("1f1b", "gpipe") or twins is None or \
            len(model.blocks) < layout.pp:
        return None
    n = len(model.blocks)
    heavier = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(c.checkpointing):]
    usable = [x for x in twins.for_candidate(c) if x.candidate.micro_batch <= c.micro_batch
              and x.candidate.checkpointing in heavier
              and all(len(r) == n + 1 for r in x.saved_bytes)]
    if not usable:
        return None
    fsdp = _fsdp2_applies(c, model)
    best = None
    for s in range(layout.pp):
        blocks = block_range(s, layout.pp, n)
        held = [*blocks, *([n] if s == layout.pp - 1 else [])]   # the last stage: the head
        twin = max(usable, key=lambda x: min(sum(r[b] for b in held) for r in x.saved_bytes))
        per_micro_batch = min(sum(r[b] for b in held) for r in twin.saved_bytes)
        unsharded, grads, shards = _stage_state(c, model, s) if fsdp else (0, 0, 0)
        forwards = backwards = 0
        for kind in _single_stage_kinds(c.schedule, c.steps, layout.pp, s):
            if kind == "F":
                forwards += 1
                held = shards + (grads if backwards else 0)
            else:
                backwards += 1
                held = shards + grads + unsharded
            live = forwards - backwards
            total = held + live * per_micro_batch
            if best is None or total > best.bytes:
                state = f"; {_state_reason(c, model, s, (unsharded, grads, shards))}" \
                    if fsdp and kind == "B" else ""
                best = MemoryFloor(total, s, (
                    f"after {forwards} forwards and {backwards} backwards, stage {s} "
                    f"holds {live} micro-batches' saved tensors ({_gib(per_micro_batch)} each, "
                    f"as {twin.candidate.label()} keeps them for blocks "
                    f"{blocks.start}-{blocks.stop - 1}"
                    f"{' and the head' if s == layout.pp - 1 else ''}){state}"))
    return best


FLOORS = (fsdp2_state_across_micro_batches, activations_in_flight)


def memory_floor(c: Candidate, model: ModelParameters,
                 twins: Twins | None = None) -> MemoryFloor | None:
    """The largest floor the rules give `c` (None: no rule applies); `twins`: the unpipelined
    traces so far."""
    floors = [f for rule in FLOORS if (f := rule(c, model, twins)) is not None]
    return max(floors, key=lambda f: f.bytes, default=None)


def allocator_capacity(gpu) -> int:
    """The bytes analysis/gpu_memory.py's replay lets the caching allocator take from `gpu` (a
    devices.gpus.GPU): its memory as torch reports it, less the CUDA context
    (predict_cuda_memory)."""
    from ..devices.gpus import cuda_context_bytes

    return (gpu.reported_memory_bytes or gpu.memory_bytes) - cuda_context_bytes(gpu)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
