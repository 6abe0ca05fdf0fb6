"""The training step as a program: one object that capture runs on fake tensors and the real-run
validator runs on real ones, so both run the same code.

A `StepProgram` has two parts. `setup(model, params, device)` runs once, before step 1, and makes
what the steps keep (the optimizer; for a user's step, whatever its `setup` returns). `run(...)`
runs one step. Two programs:
- `BuiltinStep`: forward, loss, backward (of each micro-batch), optimizer.step(), zero_grad
  (capture/step.py);
- `UserStep`: the user's own `fn(model, batch, optimizer)`, run as written.

A program is run by a `StepRuntime`: how a phase is marked (capture: a Segment of the tape; the
real run: a torch.profiler record_function) and how a backward runs (capture: tapescope's engine;
the real run: torch's). A user's fn says nothing about its phases, so `phase_marks` finds them from
what runs, the innermost naming an op:
- a forward of one of the model's modules, called from the step's own code: FORWARD (a forward
  inside the backward is a recomputation, and stays in the backward);
- `torch.autograd.backward` (so `loss.backward()`) and `torch.autograd.grad`: BACKWARD, run by the
  runtime's engine;
- any optimizer's `step()` (torch.optim's global step hooks), also one a backward hook calls (an
  optimizer in the backward, `register_post_accumulate_grad_hook`): OPTIMIZER;
- everything else the fn runs: OTHER (computing the loss, clipping gradients, an EMA of the
  weights, a scheduler's step, offloading hooks' copies outside the backward).

Not seen: a backward reached without `torch.autograd.backward` / `.grad` (`from torch.autograd
import backward` bound before the step; `torch._C._EngineBase.run_backward`), a forward
called as `module.forward(x)` (no module hooks run), and a module compiled with `.compile()`
that the step calls directly (its hooks run inside the compiled code, where they do nothing):
those ops are OTHER. A compiled module inside the model's forward is in FORWARD as usual.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..errors import TapescopeError, passes_user_calls, user_error
from ..torch_compat import patched
from .optimizers import make_optimizer
from .records import BACKWARD, FORWARD, OPTIMIZER, OTHER
from .step import train_step

__all__ = ["StepProgram", "StepRuntime", "BuiltinStep", "UserStep", "phase_marks", "steps_of",
           "optimizers_in", "state_tensors", "step_program"]


@dataclass
class StepRuntime:
    """What runs a program provides.

    phase(step, name): a context manager marking a phase; phases nest.
    backward(tensors, grad_tensors, retain_graph): runs a backward (capture: tapescope's engine);
        None: torch's own.
    grad(outputs, inputs, grad_outputs, retain_graph, allow_unused) -> gradients: the same for
        torch.autograd.grad; None: torch's own.
    forward_context / loss_context: opened around the built-in step's forward / loss.
    train_context(args, kwargs): opened around each micro-batch's forward and backward (torch's
        context_parallel for a CP preset, which must see both).
    on_optimizer(optimizer): an optimizer's step starts or ends (capture names its state).
    on_default_loss(what): the built-in step used default_loss, and which of its choices.
    micro_batch_done(i, n): micro-batch i of n has run; True ends the loop (capture/step.py).
    first_step_only(step): opened around what a program runs in its first step alone (a
        pipeline schedule's initialisation of its stages); capture marks it, and a step 2
        built from step 1 leaves it out (capture/first_step.py).
    """

    phase: Callable
    backward: Callable | None = None
    grad: Callable | None = None
    forward_context: Callable = nullcontext
    loss_context: Callable = nullcontext
    train_context: Callable = field(default=lambda args, kwargs: nullcontext())
    on_optimizer: Callable = field(default=lambda optimizer: None)
    on_default_loss: Callable = field(default=lambda what: None)
    micro_batch_done: Callable = field(default=lambda i, n: False)
    #: the global hooks phase_marks uses, when registered once for every step (steps_of)
    hooks: Any = None
    first_step_only: Callable = field(default=lambda step: nullcontext())


class StepProgram(ABC):
    """One training step, run the same way by capture and by the real-run validator."""

    #: step 2's forward and backward may be step 1's (capture/session.py checks when)
    reusable: bool = False
    #: setup is recorded as step 0 (what it makes is alive when step 1 starts); else it runs
    #: before the recording, like the built-in step's optimizer construction
    records_setup: bool = False
    #: step 2 may be step 1 less what `runtime.first_step_only` marked and less its optimizer
    #: step, then its own optimizer step (capture/first_step.py proves when). Such a program's
    #: `run` takes `end=False` (a step without its gradient reset) and it has
    #: `optimizer_step`, `end_step` and `first_step_done`
    step2_from_step1: bool = False

    def describe(self) -> dict | None:
        """What the report says about the program (RunFacts.step); None for the built-in step."""
        return None

    @abstractmethod
    def setup(self, model: nn.Module, params: list, device: torch.device) -> Any:
        """What the steps keep, made once before step 1 (the optimizer)."""

    @abstractmethod
    def run(self, model, args: tuple, kwargs: dict, state, step: int,
            runtime: StepRuntime) -> None:
        """One step: its phases bracketed by `runtime`."""

    def optimizer_step(self, model, state, step: int, runtime: StepRuntime) -> None:
        """(step2_from_step1) The optimizer step alone, as `run` takes it."""
        raise NotImplementedError(f"{type(self).__name__} sets step2_from_step1: it must define "
                                  "optimizer_step")

    def end_step(self, state, step: int, runtime: StepRuntime) -> None:
        """(step2_from_step1) The gradient reset that ends a step run with `end=False`."""
        raise NotImplementedError(f"{type(self).__name__} sets step2_from_step1: it must define "
                                  "end_step")

    def first_step_done(self, state) -> bool:
        """(step2_from_step1) True when later steps skip what step 1 ran in
        `runtime.first_step_only`, as the program's own state says."""
        return False


@dataclass
class BuiltinStep(StepProgram):
    """forward, loss, backward (`accumulate` micro-batches), optimizer.step(), zero_grad."""

    loss_fn: Callable | None = None
    optimizer: Any = "adamw"
    accumulate: int = 1
    reusable = True

    def setup(self, model, params, device):
        return make_optimizer(self.optimizer, params, device)

    def run(self, model, args, kwargs, state, step, runtime, end: bool = True):
        backward = torch.Tensor.backward if runtime.backward is None else \
            (lambda loss: runtime.backward((loss,), None, False))
        return train_step(model, args, kwargs, self.loss_fn, state, step=step,
                          phase=runtime.phase, backward=backward,
                          forward_context=runtime.forward_context,
                          loss_context=runtime.loss_context, accumulate=self.accumulate, end=end,
                          train_context=runtime.train_context,
                          on_default_loss=runtime.on_default_loss,
                          micro_batch_done=runtime.micro_batch_done)


@dataclass
class UserStep(StepProgram):
    """The user's `fn(model, batch, optimizer)`, run as written.

    batch: the positional inputs as a tuple (`x, y = batch`), or the keyword inputs as a dict
    when only those are given (`model(**batch)`). optimizer: what `setup(model)` returns when
    given (several optimizers, a scheduler, an EMA's weights: anything), else the optimizer
    `optimizer=` names (or None)."""

    fn: Callable
    setup_fn: Callable | None = None
    optimizer: Any = "adamw"

    @property
    def records_setup(self) -> bool:
        return self.setup_fn is not None

    def describe(self) -> dict:
        return {"fn": _qualname(self.fn), "setup": _qualname(self.setup_fn)}

    def setup(self, model, params, device):
        if self.setup_fn is None:
            return make_optimizer(self.optimizer, params, device)
        return _call_setup(self.setup_fn, model)

    def run(self, model, args, kwargs, state, step, runtime):
        if args and kwargs:
            raise TapescopeError("a step function takes one batch: give the inputs either "
                                 "positionally (batch = the tuple) or as input_kwargs (batch = "
                                 "the dict), not both")
        batch = dict(kwargs) if kwargs else tuple(args)
        with phase_marks(model, step, runtime):
            _call_step(self.fn, model, batch, state)  # what it returns dies here, in the step


def _qualname(fn) -> str | None:
    if fn is None:
        return None
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@passes_user_calls
def _call_setup(setup, model):
    return setup(model)


@passes_user_calls
def _call_step(fn, model, batch, state) -> None:
    try:
        result = fn(model, batch, state)
    except SystemExit as e:  # the user's sys.exit: a message at its line, not our process ending
        raise user_error(RuntimeError(
            f"the step called sys.exit({e.code!r}); a step must return to be profiled")
        ).with_traceback(e.__traceback__) from None
    if inspect.isgenerator(result) or inspect.iscoroutine(result) or inspect.isasyncgen(result):
        close = getattr(result, "close", None) or getattr(result, "aclose", None)
        if inspect.isgenerator(result) or inspect.iscoroutine(result):
            close()  # a coroutine never awaited would warn
        kind = "a generator" if inspect.isgenerator(result) else "an async"
        raise TapescopeError(f"the step {_qualname(fn)} is {kind} function: calling it runs none "
                             "of its body, so there is no step to profile; write it as a plain "
                             "function (def, without yield or async)")


@contextmanager
def torch_globals_kept():
    """A user's step may set torch's process-wide settings (default dtype, grad mode, threads,
    deterministic algorithms, fp32 matmul precision), as a training script may; the step's next
    call sees them, as in the script, but the caller of a profile gets its own back."""
    saved = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
             torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.get_float32_matmul_precision())
    try:
        yield
    finally:
        dtype, grad, threads, deterministic, warn_only, precision = saved
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_float32_matmul_precision(precision)


