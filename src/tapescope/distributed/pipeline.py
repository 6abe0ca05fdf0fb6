"""Pipeline parallelism on a simulated rank: torch.distributed.pipelining's own stages and schedules,
run on fake tensors.

A pipelined rank's step is what torchtitan's training loop runs on it: the model split into
stages, this rank's stages wrapped in `PipelineStage`s, a schedule (`Schedule1F1B`, ...) over
`microbatches` micro-batches, `schedule.step(...)`, then `optimizer.step()` and `zero_grad()`.
tapescope runs exactly that (`PipelineStep`, a StepProgram) on the rank's fake copy of the model,
under the fake process group: the schedule's sends and receives are recorded as collectives with
their buffers, the stage keeps each in-flight micro-batch's activations until its backward as a
real rank does, and the backward (`stage_backward` calls torch.autograd.backward) runs on
tapescope's engine. So a stage's peak is the schedule's own: 1F1B holds pp - rank micro-batches,
GPipe all of them.

What tapescope supplies and why:
- The split. `split(model, stage, num_stages)` makes a stage's module; the default keeps the
  stage's share of the model's repeated blocks, the modules before the blocks on the first stage
  and those after on the last, and sets the rest to None, as torchtitan's
  `pipeline_module_split` does (the model's forward must skip None modules, as torchtitan's and
  tapescope's zoo models do).
- The stages' static metadata. PipelineStage infers shapes by sending them between ranks
  (`send_object_list`), which the fake group cannot carry, so tapescope gives each stage its
  `input_args`/`output_args` (and the gradients' `input_grads`/`output_grads`), found by running
  the stages one after another on a meta copy of the model with one micro-batch (with a
  parallelize, on fake tensors inside the rank's capture: `PipelinePlan.measure_parallelised`).
  Activations between stages are marked requires_grad, as dynamic inference would find them.
- The loss: the last stage calls `loss_fn(output, target)`, the target being the last input.
- The step's time (`schedule_time`): an event simulation of the schedule's order over each
  rank's traced forward and backward segments.
(distributed/fidelity.py makes point-to-point Works hold their tensors as real backends do.)

The zero-bubble schedules (interleaved zero bubble, ZBV, DualPipeV) split each backward into an
input backward and a weight backward: `stage_backward_input` files pre-hooks on autograd's C++
nodes to capture the gradients the weight backward starts from, and `stage_backward_weight`
runs `torch.autograd.grad` from GradientEdges. tapescope's engine reads C++ nodes' hooks back
(capture/hooks.py) and takes GradientEdges; each backward action is marked as one phase
(`_backward_actions_as_phases`) so that the step-time simulation times each action.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..capture.program import StepProgram, phase_marks
from ..capture.records import ZERO_GRAD
from ..errors import TapescopeError, from_trace_failure, passes_user_calls
from ..values.pipeline import SCHEDULES, PipelineSpec

__all__ = ["split_blocks", "stage_boundaries", "PipelineStep", "pipeline_loss", "StageShapes",
           "single_stage_kinds"]


# ---- the split -----------------------------------------------------------------------------------

def _path_to_blocks(model: nn.Module) -> tuple[list, nn.ModuleList]:
    """[(parent, child name)] from the root down to the model's block list, and the list: the
    longest nn.ModuleList whose members share a class (Llama's `layers`, GPT-2's `h`)."""
    best, best_path = None, None

    def walk(module, path):
        nonlocal best, best_path
        for name, child in module._modules.items():
            if child is None:
                continue
            here = path + [(module, name)]
            if isinstance(child, nn.ModuleList):
                kinds = {type(b) for b in child if b is not None}
                if len(kinds) == 1 and (best is None or len(child) > len(best)):
                    best, best_path = child, here
            walk(child, here)

    walk(model, [])
    if best is None:
        raise TapescopeError(
            f"{type(model).__name__} has no list of repeated blocks (an nn.ModuleList of one "
            "class) for the default pipeline split; pass your own: pipeline={'split': fn} "
            "(CLI --pp-split file.py:fn), fn(model, stage, num_stages) -> the stage's module")
    return best_path, best


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of the module object whose containers (submodules, parameters, buffers, hooks)
    are copies: the same members, its own dicts and sets."""
    out = copy.copy(module)
    out.__dict__ = {k: (type(v)(v) if isinstance(v, (dict, set)) else v)
                    for k, v in module.__dict__.items()}
    return out


