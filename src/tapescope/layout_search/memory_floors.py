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
  the FSDP2 state alive at that instant (the root group, the embeddings or the final norm and
  output layer, and the stage's last block gathered too), and (the instant recurring in step
  2) the stage's parameters and their optimizer state (AdamW's two states, made by step 1's
  step).
- `last_stage_loss`: the last stage in step 2 as its loss's backward makes the gradient of the
  logits (`_log_softmax_backward_data`): that micro-batch's fp32 gradient and output (N x V
  each), the logits every micro-batch in flight keeps in the stage's fwd_cache, their saved
  tensors (the log-probabilities at least), the parameters, the optimizer state, and FSDP2's
  root group (final norm, output layer) and last block gathered, and the unsharded gradients.
  From the model alone (the output layer's width, the tokens a sample, the TP plan), stronger
  with a twin.

Left out (not proven here, so not counted): the embedding's output and saved tensors, the
stage's received inputs, every temporary but the loss's (the optimizer's foreach outputs
among them), the gradients' and parameters' padding, the caching allocator's rounding and
fragmentation (a candidate whose live tensors fit may still run out). Not applied
to schedules with several stages a rank or split backwards (interleaved, looped, zero-bubble,
V); the FSDP2 part not to compiled candidates, float8 (its all-gather may run in float8) or a
stage that FSDP2 does not shard; the loss not to compiled or float8 candidates or a loss other
than pipeline_loss's default cross-entropy.

tests/test_memory_floors.py checks every floor against brute force: on every pipelined
candidate of a reduced space, each rank class's traced peak live bytes are at least the
floor, and the gate rules out only candidates whose trace runs out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

from .space import Candidate

__all__ = ["MemoryFloor", "ModelParameters", "Twins", "model_parameters", "memory_floor",
           "saved_block_bytes", "allocator_capacity", "FLOORS",
           "fsdp2_state_across_micro_batches", "activations_in_flight", "last_stage_loss"]


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
    # the last stage's own modules (after the block list: the final norm, the output layer):
    # their parameters' shapes, as `blocks` lists a block's
    last: tuple = ()
    # the last stage's loss (last_stage_loss): the output layer's width (its nn.Linear's
    # out_features: the vocabulary), whether the model's TP plan gathers it whole on every TP
    # rank, and the tokens a sample gives pipeline_loss's default cross-entropy (None: another
    # loss, or no output layer found)
    vocab: int | None = None
    vocab_gathered: bool = False
    tokens: int | None = None
    optimizer_states: int = 0   # tensors of a parameter's shape its optimizer keeps (Adam: 2)
    first: tuple = ()   # the first stage's own modules' (the embeddings') parameter shapes


def model_parameters(source) -> ModelParameters:
    """The ModelParameters of a search's `Source`, with the mixed-precision policy the search's
    candidates shard with (evaluate.candidate_options: FSDP2 gathers in the amp dtype, reduces
    in fp32)."""
    from ..capture.model import model_of, transformer_blocks
    from ..options import resolve_dtype

    workload, loss_fn = source.workload(1)
    model = model_of(workload.model)
    dtype = resolve_dtype(source.dtype)
    built = next((p.dtype for p in model.parameters()), torch.float32)
    mp = resolve_dtype(source.amp) if source.amp else None
    blocks = tuple(tuple(tuple(p.shape) for p in b.parameters() if p.requires_grad)
                   for b in transformer_blocks(model))
    first, last, vocab, gathered = _edge_stage_modules(model)
    target = workload.args[-1] if workload.args else None
    # pipeline_loss's default: cross-entropy against an integer target of batch 1 here
    tokens = prod(int(d) for d in target.shape) if loss_fn is None and target is not None and \
        isinstance(getattr(target, "dtype", None), torch.dtype) and \
        not target.dtype.is_floating_point and not target.dtype.is_complex else None
    return ModelParameters(blocks, dtype or built, mp, torch.float32 if mp is not None else None,
                           last, vocab, gathered, tokens,
                           _OPTIMIZER_STATES.get(str(source.optimizer).lower(), 0), first)


# TP plans (distributed/presets.py's TP_PLANS, by name) that gather the output layer's logits
# whole on every TP rank: `_llama_plan`'s "output" is ColwiseParallel(output_layouts=
# Replicate()), whose local output is all-gathered over the vocabulary (no loss_parallel).
# A plan not named here: each TP rank holds at least torch.chunk's smallest piece of it.
_GATHERED_VOCAB_PLANS = frozenset({"llama (torchtitan)"})

# tensors of each parameter's shape an optimizer's state keeps from its first step on (torch
# 2.14's optim/adam.py `_init_group`: exp_avg and exp_avg_sq, zeros_like(p); `step` is a CPU
# scalar unless capturable or fused, amsgrad off by default); SGD without momentum keeps none
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2}