def optimizers_in(state) -> list:
    """The optimizers a setup's result holds (an Optimizer, or containers of them)."""
    from ..torch_compat import tree_leaves

    return [x for x in tree_leaves(state) if isinstance(x, torch.optim.Optimizer)]


def state_tensors(state) -> list:
    """The tensors a setup's result holds outside optimizers: tensors in containers (an EMA's
    copy of the weights) and the parameters and buffers of modules (an AveragedModel)."""
    from ..torch_compat import tree_leaves

    out = []
    for x in tree_leaves(state):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, nn.Module):
            out += [*x.parameters(), *x.buffers()]
    return out


@contextmanager
def phase_marks(model: nn.Module, step: int, runtime: StepRuntime):
    """While the block runs, mark its phases as the module docstring says (OTHER outside the
    others), and route torch.autograd.backward / grad to the runtime's engine. Yields
    `backward_phase()`, a context manager making its block one BACKWARD phase however many
    backwards run in it (a pipeline's weight backward: one autograd.grad per parameter group)."""
    ours = {id(m) for m in model.modules()}
    names: list[str] = []
    opened: list = []
    depth = 0  # nesting of the model's modules inside the forward phase we opened

    def enter(name: str) -> None:
        cm = runtime.phase(step, name)
        cm.__enter__()
        opened.append(cm)
        names.append(name)

    def leave() -> None:
        names.pop()
        opened.pop().__exit__(None, None, None)

    # Where dynamo traces a module call (a module the model's code compiled), the hooks are traced
    # with it and have nothing to mark: the ops run later inside a compiled graph. Traced, they
    # would make dynamo guard on which module runs (`id(module) in ours`) and on `depth`, and
    # recompile a layer per layer until dynamo's recompile limit (8) sends the rest, a
    # checkpoint's recomputation included, to eager. `is_compiling()` is a constant to dynamo,
    # so nothing below it is traced (as in capture/modules.py).
    def pre(module, args):
        nonlocal depth
        if torch.compiler.is_compiling() or id(module) not in ours:
            return
        if depth == 0:
            if names[-1] != OTHER:  # a recomputation in the backward, a module in an optimizer
                return
            enter(FORWARD)
        depth += 1

    def post(module, args, out):
        nonlocal depth
        if torch.compiler.is_compiling() or id(module) not in ours or depth == 0:
            return
        depth -= 1
        if depth == 0 and names[-1] == FORWARD:
            leave()

    def step_pre(optimizer, args, kwargs):
        enter(OPTIMIZER)
        runtime.on_optimizer(optimizer)

    def step_post(optimizer, args, kwargs):
        runtime.on_optimizer(optimizer)
        if names[-1] == OPTIMIZER:
            leave()

    @contextmanager
    def backward_phase():
        """One BACKWARD phase around the block; inside one already (a program marking a whole
        action that calls autograd several times), no new one."""
        nested = names[-1] == BACKWARD
        if not nested:
            enter(BACKWARD)
        try:
            yield
        finally:
            if not nested:
                leave()

    torch_backward, torch_grad = torch.autograd.backward, torch.autograd.grad

    @passes_user_calls
    def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                 grad_variables=None, inputs=None):
        if grad_tensors is None:
            grad_tensors = grad_variables
        if runtime.backward is not None and (create_graph or inputs is not None):
            raise TapescopeError("a backward with create_graph=True or inputs=... is not "
                                 "supported in a traced step yet (tapescope's engine runs the "
                                 "backward)")
        with backward_phase():
            if runtime.backward is None:
                torch_backward(tensors, grad_tensors, retain_graph, create_graph, inputs=inputs)
            else:
                runtime.backward(tensors, grad_tensors, retain_graph)

    @passes_user_calls
    def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
             only_inputs=True, allow_unused=None, is_grads_batched=False,
             materialize_grads=False):
        if runtime.grad is not None and (create_graph or is_grads_batched or materialize_grads):
            raise TapescopeError("torch.autograd.grad with create_graph=True, is_grads_batched "
                                 "or materialize_grads is not supported in a traced step yet")
        with backward_phase():
            if runtime.grad is None:
                return torch_grad(outputs, inputs, grad_outputs, retain_graph, create_graph,
                                  only_inputs, allow_unused, is_grads_batched, materialize_grads)
            return runtime.grad(outputs, inputs, grad_outputs, retain_graph, bool(allow_unused))

    hooks = runtime.hooks
    own = hooks is None
    if own:
        hooks = _PhaseHooks().__enter__()
    hooks.marks = (pre, post, step_pre, step_post)
    with patched(torch.autograd, backward=backward, grad=grad):
        enter(OTHER)
        try:
            yield backward_phase
        finally:
            hooks.marks = None
            if own:
                hooks.__exit__(None, None, None)
            while opened:  # an error left phases open (an optimizer step raised, say)
                leave()