def block_range(stage: int, num_stages: int, n_blocks: int) -> range:
    """The blocks stage `stage` holds: an even share, the earlier stages one fewer when they do
    not divide (the first stage also holds the embedding, the last the output)."""
    return range(stage * n_blocks // num_stages, (stage + 1) * n_blocks // num_stages)


def edge_modules(model: nn.Module) -> tuple[list, list, list]:
    """(blocks, first, last): the fqns of the model's repeated blocks, in order, and of the
    modules `split_blocks` puts on the first stage alone (registered before the block list on
    the path to it: the embeddings) and on the last alone (after it: the final norm, the output
    layer). layout_search/bounds.py puts an unpipelined trace's kernels on stages by them."""
    path, blocks = _path_to_blocks(model)
    first, last, prefix = [], [], ""
    for parent, name in path:
        names = [n for n, m in parent._modules.items() if m is not None]
        at = names.index(name)
        first += [prefix + n for n in names[:at]]
        last += [prefix + n for n in names[at + 1:]]
        prefix += name + "."
    return [prefix + n for n, b in blocks._modules.items() if b is not None], first, last


def split_blocks(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Stage `stage`'s module: a copy of the model's structure (modules shared, not copied) that
    holds its blocks, the modules registered before the block list on the path to it (embeddings)
    on the first stage and those after (norm, output) on the last; the rest are None."""
    path, blocks = _path_to_blocks(model)
    n = len(blocks)
    if n < num_stages:
        raise TapescopeError(f"the model has {n} blocks, too few for {num_stages} pipeline "
                             f"stages (each needs one); use fewer stages")
    # shallow copies of the modules on the path: the stage's structure is its own (its own
    # submodule, parameter and hook containers: FSDP2 wrapping one stage's root must not hook
    # another's), its leaves (the blocks, the embedding) are the model's
    root = _shallow(model)
    parent = root
    for _, name in path:
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    stage_blocks = parent
    keep = block_range(stage, num_stages, n)
    for i, key in enumerate(list(stage_blocks._modules)):
        if i not in keep:
            stage_blocks._modules[key] = None
    first, last = stage == 0, stage == num_stages - 1
    parent = root
    for _, name in path:
        names = list(parent._modules)
        at = names.index(name)
        for sibling in names[:at]:
            if not first:
                parent._modules[sibling] = None
        for sibling in names[at + 1:]:
            if not last:
                parent._modules[sibling] = None
        parent = parent._modules[name]
    return root


# ---- the stages' static metadata -----------------------------------------------------------------

@dataclass(frozen=True)
class StageShapes:
    """A stage's inputs and outputs for one micro-batch: ((shape, dtype, requires_grad), ...)."""

    inputs: tuple
    outputs: tuple


def _tensors(x) -> tuple:
    from ..torch_compat import tree_leaves

    return tuple(t for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def microbatch(args: tuple, microbatches: int) -> tuple:
    """The first micro-batch of each input: torch.tensor_split along dim 0, as the schedule's
    default TensorChunkSpec(0) splits."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dim() == 0 or a.shape[0] < microbatches:
                raise TapescopeError(
                    f"an input of shape {tuple(a.shape)} cannot be split into {microbatches} "
                    f"micro-batches along its first dimension; use a batch of at least "
                    f"{microbatches} or fewer micro-batches")
            out.append(torch.tensor_split(a, microbatches)[0])
        else:
            out.append(a)
    return tuple(out)


def stage_boundaries(model, stage_inputs: tuple, spec: PipelineSpec, pp: int,
                     microbatches: int, split, parallelize=None) -> list[StageShapes]:
    """Each stage's StageShapes, by running the stages in order on meta tensors (one micro-batch);
    `model` and the inputs are on the meta device. parallelize(stage module): the parallelisation
    of the other mesh dimensions, in a (fake) world: tensor parallelism's sequence-parallel
    blocks pass each rank its share of the sequence between stages."""
    from torch.distributed.tensor import DTensor

    num_stages = spec.num_stages(pp)
    x = microbatch(stage_inputs, microbatches)
    out: list = []
    # with autograd on (on meta / fake tensors it costs nothing): whether an output requires
    # grad is part of what a stage sends. A received activation that does not require grad
    # gets no gradient, and the zero-bubble schedules then find no weight to differentiate
    # (stage_backward_input's param groups start from the inputs' gradient functions)
    make = model if callable(model) and not isinstance(model, nn.Module) else \
        (lambda: copy.deepcopy(model))
    # each stage from its own copy: a user's split may change the model it is given. The
    # default split changes nothing and gives the stages disjoint modules, so one copy serves
    # them all, every stage split before any is parallelised (a parallelisation changes the
    # blocks' classes, and the split finds the block list by its one class), as stage_modules
    # does: at 70B, 3 whole-model fake copies fewer per pipelined candidate
    with torch.enable_grad():
        stages = None
        if split is split_blocks:
            shared = make()
            stages = [_split(split, shared, s, num_stages) for s in range(num_stages)]
        for s in range(num_stages):
            module = stages[s] if stages is not None else _split(split, make(), s, num_stages)
            if parallelize is not None:
                module = parallelize(module)
            y = _run_stage(module, x, s)
            ys = tuple(t.to_local() if isinstance(t, DTensor) else t for t in _tensors(y))
            out.append(StageShapes(tuple(_meta_of(t) for t in _tensors(x)),
                                   tuple(_meta_of(t) for t in ys)))
            x = tuple(t.detach().requires_grad_(t.requires_grad) for t in ys)
    return out


def _meta_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point()


@passes_user_calls
def _split(split, model, stage, num_stages):
    try:
        module = split(model, stage, num_stages)
    except TapescopeError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's split: a message at its line
        raise _user_failure(e, f"the pipeline split, making stage {stage} of {num_stages},")
    if not isinstance(module, nn.Module):
        raise TapescopeError(f"the pipeline split returned {type(module).__name__} for stage "
                             f"{stage}; it must return the stage's nn.Module")
    return module


def _run_stage(module, x, stage):
    try:
        return module(*x)
    except TapescopeError:
        raise
    except TypeError as e:
        if "'NoneType' object is not callable" in str(e):
            raise TapescopeError(
                f"stage {stage}'s forward calls a module the split set to None: "
                f"{type(module).__name__}.forward must skip the modules a stage does not hold "
                "(as torchtitan's models do), or pass your own split (pipeline={'split': fn}, "
                "CLI --pp-split file.py:fn)") from e
        raise _user_failure(e, f"stage {stage}'s forward")
    except Exception as e:  # noqa: BLE001 - the model's own code: a message at its line
        raise _user_failure(e, f"stage {stage}'s forward")


def _user_failure(e: BaseException, who: str) -> TapescopeError:
    """An exception of the user's code (a split, a stage's forward) as one line: where, and all
    of its message."""
    from ..errors import ModelError, raised_by_tapescope, user_frame_of

    if raised_by_tapescope(e):
        return e  # our bug: keep its traceback
    line = user_frame_of(e)
    text = " ".join(x.strip() for x in str(e).splitlines() if x.strip()) or type(e).__name__
    return ModelError(f"{who} raised {type(e).__name__}" + (f" at {line}" if line else "")
                      + f": {text}")


# ---- the loss ------------------------------------------------------------------------------------

def pipeline_loss(loss_fn):
    """The last stage's loss, `loss(output, target)`: the user's, else cross-entropy against an
    integer target (a language model's next tokens), mean squared error against a target of the
    output's shape, else the mean of the output."""
    if loss_fn is not None:
        return loss_fn

    def default(output, target=None):
        from ..losses import logits_of

        import torch.nn.functional as F

        logits = logits_of(output)
        if target is not None and not target.is_floating_point():
            return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())
        if target is not None and target.shape == logits.shape:
            return F.mse_loss(logits, target)
        return logits.float().mean()

    return default


# ---- the step ------------------------------------------------------------------------------------

@dataclass
class PipelineStep(StepProgram):
    """One pipelined step on one rank: `schedule.step` over its stages, optimizer.step(),
    zero_grad(). `model` is the rank's stage module, or an nn.ModuleList of them (several stages
    per rank), in the order of `stages`."""

    spec: PipelineSpec
    stages: tuple                    # this rank's stage indices
    num_stages: int
    microbatches: int
    shapes: list                     # StageShapes of every stage
    group: Any                       # the pipeline dimension's ProcessGroup
    loss_fn: Any = None
    optimizer: Any = "adamw"
    records_setup: bool = True       # the stages and schedule are made in step 0 (setup)
    order: dict | None = None        # the schedule's compute actions by pipeline rank (setup)
    # micro-batches the schedule runs while traced (None: all); the rest are the repeats of its
    # steady state, proven and added by `extend` (capture/repeats.py)
    traced_microbatches: int | None = None
    traced_order: dict | None = None  # `order` of the traced schedule
    stage_objects: list | None = None  # the PipelineStages setup made (their receive buffers)

    @property
    def traced(self) -> int:
        return self.traced_microbatches or self.microbatches

    def describe(self) -> dict:
        return {"pipeline": self.spec.to_dict(), "stages": list(self.stages)}

    def setup(self, model, params, device):
        from torch.distributed.pipelining import PipelineStage, schedules

        from ..capture.optimizers import make_optimizer

        modules = list(model) if len(self.stages) > 1 else [model]

        def like(metas):
            return tuple(torch.empty(shape, dtype=dtype, device=device).requires_grad_(grad)
                         for shape, dtype, grad in metas)

        stages = []
        for index, module in zip(self.stages, modules):
            shapes = self.shapes[index]
            stages.append(PipelineStage(
                module, index, self.num_stages, device, group=self.group,
                input_args=like(shapes.inputs), output_args=like(shapes.outputs),
                input_grads=like(shapes.inputs) if index > 0 else None,
                output_grads=like(shapes.outputs) if index < self.num_stages - 1 else None))
        cls = getattr(schedules, self.spec.kind.torch_class)

        def schedule_of(microbatches):
            return cls(stages if self.spec.kind.multi else stages[0], microbatches,
                       loss_fn=pipeline_loss(self.loss_fn), scale_grads=True)

        schedule = schedule_of(self.traced)
        self.stage_objects = stages
        self.traced_order = compute_order(schedule)
        # the order of the step being profiled: the traced schedule's, or (fewer traced) that
        # of a schedule over all the micro-batches, made only to read it
        self.order = self.traced_order if self.traced == self.microbatches else \
            compute_order(schedule_of(self.microbatches))
        return schedule, make_optimizer(self.optimizer, params, device), stages

    step2_from_step1 = True  # step 2: step 1 less the stages' initialisation (first_step.py)

    def run(self, model, args, kwargs, state, step, runtime, end: bool = True):
        schedule, optimizer, stages = state
        if kwargs:
            raise TapescopeError("a pipelined step takes positional inputs (the first stage's "
                                 "inputs, then the target); give them positionally")
        inputs, target = tuple(args[:-1]), args[-1] if args else None
        if self.traced < self.microbatches:
            inputs, target = _first_microbatches((inputs, target), self.traced, self.microbatches)
        first, last = 0 in self.stages, self.num_stages - 1 in self.stages
        with phase_marks(model, step, runtime) as backward_phase, \
                _backward_actions_as_phases(stages, backward_phase, self.spec.schedule), \
                _schedule_failure_unlogged(), \
                _initialisation_marked(schedule, runtime.first_step_only, step):
            # torchtitan's call: the last stage keeps the losses, not the merged outputs
            losses: list | None = [] if last else None
            if last:
                schedule.step(*(inputs if first else ()), target=target, losses=losses,
                              return_outputs=False)
            else:
                schedule.step(*(inputs if first else ()), return_outputs=False)
            del losses
            if optimizer is not None:
                optimizer.step()
        if end:
            self.end_step(state, step, runtime)

    def optimizer_step(self, model, state, step, runtime):
        optimizer = state[1]
        with phase_marks(model, step, runtime):
            if optimizer is not None:
                optimizer.step()

    def end_step(self, state, step, runtime):
        optimizer = state[1]
        with runtime.phase(step, ZERO_GRAD):
            if optimizer is not None:
                optimizer.zero_grad()

    def first_step_done(self, state) -> bool:
        return _stages_initialised(state[0])


# torch's schedules initialise their stages in the first `step` (receive buffers, metadata) by
# one method: PipelineScheduleSingle's and PipelineScheduleMulti's (schedules.py)
_INITIALISERS = ("_initialize_stage", "_initialize_stages")


@contextmanager
def _initialisation_marked(schedule, first_step_only, step: int):
    """The schedule's initialisation of its stages runs inside `first_step_only(step)`: what a
    step 2 built from step 1 leaves out (capture/first_step.py). Set on the schedule (tapescope's
    own, made in setup) for the block, removed after."""
    name = next((n for n in _INITIALISERS if hasattr(schedule, n)), None)
    if name is None:
        yield
        return
    method = getattr(schedule, name)

    def marked(*args, **kwargs):
        with first_step_only(step):
            return method(*args, **kwargs)

    setattr(schedule, name, marked)
    try:
        yield
    finally:
        delattr(schedule, name)


def _stages_initialised(schedule) -> bool:
    """Whether the schedule's next `step` skips its stages' initialisation: torch's
    `_initialize_pp_stages` (schedules.py) returns at once when the forward is initialised and
    the backward is exactly when the schedule has one (a change of mode initialises again).
    The flags as torch 2.14 names them; not found: False (step 2 is then traced)."""
    for prefix in ("_stage_", "_stages_"):
        forward = getattr(schedule, prefix + "forward_initialized", None)
        if forward is not None:
            backward = getattr(schedule, prefix + "backward_initialized", None)
            return forward is True and backward == getattr(schedule, "_has_backward", None)
    return False


def _first_microbatches(args, traced: int, microbatches: int):
    """The first `traced` of `microbatches` micro-batches of each input, as one view (dim 0),
    made unrecorded: the schedule splits it into micro-batches of the full batch's size, and
    the whole input stays alive as it does in the step."""
    from ..torch_compat import active_fake_mode, tree_map

    tape = active_fake_mode()

    def first(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        return t.narrow(0, 0, t.shape[0] // microbatches * traced)

    with tape.unrecorded():
        return tree_map(first, args)


@contextmanager
def _backward_actions_as_phases(stages: list, backward_phase, schedule: str):
    """Each backward action of the schedule - a full backward, an input backward, a zero-bubble
    schedule's weight backward (one autograd.grad per parameter group, then the gradients'
    accumulation) - is one backward phase of the trace, even one that runs no autograd (the
    first stage's input backward: its inputs need no gradient), so that each action is one
    phase segment (`action_seconds` times the actions by them). The stages are tapescope's own
    (made in setup); the methods are set on each for the block and removed after. A backward
    that PyTorch refuses for the schedule is told as such (`_split_backward_refusal`)."""

    def as_one_phase(method):
        def run(*args, **kwargs):
            with backward_phase():
                try:
                    return method(*args, **kwargs)
                except RuntimeError as e:
                    refusal = _split_backward_refusal(e, schedule)
                    if refusal is None:
                        raise
                    raise refusal from e
        return run

    names = ("backward_one_chunk", "backward_weight_one_chunk")
    for stage in stages:
        for name in names:
            setattr(stage, name, as_one_phase(getattr(stage, name)))
    try:
        yield
    finally:
        for stage in stages:
            for name in names:
                delattr(stage, name)


@contextmanager
def _schedule_failure_unlogged():
    """Without the log torch's multi-stage schedules write when an action raises (the whole
    schedule as a table, at ERROR, ~15 lines a failed step): the exception goes on, and the
    trace turns it into its own one-line error; a search would print the table once per failed
    candidate. A filter on torch's logger for the block, removed after."""
    import logging

    log = logging.getLogger("torch.distributed.pipelining.schedules")

    def keep(record) -> bool:
        return record.levelno < logging.ERROR

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


# What torch.utils.checkpoint's selective checkpointing raises when a second backward unpacks a
# region it recomputed for the first (_CachedTorchDispatchMode, torch/utils/checkpoint.py)
_SELECTIVE_SECOND_BACKWARD = ("only allowed to backward once on any region computed under "
                              "selective activation checkpoint")


def _split_backward_refusal(e: BaseException, schedule: str) -> TapescopeError | None:
    """A zero-bubble schedule's refusal of selective activation checkpointing, as one line: its
    input backward and its weight backward are two backwards through every checkpointed region
    of the stage, and selective checkpointing recomputes a region for one backward only, so
    PyTorch raises in the weight backward (a real gloo run of the same stages raises the same).
    None for any other failure, or a schedule whose backward is one."""
    if not SCHEDULES[schedule].zero_bubble:
        return None
    cause = e
    while cause is not None and _SELECTIVE_SECOND_BACKWARD not in str(cause):
        cause = cause.__cause__
    if cause is None:
        return None
    whole = ", ".join(n for n, k in SCHEDULES.items() if not k.zero_bubble)
    return TapescopeError(
        f"pipeline schedule {schedule} with selective activation checkpointing: PyTorch refuses "
        f"it ({from_trace_failure(cause)}) - the schedule splits each micro-batch's backward "
        "into an input backward and a weight backward, two backwards through every checkpointed "
        "region, and selective checkpointing recomputes a region for one backward only. Fix: "
        f"full activation checkpointing, or a schedule with one backward ({whole})")


# ---- micro-batches traced until the schedule repeats ---------------------------------------------

def traced_microbatches(microbatches: int, num_stages: int, multi: bool = False) -> int:
    """How many of a step's micro-batches to trace: enough for the steady state to repeat more
    often than a stage keeps micro-batches in flight (at most its warm-up, which grows with the
    stages: 1F1B's first stage holds `num_stages`), so that what a block frees within the
    steady state is told apart from what it keeps to the step's end; as many as the step modulo
    the stages, so that the traced and the full schedules begin their rounds alike. A schedule
    of several stages a rank (`multi`) repeats a longer block: twice as many (interleaved 1F1B
    on 2 ranks, 32 micro-batches: over 12 its steady state repeats 4 times with 5 in flight,
    over 20 it is proven)."""
    least = (4 if multi else 2) * num_stages + 3
    if microbatches <= least + num_stages:
        return microbatches
    return microbatches - (microbatches - least) // num_stages * num_stages


def single_stage_kinds(schedule: str, n: int, num_stages: int, stage: int) -> list:
    """The compute actions a single-stage schedule runs over n micro-batches, in order, as its
    `_step_microbatches` is written (torch's `pipeline_order` of these is for display and
    differs): GPipe all forwards then all backwards; 1F1B a warm-up of num_stages - stage
    forwards, then a backward and a forward in turn, then the backwards left."""
    if schedule == "gpipe":
        return ["F"] * n + ["B"] * n
    warmup = min(n, num_stages - stage)
    kinds, forwards, backwards = ["F"] * warmup, warmup, 0
    while True:
        kinds.append("B")
        backwards += 1
        if forwards == n:
            break
        kinds.append("F")
        forwards += 1
    return kinds + ["B"] * (n - backwards)


def _kinds(order: list) -> list:
    return ["F" if k == "F" else "B" for _, k, _ in order]


def extend_traced_steps(program: "PipelineStep", trace, pp_rank: int) -> str | None:
    """Stand each traced step's repeating steady state for the micro-batches not traced
    (capture/repeats.py), once the full schedule's compute actions are shown to be the traced
    ones with the repeated blocks' actions inserted. None when done; else why it cannot be
    proven (the caller then traces every micro-batch)."""
    from ..capture.repeats import (ACTIONS, Births, extend_regions, prove_region,
                                   repeating_regions)

    n, m = program.microbatches, program.traced
    if program.order is not None:
        expected, traced = _kinds(program.order[pp_rank]), _kinds(program.traced_order[pp_rank])
        in_flight = max_in_flight(program.traced_order[pp_rank])
    else:
        stage, kind = program.stages[0], program.spec.schedule
        expected = single_stage_kinds(kind, n, program.num_stages, stage)
        traced = single_stage_kinds(kind, m, program.num_stages, stage)
        in_flight = max_in_flight(traced_order(stage, traced))
    extensions = []
    for step in sorted({seg.step for seg in trace.segments if seg.step > 0}):
        if step == 2 and trace.step2 == "reused":
            continue  # step 1's records, extended with them (analysis/steps.py)
        segments = [i for i, seg in enumerate(trace.segments) if seg.step == step]
        kinds = ["F" if trace.segments[i].phase == "forward" else "B" for i in segments
                 if trace.segments[i].phase in ACTIONS]
        if kinds != traced:
            return (f"step {step} ran {len(kinds)} compute actions where the schedule over {m} "
                    f"micro-batches has {len(traced)}")
        regions = repeating_regions(trace, segments)
        # each region's last block repeated as often as the full schedule's actions continue it
        action_segments = [i for i in segments if trace.segments[i].phase in ACTIONS]
        cuts = []   # (actions before the region's last block ends, that block's actions)
        for region in regions:
            last = region.block(region.count - 1)
            cuts.append((sum(1 for i in action_segments if i < last.stop),
                         [k for k, i in zip(kinds, action_segments) if i in last]))
        extra_of = _repeats_matching(kinds, expected, cuts)
        if extra_of is None:
            return (f"the schedule over {n} micro-batches is not the traced one over {m} with its "
                    f"steady state repeated")
        births = Births(trace, regions)
        for index, (region, extra) in enumerate(zip(regions, extra_of)):
            if not extra:
                continue
            # a block with forwards and backwards frees the activations of forwards up to
            # `in_flight` blocks before: only a region longer than that tells them apart from
            # what each block keeps to the step's end (a forward-only region keeps them all)
            if {"F", "B"} <= set(cuts[index][1]) and region.count <= in_flight + 1:
                return (f"its steady state repeats {region.count} times, not more than the "
                        f"{in_flight} micro-batches a stage keeps in flight")
            proof = prove_region(trace, regions, index, births)
            if isinstance(proof, str):
                proof = prove_region(trace, regions, index, births, back=2)
            if isinstance(proof, str):
                return f"step {step}: {proof}"
            extensions.append((proof, extra))
        setup = _per_microbatch_setup(trace, segments, m, n)
        # what the stages made per micro-batch before the first action: their receive buffers
        # (torch's stages keep them by micro-batch), only in the step that made the stages
        made = sum(trace.storages[sid].nbytes for p in setup for sid in p.persistent)
        buffers = _receive_buffer_bytes(program.stage_objects or [], m) if step == 1 else 0
        if made != buffers:
            return (f"step {step}: the stages made {buffers} bytes of receive buffers per "
                    f"micro-batch, the setup runs of {m} alike ops {made}")
        extensions += [(p, n - m) for p in setup]
    extend_regions(trace, extensions)
    return None


def _repeats_matching(kinds: list, expected: list, cuts: list) -> list | None:
    """How often to repeat each cut's block (inserted after `kinds[:at]`) so that `kinds` becomes
    `expected`; None if no counts do. Tried from the most repeats down, region by region."""
    def search(c: int, done: int, pos: int) -> list | None:
        # kinds[:done] matched expected[:pos]
        if c == len(cuts):
            return [] if kinds[done:] == expected[pos:] else None
        at, block = cuts[c]
        if kinds[done:at] != expected[pos:pos + at - done]:
            return None
        pos += at - done
        most = 0
        while block and expected[pos + most * len(block):pos + (most + 1) * len(block)] == block:
            most += 1
        for extra in range(most, -1, -1):
            rest = search(c + 1, at, pos + extra * len(block))
            if rest is not None:
                return [extra] + rest
        return None

    return search(0, 0, 0)


def _receive_buffer_bytes(stages: list, m: int) -> int:
    """Bytes of one micro-batch's receive buffers over the rank's stages (activations from the
    stage before, gradients from the stage after), each kept by micro-batch; -1 where a stage
    does not keep m of them."""
    total = 0
    for stage in stages:
        for infos in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            if not infos:
                continue
            if len(infos) != m:
                return -1
            # (each a _RecvInfo holding its `buffer`, or a root stage's input placeholder)
            buffers = [getattr(i, "buffer", None) for i in infos[0]]
            total += sum(b.numel() * b.element_size() for b in buffers
                         if isinstance(b, torch.Tensor))
    return total


def _per_microbatch_setup(trace, segments: list, m: int, n: int) -> list:
    """Before its first action the schedule does some things once per micro-batch: it splits
    each input (torch.tensor_split: a slice per micro-batch) and, on the first step, a stage
    makes a receive buffer per micro-batch (`_prepare_forward_infra` / `_prepare_backward_infra`
    loop over the micro-batches). Each run of k x m consecutive ops alike there (the same op,
    output shapes and first input's storage: k per micro-batch) stands for k x n: its last op
    runs k x (n - m) more times, and what it allocates gets k x (n - m) stand-ins. [Proof]."""
    from ..capture.repeats import ACTIONS, Proof

    ops, events = trace.ops, trace.events
    made_by: dict = {}
    out = []

    def like(a, b):
        return a.func is b.func and \
            [t.shape for t in a.tensor_outputs()] == [t.shape for t in b.tensor_outputs()] and \
            (a.inputs[0].storage if a.inputs else None) == (b.inputs[0].storage if b.inputs else None)

    def close(run):
        # k x m alike: k per micro-batch (two stages of a rank make their buffers in one run)
        if not run or len(run) % m:
            return
        last = run[-1]
        # what it leaves alive (a buffer); what it frees again is its own, once per run
        made = [e for e in made_by.get(last, []) if events[e][1] not in freed]
        # the stand-ins go in just before its last allocation, in its segment: a first step's
        # receive buffers and theirs are left out of a step 2 built from step 1 together
        at = made[-1] if made else 0
        for _ in range(len(run) // m):
            out.append(Proof(None, range(last, last + 1), range(at, at),
                             tuple(events[e][1] for e in made)))

    prefix = []
    for i in segments:
        if trace.segments[i].phase in ACTIONS:
            break
        prefix.append(trace.segments[i])
    freed = {events[e][1] for seg in prefix for e in seg.events if events[e][2] < 0}
    for seg in prefix:
        for e in seg.events:
            if events[e][2] > 0:
                made_by.setdefault(trace.storages[events[e][1]].created_by, []).append(e)
        run: list = []
        for k in seg.ops:
            if run and like(ops[k], ops[run[-1]]):
                run.append(k)
                continue
            close(run)
            run = [k]
        close(run)
    return out


# ---- the schedule's time ---------------------------------------------------------------------------

COMPUTE = ("F", "B", "I", "W")   # forward, full backward, input backward, weight backward


def compute_order(schedule) -> dict | None:
    """pipeline rank -> its compute actions in order, (stage, kind, micro-batch), for a schedule
    whose runtime executes its `pipeline_order` (the multi-stage ones); None for the single-stage
    ones (GPipe, 1F1B), whose `_step_microbatches` is written out by hand - their
    `pipeline_order` is for display and differs from what runs (torch 2.14's Schedule1F1B lists
    micro-batches 1-4 on the last of 2 ranks) - so their order is read from the trace."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(schedule, PipelineScheduleMulti) or not order:
        return None
    def compute(actions):
        for a in actions:
            if a is None:
                continue
            # DualPipeV's overlapped forward + backward: torch's runtime performs its
            # sub-actions one after the other (_PipelineScheduleRuntime._step_microbatches)
            for sub in getattr(a, "sub_actions", None) or (a,):
                if sub.computation_type.value in COMPUTE:
                    yield sub.stage_index, sub.computation_type.value, sub.microbatch_index

    return {rank: list(compute(actions)) for rank, actions in order.items()}


def traced_order(stage: int, kinds: list) -> list:
    """A single-stage schedule's actions from the phases its rank ran: the i-th forward is
    micro-batch i, and so is the i-th backward (GPipe and 1F1B keep micro-batch order)."""
    count = {"F": 0, "B": 0}
    out = []
    for k in kinds:
        out.append((stage, k, count[k]))
        count[k] += 1
    return out


@dataclass(frozen=True)
class PipelineTime:
    """The step's time when the ranks run the schedule together: each rank's compute actions
    take what its trace says they take, and wait for the actions they depend on."""

    seconds: float                 # the step: the last rank to finish
    rank_seconds: dict             # pipeline rank -> when it finishes (schedule + the rest)
    bubble: dict                   # pipeline rank -> share of the schedule it waits
    p2p_seconds: float             # one activation's transfer between neighbouring stages

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "rank_seconds": self.rank_seconds,
                "bubble": self.bubble, "p2p_seconds": self.p2p_seconds}


def schedule_time(order: dict, action_seconds: dict, other_seconds: dict, p2p: float,
                  num_stages: int) -> PipelineTime | None:
    """Run `order` (pipeline rank -> [(stage, kind, micro-batch)]) as an event simulation:
    a rank runs its actions in order, each when its rank is free and its input is there - a
    forward after the previous stage's forward of the same micro-batch, a backward after the
    next stage's (the last stage's after its own forward), a weight backward after its input
    backward - plus `p2p` seconds when that input came from another rank. `action_seconds`:
    rank -> seconds of each action; `other_seconds`: rank -> the rest of its step (loss,
    optimizer), added after its last action. None if the order cannot run (a deadlock).

    torch's own `_simulate_comms_compute` counts steps of unit length; this one takes each
    action's traced time, so an unbalanced stage shows as the others' waiting."""
    where = {a: r for r, acts in order.items() for a in acts}
    done: dict = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    nxt = dict.fromkeys(order, 0)

    def needs(stage, kind, mb):
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "I", mb)]
        if stage == num_stages - 1:
            return [(stage, "F", mb)]
        return [a for a in ((stage + 1, "B", mb), (stage + 1, "I", mb)) if a in where]

    progress = True
    while progress:
        progress = False
        for r, acts in order.items():
            while nxt[r] < len(acts):
                act = acts[nxt[r]]
                deps = needs(*act)
                if any(d not in done for d in deps):
                    break
                ready = max((done[d] + (p2p if where[d] != r else 0.0) for d in deps),
                            default=0.0)
                t = action_seconds[r][nxt[r]]
                start = max(clock[r], ready)
                clock[r] = start + t
                busy[r] += t
                done[act] = clock[r]
                nxt[r] += 1
                progress = True
    if any(nxt[r] < len(acts) for r, acts in order.items()):
        return None
    span = max(clock.values(), default=0.0)
    ends = {r: clock[r] + other_seconds.get(r, 0.0) for r in order}
    bubble = {r: (1 - busy[r] / span) if span else 0.0 for r in order}
    return PipelineTime(max(ends.values(), default=0.0), ends, bubble, p2p)


def action_seconds(profile) -> tuple[list, list, float] | None:
    """The kinds ("F", "B") and seconds of a rank's compute actions in its traced steady-state
    step - each forward and backward the schedule ran is one phase segment of the trace, in
    order, a repeated block's as often as it runs - and the seconds of the rest of its step;
    None off a GPU."""
    t = profile.time
    if t is None:
        return None
    by_index = {op.record.index: i for i, op in enumerate(profile.ops)}
    kinds, secs = [], []
    for seg, runs in _action_segments(profile.trace, profile.steps):
        kinds.append("F" if seg.phase == "forward" else "B")
        # (an op's seconds are those of all its runs)
        secs.append(sum(t.op_seconds[by_index[i]] for i in seg.ops if i in by_index) / runs)
    total = sum(secs)
    return kinds, secs, max(0.0, t.seconds - total)


def _action_segments(trace, step: int) -> list:
    """(segment, runs) of each compute action of `step` in the order they ran: the segments of
    a block that stands for several (Trace.repeated) once per run."""
    from ..analysis.steps import step_segments
    from ..capture.repeats import ACTIONS

    runs_of = [(first, end, runs) for first, end, runs in trace.repeated if runs > 1]
    out, block, block_of = [], [], None
    for seg in step_segments(trace).get(step, []):
        if seg.phase not in ACTIONS:
            continue
        where = next(((f, e, r) for f, e, r in runs_of if seg.ops and f <= seg.ops.start < e),
                     None)
        if where != block_of:
            out += block * (block_of[2] if block_of else 1)
            block, block_of = [], where
        block.append((seg, where[2] if where else 1))
    out += block * (block_of[2] if block_of else 1)
    return out


# ---- a pipelined profile's plan: what every rank shares ------------------------------------------

@dataclass
class PipelinePlan:
    """What every simulated rank of a pipelined profile shares: the spec, the split, the
    micro-batches and every stage's StageShapes (found once, on meta)."""

    spec: PipelineSpec
    mesh: Any                        # values.mesh.MeshSpec
    microbatches: int
    shapes: list
    split: Any
    meta_model: Any = None           # what the shapes were found on, for measure_parallelised
    stage_inputs: tuple = ()

    @property
    def model_parameters(self) -> int:
        """The whole model's parameters (a rank's profile counts its stages' only)."""
        m = self.meta_model
        m = m if isinstance(m, nn.Module) else m()
        return sum(p.numel() for p in m.parameters())

    def measure_parallelised(self, parallelize, device) -> None:
        """Find the stages' shapes again with each stage parallelised over the other mesh
        dimensions (call in a fake world): what the ranks send each other is their local
        tensor (a share of the sequence under sequence parallelism, in FSDP2's mixed-precision
        dtype). It runs on fake tensors on the profiled device: FSDP2 allocates its buffers
        there, on a GPU a GPU-less machine lacks."""
        import gc

        from ..capture.model import fake_copy, fake_tensor_like
        from ..torch_compat import active_fake_mode

        # inside the rank's capture, on its fake tensors, unrecorded: a FakeTensorMode of our
        # own here left DeviceMesh's later sub-mesh lookups crashing (a segmentation fault in
        # nonzero of the rank map) in about 3 runs in 4
        tape = active_fake_mode()
        with tape.unrecorded():
            inputs = tuple(fake_tensor_like(t, device, None) if isinstance(t, torch.Tensor)
                           else t for t in self.stage_inputs)
            shapes = stage_boundaries(
                lambda: fake_copy(self.meta_model, lambda t: fake_tensor_like(t, device, None)),
                inputs, self.spec, self.pp, self.microbatches, self.split, parallelize)
            del inputs
            gc.collect()  # what the pass made dies here, unrecorded (FSDP2's cycles)
        self.shapes = shapes

    @property
    def pp(self) -> int:
        return self.mesh.as_dict()["pp"]

    @property
    def num_stages(self) -> int:
        return self.spec.num_stages(self.pp)

    def stages_of(self, rank: int) -> tuple:
        return self.spec.stages_of(self.mesh.coordinate(rank)["pp"], self.pp)

    def program(self, rank: int, device_mesh, loss_fn=None, optimizer="adamw",
                until_repeat: bool = False) -> PipelineStep:
        """Rank `rank`'s step; its pipeline group is device_mesh's "pp" dimension. until_repeat:
        traced over fewer micro-batches, until the schedule repeats (never for a real run)."""
        return PipelineStep(self.spec, self.stages_of(rank), self.num_stages, self.microbatches,
                            self.shapes, device_mesh["pp"].get_group(), loss_fn, optimizer,
                            traced_microbatches=traced_microbatches(
                                self.microbatches, self.num_stages, self.spec.kind.multi)
                            if until_repeat else None)

    def stage_modules(self, model: nn.Module, stages: tuple, parallelize) -> nn.Module:
        """The rank's stage modules from its copy of the model, each parallelised over the
        other dimensions: the module itself for one stage, an nn.ModuleList for several."""
        split = []
        for i, s in enumerate(stages):
            # the default split shares the model's modules between stages (each holds other
            # blocks); a user's split may change the model, so each stage but the last gets a copy
            source = model if self.split is split_blocks or i == len(stages) - 1 \
                else copy.deepcopy(model)
            split.append(_split(self.split, source, s, self.num_stages))
        # parallelised once all are split: FSDP2 changes a block's class, and the default split
        # finds the block list by its one class
        modules = [parallelize(m) for m in split]
        return modules[0] if len(modules) == 1 else nn.ModuleList(modules)

    def classes(self, mesh, trace_timed):
        """RankClasses of a pipelined mesh: the ranks of one pipeline coordinate, grouped by
        their shards as ranks.py groups them; `trace_timed(rank) -> layouts` traces a rank."""
        from .ranks import RankClasses, rank_classes

        members, provable = [], True
        for s in range(self.pp):
            ranks = [r for r in range(mesh.world_size) if mesh.coordinate(r)["pp"] == s]
            within = rank_classes(mesh, trace_timed(ranks[0]))
            provable = provable and within.provable
            for m in within.members:
                mine = tuple(r for r in m if r in set(ranks))
                if mine:
                    members.append(mine)
        members.sort(key=lambda m: m[0])
        return RankClasses(tuple(members), provable)

    def report(self, ranks: list, profiles: dict, orders: dict) -> "PipelineReport":
        """What the pipeline does per stage: each pipeline rank's peak, what it holds at its
        peak, its in-flight micro-batches, and the step's time when the ranks run together."""
        by_pp: dict = {}
        for r in ranks:
            by_pp.setdefault(self.mesh.coordinate(r.rank)["pp"], r)   # the lowest rank of each
        order = next((o for o in orders.values() if o), None)   # a multi-stage schedule's
        traced = {s: action_seconds(profiles[r.traced_as]) for s, r in by_pp.items()}
        if order is None:   # a single-stage schedule: what each rank ran, from its trace
            order = {s: traced_order(r.stages[0], traced[s][0] if traced[s] else
                                     _phase_kinds(profiles[r.traced_as]))
                     for s, r in by_pp.items()}
        timing = None
        # each traced forward / backward segment is the order's next action (a zero-bubble
        # schedule's input and weight backwards are backward segments too)
        if all(traced.values()) and all(
                ["F" if k == "F" else "B" for _, k, _ in order[s]] == traced[s][0]
                for s in by_pp):
            p2p = [c.seconds for r in by_pp.values() for c in profiles[r.traced_as].collectives
                   if c.kind in ("send", "recv")]
            timing = schedule_time(order, {s: traced[s][1] for s in by_pp},
                                   {s: traced[s][2] for s in by_pp}, max(p2p, default=0.0),
                                   self.num_stages)
        in_flight = {s: max_in_flight(order.get(s, [])) for s in by_pp}
        stages = [PipelineRank(s, r.stages, r.peak_bytes, dict(r.at_peak), in_flight.get(s))
                  for s, r in sorted(by_pp.items())]
        return PipelineReport(self, stages, timing)

    def to_dict(self) -> dict:
        return {**self.spec.to_dict(), "microbatches": self.microbatches,
                "pp": self.pp, "num_stages": self.num_stages,
                "stage_inputs": [[list(m[0]) for m in s.inputs] for s in self.shapes]}


def _phase_kinds(profile) -> list:
    """"F" / "B" for each forward and backward segment of the rank's steady-state step."""
    return ["F" if seg.phase == "forward" else "B"
            for seg, _ in _action_segments(profile.trace, profile.steps)]


def max_in_flight(actions: list) -> int:
    """The most micro-batches a rank's stages hold at once: forwards run whose backward has not
    (each holds its activations until then)."""
    live = most = 0
    for _, kind, _ in actions:
        if kind == "F":
            live += 1
            most = max(most, live)
        elif kind in ("B", "I"):
            live -= 1
    return most


@dataclass(frozen=True)
class PipelineRank:
    """One pipeline coordinate (its ranks of the other dimensions are alike or listed apart)."""

    pp_rank: int
    stages: tuple
    peak_bytes: int
    at_peak: dict          # category -> bytes at its peak
    in_flight: int | None  # micro-batch activations it holds at most


@dataclass(frozen=True)
class PipelineReport:
    plan: PipelinePlan
    ranks: list            # PipelineRank, by pipeline rank
    time: PipelineTime | None

    def highest(self) -> tuple:
        """(the pipeline rank with the highest peak, the category that puts it above the
        lowest one and by how many bytes)."""
        top = max(self.ranks, key=lambda r: r.peak_bytes)
        low = min(self.ranks, key=lambda r: r.peak_bytes)
        gaps = {k: v - low.at_peak.get(k, 0) for k, v in top.at_peak.items()}
        why = max(gaps, key=gaps.get) if gaps else None
        return top, why, gaps.get(why, 0)

    def to_dict(self) -> dict:
        top, why, gap = self.highest()
        return {**self.plan.to_dict(),
                "ranks": [{"pp_rank": r.pp_rank, "stages": list(r.stages),
                           "peak_bytes": r.peak_bytes, "at_peak": r.at_peak,
                           "in_flight_microbatches": r.in_flight} for r in self.ranks],
                "highest": {"pp_rank": top.pp_rank, "because_of": why, "bytes_more": gap},
                "time": None if self.time is None else self.time.to_dict()}


def pipeline_plan(workload, options) -> PipelinePlan:
    """The plan of a pipelined profile: micro-batches (default: one per sample), the split and
    every stage's StageShapes, from a meta copy of the workload's model."""
    from ..capture.model import fake_copy, fake_inputs, fake_tensor_like, model_of

    # imported here, outside any rank's capture: importing it makes a real 4-byte tensor
    # (microbatch.py's sum_reducer), which would count as a rank's memory if made inside one
    from torch.distributed import pipelining  # noqa: F401

    spec, mesh = options.pipeline, options.mesh
    if "pp" not in mesh.names:
        raise TapescopeError("a pipelined profile needs a mesh dimension named 'pp'")
    if workload.kwargs:
        raise TapescopeError("a pipelined step takes positional inputs only (the first stage's "
                             "inputs, then the target the last stage's loss compares with)")
    if len(workload.args) < 2:
        raise TapescopeError("a pipelined step takes the first stage's inputs and then the "
                             "target of the loss (e.g. tokens, labels)")
    meta_model = fake_copy(model_of(workload.model),
                           lambda t: fake_tensor_like(t, "meta", options.dtype))
    args = fake_inputs(tuple(workload.args), torch.device("meta"), options.dtype)
    stage_inputs = args[:-1]
    batch = next((a.shape[0] for a in stage_inputs if isinstance(a, torch.Tensor) and a.dim()),
                 None)
    microbatches = spec.microbatches or batch or 1
    pp = mesh.as_dict()["pp"]
    if microbatches < pp and spec.schedule != "gpipe":
        raise TapescopeError(f"schedule {spec.schedule} needs at least as many micro-batches as "
                             f"pipeline ranks ({pp}); got {microbatches}")
    if batch is not None and batch % microbatches:
        sizes = [len(c) for c in torch.tensor_split(torch.empty(batch, 0), microbatches)]
        raise TapescopeError(
            f"a batch of {batch} does not split into {microbatches} equal micro-batches "
            f"(torch.tensor_split makes {sizes}); the stages' shapes are fixed for one "
            f"micro-batch, so the schedule's backward fails on the last ones ('Failed to run "
            f"stage backward'). Give a batch that is a multiple of the micro-batches, e.g. "
            f"--batch {batch // microbatches * microbatches or microbatches}, or "
            f"--microbatches dividing {batch}")
    split = spec.split or split_blocks
    shapes = stage_boundaries(meta_model, stage_inputs, spec, pp, microbatches, split)
    return PipelinePlan(spec, mesh, microbatches, shapes, split, meta_model, stage_inputs)


def action_segments(profile) -> list:
    """(segment, runs) of each compute action of a pipelined rank's steady-state step, in the
    order the schedule ran them, a repeated block's once per run: what `action_seconds` times
    (layout_search/bounds.py reads the same actions' kernels)."""
    return _action_segments(profile.trace, profile.steps)