def _edge_stage_modules(model) -> tuple:
    """(parameter shapes of the modules distributed/pipeline.py's split puts on the first stage
    alone, the same on the last stage, the output layer's width, whether the model's TP plan
    gathers it): the output layer is the last of the last stage's modules, when it is an
    nn.Linear (its out_features), else None."""
    from ..distributed.pipeline import edge_modules
    from ..distributed.presets import tp_plan_for
    from ..errors import TapescopeError

    try:
        _, first, last = edge_modules(model)
    except TapescopeError:
        return (), (), None, False

    def shapes_of(modules) -> tuple:
        seen, shapes = set(), []
        for m in modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    shapes.append(tuple(p.shape))
        return tuple(shapes)

    modules = [model.get_submodule(f) for f in last]
    vocab = modules[-1].out_features if modules and \
        isinstance(modules[-1], torch.nn.Linear) else None
    try:
        gathered = tp_plan_for(model)[0] in _GATHERED_VOCAB_PLANS
    except TapescopeError:
        gathered = False
    return shapes_of(model.get_submodule(f) for f in first), shapes_of(modules), vocab, gathered


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
    reduction; the unsharded parameters may be resharded after forward) and the shards, and
    at both the FSDP2 root group's (and after a forward the stage's last block's) gathered
    parameters and the last stage's root gradients once a backward has run (`_root_state`);
    and, since every such instant recurs in step 2 (analysis/gpu_memory.py replays it), the
    stage's parameters and the optimizer state step 1 made (`_resident`).

    Why the activations: the micro-batches in flight come from the schedule's own order
    (distributed/pipeline.py's `single_stage_kinds`: torch's GPipe and 1F1B
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
    from ..distributed.pipeline import single_stage_kinds, block_range
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
        root, block, root_grads = _root_state(c, model, s) if fsdp else (0, 0, 0)
        # every instant below recurs in step 2, beside the optimizer state of step 1's step
        # (last_stage_loss's `_resident`); the stage's parameters at least its shards
        params, state = _resident(c, model, s)
        shards = max(shards, params) + state
        forwards = backwards = 0
        for kind in single_stage_kinds(c.schedule, c.steps, layout.pp, s):
            # the root group and the stage's last block stay gathered from the first forward
            # on, the root's gradients from the first backward (_root_state; the last block
            # is among `unsharded` after a backward)
            if kind == "F":
                forwards += 1
                held = shards + root + block + ((grads + root_grads) if backwards else 0)
            else:
                backwards += 1
                held = shards + grads + unsharded + root + root_grads
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


def _least_shard(shape: tuple, tp: int, shard: int) -> int:
    """The fewest elements any rank holds of a parameter of `shape` under TP `tp` and FSDP2
    sharding over `shard` ranks: the TP-local piece (`_least_tp_chunk`'s choices), then FSDP2's
    split of its dim 0 as torch.chunk splits it (`FSDPParam`'s sharded parameter, unpadded:
    what zeros_like of it, an optimizer state, holds)."""
    if not shape:
        return 1 if shard == 1 else 0
    pieces = [shape]
    if tp > 1:
        pieces = [tuple(max(0, n - (tp - 1) * -(-n // tp)) if i == d else m
                        for i, m in enumerate(shape)) for d, n in enumerate(shape) if n]
        pieces.append(shape)
    least = None
    for piece in pieces:
        rows = piece[0]
        rows = max(0, rows - (shard - 1) * -(-rows // shard)) if shard > 1 else rows
        n = rows * prod(piece[1:])
        least = n if least is None else min(least, n)
    return least


def _resident(c: Candidate, model: ModelParameters, s: int) -> tuple:
    """(parameters, optimizer state) bytes stage s's every rank holds from the first
    optimizer step on: each parameter of its blocks (and, on the last stage, of its own
    modules, on the first its embeddings') at least `_least_shard` elements in the built
    dtype, and the optimizer's
    `optimizer_states` tensors of each, zeros_like the rank's parameter."""
    from ..distributed.pipeline import block_range

    layout = c.layout
    shapes = [shape for b in block_range(s, layout.pp, len(model.blocks))
              for shape in model.blocks[b]]
    if s == 0:
        shapes += list(model.first)
    if s == layout.pp - 1:
        shapes += list(model.last)
    local = sum(_least_shard(shape, layout.tp, layout.shard_degree) for shape in shapes)
    size = local * model.dtype.itemsize
    return size, size * model.optimizer_states


def last_stage_loss(c: Candidate, model: ModelParameters,
                    twins: Twins | None = None) -> MemoryFloor | None:
    """The last stage's rank, in the second (steady) step, as each backward action's loss
    backward runs `_log_softmax_backward_data` for its micro-batch (the instant its output is
    made), holds:
    - that micro-batch's gradient of the log-probabilities (nll_loss_backward's output) and the
      op's output: each N x V fp32 (N = micro-batch x tokens a sample / CP, V the logits'
      width on the rank);
    - every micro-batch in flight on the stage (this one included): its logits (N x V in the
      amp dtype, or the parameters') and its saved tensors, at least the log-probabilities
      (N x V fp32) or, with an unpipelined twin, what the twin's blocks of this stage and its
      head keep for the backward (as activations_in_flight reads them), the greater;
    - the stage's parameters and their optimizer state (`_resident`), and, with FSDP2
      (`_fsdp2_applies`) once a backward has run on the stage, its blocks' unsharded
      gradients (fsdp2_state_across_micro_batches).

    Why, in torch 2.14: pipeline_loss's default is `F.cross_entropy(logits.flatten(0, -2)
    .float(), target.flatten())`: log_softmax of the fp32 copy, then nll_loss. autograd's
    derivatives.yaml saves `_log_softmax`'s `result` (its backward is
    `_log_softmax_backward_data(grad, result, dim, self.scalar_type())`, an N x V output of the
    fp32 input's dtype) and nll_loss's backward makes its gradient whole (`grad_input` of
    self's shape, zeroed, then scattered), which the engine hands to LogSoftmaxBackward: all
    three are alive as it allocates. The last stage's forward output, the logits, stays in the
    stage's `fwd_cache` from `forward_one_chunk` to `backward_one_chunk`, which pops it into
    `stage_output` and keeps it through the backward (the schedule is stepped with
    return_outputs=False: no `output_chunks`). The logits' width: the output layer's
    out_features when the model's TP plan gathers it (`_GATHERED_VOCAB_PLANS`), else at least
    torch.chunk's smallest piece. In flight: the stage's own order (single_stage_kinds). The
    twin's saved bytes less the 4-byte fp32 scalar `total_weight` nll_loss saves, released with
    NllLossBackward's saved variables before LogSoftmaxBackward runs (the loss itself stays in
    the schedule's `_internal_losses`). The optimizer state exists from step 1's optimizer
    step, so through all of step 2, which analysis/gpu_memory.py replays (Options.steps 2).
    Only with pipeline_loss's default cross-entropy over an nn.Linear output layer, GPipe or
    1F1B, not compiled (inductor fuses the loss), no float8."""
    from ..distributed.pipeline import block_range, single_stage_kinds
    from .space import RECOMPUTE_ORDER

    layout = c.layout
    if layout.pp == 1 or c.schedule not in ("1f1b", "gpipe") or c.compile or \
            c.float8 is not None or model.vocab is None or model.tokens is None or \
            len(model.blocks) < layout.pp:
        return None
    s, n = layout.pp - 1, len(model.blocks)
    width = model.vocab if model.vocab_gathered else _least_tp_chunk((model.vocab,), layout.tp)
    tokens = c.micro_batch * _least_tp_chunk((model.tokens,), layout.cp)
    fp32 = tokens * width * 4
    logits = tokens * width * (model.param_dtype or model.dtype).itemsize
    saved, twin = fp32, None
    if twins is not None:
        heavier = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(c.checkpointing):]
        held = [*block_range(s, layout.pp, n), n]
        usable = [x for x in twins.for_candidate(c) if x.candidate.micro_batch <= c.micro_batch
                  and x.candidate.checkpointing in heavier
                  and all(len(r) == n + 1 for r in x.saved_bytes)]
        if usable:
            twin = max(usable, key=lambda x: min(sum(r[b] for b in held)
                                                 for r in x.saved_bytes))
            saved = max(saved, min(sum(r[b] for b in held) for r in twin.saved_bytes) - 4)
    params, state = _resident(c, model, s)
    fsdp = _fsdp2_applies(c, model)
    grads = _stage_state(c, model, s)[1] if fsdp else 0
    root, block, root_grads = _root_state(c, model, s) if fsdp else (0, 0, 0)
    gathered = root + block
    best = None
    forwards = backwards = 0
    for kind in single_stage_kinds(c.schedule, c.steps, layout.pp, s):
        if kind == "F":
            forwards += 1
            continue
        live = forwards - backwards
        total = params + state + gathered + ((grads + root_grads) if backwards else 0) + \
            live * (saved + logits) + 2 * fp32
        backwards += 1
        if best is None or total > best.bytes:
            best = MemoryFloor(total, s, (
                f"in step 2, as backward {backwards} of the last stage runs the loss's "
                f"_log_softmax_backward_data on {tokens:,} x {width:,} logits, it holds its "
                f"fp32 gradient and output ({_gib(2 * fp32)}), {live} micro-batches' logits "
                f"({_gib(logits)} each) and saved tensors ({_gib(saved)} each"
                f"{', as ' + twin.candidate.label() + ' keeps them' if twin else ''}), the "
                f"stage's parameters ({_gib(params)}) and optimizer state ({_gib(state)})"
                f"{f', FSDP2-unsharded ({_gib(gathered)})' if gathered else ''}"
                f"{f', unsharded gradients ({_gib(grads + root_grads)})' if fsdp and backwards > 1 else ''}"))
    return best


def _root_state(c: Candidate, model: ModelParameters, s: int) -> tuple:
    """(the root group's unsharded parameters, the stage's last block's, the root's unsharded
    gradients) bytes of stage s that FSDP2 keeps gathered through step 2 from its first
    forward on (the gradients from the first backward): distributed/presets.py's FSDP preset
    shards each block and then the stage's module, the root (its own parameters: on the
    first stage the embeddings, `model.first`; on the last the final norm and the output
    layer, `model.last`). The root's group is not resharded after forward (torch 2.14's
    FSDPState._lazy_init sets the root's `post_forward_mesh_info` None when its
    reshard_after_forward is left automatic, as the preset leaves it), nor is the stage's last
    block's (the preset's reshard_after_forward=False for it), and pipelining's backwards do
    not reshard (fsdp2_state_across_micro_batches): from the step's first forward on, both are
    gathered, in the param dtype. The root's gradients, like the blocks', stay unsharded in
    the reduce dtype from its first backward of the step to the reduction (the last stage's
    root's input, the received activations, carries its post-backward hook; the first
    stage's root takes token ids, so `_root_post_backward_final_callback` runs its
    post_backward at the end of each backward; counted there at the smaller of the param and
    reduce dtypes, what it is before `to_accumulated_grad_if_needed` and after). TP-local
    elements: `_least_tp_chunk`."""
    from ..distributed.pipeline import block_range

    layout = c.layout
    last_block = model.blocks[block_range(s, layout.pp, len(model.blocks))[-1]]
    shapes = [*(model.first if s == 0 else ()), *(model.last if s == layout.pp - 1 else ())]
    root = sum(_least_tp_chunk(shape, layout.tp) for shape in shapes)
    block = sum(_least_tp_chunk(shape, layout.tp) for shape in last_block)
    gathered = (model.param_dtype or model.dtype).itemsize
    reduced = (model.reduce_dtype or model.param_dtype or model.dtype).itemsize
    grads = root * (reduced if s == layout.pp - 1 else min(gathered, reduced))
    return root * gathered, block * gathered, grads


FLOORS = (fsdp2_state_across_micro_batches, activations_in_flight, last_stage_loss)


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