class _PhaseHooks:
    """The global module-call and optimizer-step hooks phase_marks marks phases with,
    registered once for all the steps of a run (`steps_of`) and passing each call to the
    current step's marks (none between steps).

    Why once: dynamo guards a compiled region on the keys of torch's global hook dicts
    (`list(dict.keys(_global_forward_hooks))[1] == 55`), so hooks registered anew each step made
    every compiled region recompile each step - compile time paid twice, and a code object with
    more than 4 graphs a step reaching dynamo's recompile limit (8) in step 2, sending the rest
    to eager where the user's own run (no hooks, no recompile) stays compiled."""

    def __init__(self):
        self.marks = None   # (pre, post, step_pre, step_post) of the step running
        self._handles: list = []

    def __enter__(self):
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)

        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True),
                         register_optimizer_step_pre_hook(self._step_pre),
                         register_optimizer_step_post_hook(self._step_post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    # each returns at once under dynamo (a constant to it: nothing after it is traced)
    def _pre(self, module, args):
        if not torch.compiler.is_compiling() and self.marks is not None:
            self.marks[0](module, args)

    def _post(self, module, args, out):
        if not torch.compiler.is_compiling() and self.marks is not None:
            self.marks[1](module, args, out)

    def _step_pre(self, optimizer, args, kwargs):
        if self.marks is not None:
            self.marks[2](optimizer, args, kwargs)

    def _step_post(self, optimizer, args, kwargs):
        if self.marks is not None:
            self.marks[3](optimizer, args, kwargs)


@contextmanager
def steps_of(program: StepProgram, runtime: StepRuntime):
    """Around all the steps a caller runs of `program` with `runtime`: a user's step gets its
    phase hooks registered once for all of them (_PhaseHooks says why)."""
    if not isinstance(program, UserStep) or runtime.hooks is not None:
        yield
        return
    with _PhaseHooks() as hooks:
        runtime.hooks = hooks
        try:
            yield
        finally:
            runtime.hooks = None


def step_program(options) -> StepProgram:
    """The program `options` ask for: the user's step (options.step), else the built-in one."""
    if options.step is not None:
        return UserStep(options.step, options.setup, options.optimizer)
    return BuiltinStep(options.loss_fn, options.optimizer, options.accumulate)
