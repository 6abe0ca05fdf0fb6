"""Capture: run training steps of a fake copy of the model on a Tape and return the Trace.

Steps. Memory in the first step differs from later ones: the optimizer creates its state during the
first `optimizer.step()`. Step 2 is the steady state. Its forward and backward run exactly the ops of
step 1 when the step leaves the model as it found it (same tensors in the same storages), so we trace
forward and backward once and the optimizer step twice, and build step 2 from step 1's forward and
backward plus the second optimizer step. When the model changed (a cache built in the first forward,
parameters replaced), step 2 is traced in full. `Trace.step2` says which happened.

The collaborators, each made here and handed to the others explicitly:
- `Tape` (tape.py): the FakeTensorMode that records ops and storages into the Trace;
- the fidelity rules of the traced device (fidelity/), their per-capture `FidelityContext` and the
  TorchFunctionMode that applies the function-level ones;
- `ViewRegeneration` (view_replay.py): the views autograd regenerates after in-place ops;
- `SavedTensors` and `HookRegistry` (hooks.py): what autograd saves, the hooks the step registers;
- `PythonEngine` (engine.py): the backward, run the way torch's C++ engine runs it;
- `ModuleStack` (tape.py) kept by the module hooks (modules.py).
"""

from __future__ import annotations

import gc
import logging
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..losses import describe_loss, grad_tensors, sum_of
from ..errors import (DataDependentError, TapescopeError, from_trace_failure, raised_by_tapescope,
                      source_dirs)
from ..options import Options, Workload
from ..torch_compat import (DimDynamic, FakeTensor, FakeTensorMode, ShapeEnv, constant_source,
                            function_mode_lifted, hook_guard_locations, patched,
                            pytree_node_types, shape_env_facts, tree_leaves, tree_map,
                            user_source_location, without_torch_function)
from .data_values import DataValues
from .distributed_roles import assign_roles, sharded_parameter_names
from .engine import PythonEngine
from .fidelity import RULES, FidelityContext, FunctionRulesMode
from .first_step import StepNotRepeated, nested_first_step, why_not_repeated, why_reset_differs
from .fidelity.attention import sdpa_composite_of_the_gpu
from .fidelity.libraries import library_branches
from .fidelity.linear import autocast_casts_cleared_with_torchs
from .hooks import HookRegistry, SavedTensors
from .isolation import Isolation
from .rng_state import track_rng_states
from .model import Spec, built_for, fake_inputs, fake_tensor_like
from .modules import module_names, track_modules
from .optimizers import steps_outside_function_rules
from .program import (StepRuntime, optimizers_in, state_tensors, step_program, steps_of,
                      torch_globals_kept)
from .records import (BACKWARD, BUFFER, FIRST_STEP_ONLY, FORWARD, GRADIENT, INPUT,
                      INTERNAL_GUARD, LOSS_MODULE, OPTIMIZER, OPTIMIZER_STATE, OTHER, PARAMETER,
                      SETUP, ZERO_GRAD, GuardRecord, RunFacts, Trace)
from .step import zero_grad
from .tape import ModuleStack, Tape
from .view_replay import ViewRegeneration

__all__ = ["capture", "CaptureSession", "Recorder", "trace_call", "autocast"]

# torch's own entry points, as imported: a user's step runs with them routed to tapescope's engine
# (program.phase_marks), and engine="torch" calls these
_TORCH_BACKWARD, _TORCH_GRAD = torch.autograd.backward, torch.autograd.grad


def capture(workload: Workload, options: Options, progress=None,
            prepare=None, streams=None, program=None) -> tuple[Trace, RunFacts]:
    """Trace `options.steps` (1 or 2) training steps; returns the Trace and what else the run
    taught (RunFacts).

    A step whose sizes depend on tensor values (a mixture of experts' routing, a boolean mask) is
    traced again with a ShapeEnv that carries those sizes as unbacked symbols, their values
    given by `options.sizes` (data_values.py); the first attempt runs without one, as most
    steps need none. progress(step, phase) is called after each phase; `prepare(fake_model)`
    (a distributed profile's parallelisation) runs on each attempt's fake model; `streams` (a
    StreamLog) says which CUDA stream each op is issued on; `program` is a StepProgram run in
    place of the one the options ask for (a pipelined rank's step, distributed/pipeline.py)."""
    workload = replace(workload, model=built_for(workload.model, options))  # built once, for all
    how: dict = {}
    while True:
        session = CaptureSession(workload, options, progress, prepare=prepare,
                                 streams=streams, program=program, **how)
        try:
            return session.run()
        except DataDependentError:
            if options.symbolic or how.get("data_dependent"):
                raise  # that session had a ShapeEnv and values already
            how["data_dependent"] = True
        except StepNotRepeated as e:
            if how.get("step2_traced"):
                raise
            how["step2_traced"] = str(e)  # step 2 could not be built from step 1: traced
        finally:
            # the fake tensors that outlive the session must not keep its trace (Tape.hand_over)
            session.tape.hand_over()


def autocast(device: torch.device, dtype: torch.dtype):
    """torch.autocast for the traced device, opened while the step is recorded: for CUDA on a
    machine without a GPU, torch's question "is there a GPU?" is answered as on the profiled GPU
    then (fidelity/libraries.py), so this autocast stays on - and so does every other one the
    step opens (checkpoint's recomputation, the model's own). The dispatcher's autocast keys
    work on fake CUDA tensors."""
    return torch.autocast(device.type, dtype=dtype)


def _without_wrapper_prefix(fqn: str) -> str:
    """A parameter's name as the user wrote it: checkpoint_wrapper's inner-module segment removed,
    as its own state_dict hook does (torch.distributed.algorithms._checkpoint.checkpoint_wrapper,
    _CHECKPOINT_PREFIX)."""
    return fqn.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


@dataclass
class Recorder:
    """The tape and its collaborators for one trace, wired to each other (see the module doc)."""

    tape: Tape
    fidelity: FidelityContext
    function_rules: FunctionRulesMode
    views: ViewRegeneration
    modules: ModuleStack
    saved: SavedTensors
    hooks: HookRegistry
    engine: PythonEngine

    @classmethod
    def create(cls, device: torch.device, gpu=None, shape_env=None, cpu=None,
               values=None) -> "Recorder":
        from ..devices.cpu import cpu_target

        views, modules = ViewRegeneration(), ModuleStack()
        fidelity = FidelityContext(device, gpu, cpu=cpu or cpu_target(), views=views,
                                   values=values)
        rules = RULES.for_device(device.type)
        tape = Tape(rules=rules, fidelity=fidelity, views=views, modules=modules,
                    shape_env=shape_env)
        saved = SavedTensors(tape)
        fidelity.bytes_outside_ops, fidelity.keep_with_node = (tape.bytes_outside_ops,
                                                               saved.keep_with_node)
        hooks = HookRegistry()
        engine = PythonEngine(saved, hooks, views, on_node=tape.set_backward_node)
        return cls(tape, fidelity, FunctionRulesMode(fidelity, rules), views, modules, saved,
                   hooks, engine)


def trace_call(device: torch.device, make_inputs, fn, observe=nullcontext, gpu=None) -> Trace:
    """Trace `fn(*make_inputs())` as a forward phase, then the backward of the sum of its
    floating-point outputs that require grad (if any). `observe()` wraps the forward (explain
    runs the profiler there to see the dispatcher's calls)."""
    rec = Recorder.create(device, gpu)
    with rec.tape:
        args = make_inputs()
        with rec.saved.active(), rec.function_rules, observe():
            with rec.tape.phase(1, FORWARD):
                out = fn(*args)
        floats = grad_tensors(out if isinstance(out, (tuple, list)) else [out])
        if floats:
            loss = sum_of(floats)  # outside any phase: not recorded
            with rec.saved.active(), rec.function_rules, rec.tape.phase(1, BACKWARD):
                rec.engine.backward(loss)
    return rec.tape.trace


class CaptureSession:
    """One capture of a workload under options. `run()` once."""

    def __init__(self, workload: Workload, options: Options, progress=None, prepare=None,
                 data_dependent: bool = False, streams=None, program=None,
                 step2_traced: str | None = None):
        """prepare: `fn(fake_model) -> model`, run on the fake copy before the first step and
        recorded as step 0 (setup): a simulated rank's parallelisation (distributed/profile.py).
        What it leaves alive is there when step 1 starts.
        data_dependent: trace with a ShapeEnv whose unbacked symbols carry the sizes the data
        decides (capture() retries with it when the first attempt meets one).
        step2_traced: why step 2 is traced in full where it could be built from step 1
        (capture() retries with it when the proof's last condition fails, first_step.py)."""
        self.options = options
        self.progress = progress
        self.prepare = prepare
        self.given_program = program  # a StepProgram; default: the one the options ask for
        self.model = built_for(workload.model, options)
        args, kwargs = tuple(workload.args), dict(workload.kwargs or {})
        self.shape_env = None
        if options.symbolic:
            self.shape_env = ShapeEnv(duck_shape=False)  # batch 8 and seq 8 stay two symbols
            args, kwargs = _as_specs((args, kwargs))
        elif data_dependent:
            # an .item() of a tensor no assumption decided stops at that op, not at a later guard
            self.shape_env = ShapeEnv(allow_scalar_outputs=False)
        self.args, self.kwargs = args, kwargs
        self._loss = None  # a step's loss while the step is not ended yet (_trace_steps)
        # always on: routers get their assumed indices (cheap: nothing else is touched until one
        # is seen); sizes they decide need the ShapeEnv of a data-dependent retry
        self.values = DataValues(options.sizes, self.shape_env)

        rec = self.recorder = Recorder.create(options.device, options.gpu, self.shape_env,
                                              options.cpu, self.values)
        self.tape, self.saved, self.engine = rec.tape, rec.saved, rec.engine
        self.tape.streams = streams
        self.trace = self.tape.trace
        # what the run teaches besides the trace, gathered as it goes (RunFacts, built in run())
        self.loss_described: str | None = None   # the default loss the step chose, if it did
        self.accumulate_traced: int | None = None  # micro-batches traced before they repeated
        self.compile_record = None  # compiled.CompileRecord of a compiled step
        self.sharded_names: set = set()  # a simulated rank's parameters that are shards
        # a program whose step 2 may be built from step 1 (capture/first_step.py): why it was
        # traced in full instead (given: capture()'s retry), None while it may be
        self.step2_not_reused: str | None = step2_traced
        self.first_step_nested = False  # a phase opened inside a first-step-only block
        if self.shape_env is not None:
            _guards_name_user_lines(self.shape_env, self.tape)

    # ---- the run, top to bottom ------------------------------------------------------------

    def run(self) -> tuple[Trace, RunFacts]:
        opts, trace = self.options, self.trace
        with self.tape, self.tape.recording_resizes():
            self._make_fake_model()
            self.program = program = self.given_program or step_program(opts)
            self.optimizers: list = []  # every optimizer the step uses (their state is named)
            self.state_tensors: list = []  # what a user step's setup made besides optimizers
            self.optimizer = None
            if not program.records_setup:
                # recorded as setup, as a step's own setup is: what an optimizer makes when it is
                # built (bitsandbytes' quantization maps) is memory, and its code may read it
                with self.tape.phase(0, SETUP), self.values.building():
                    self.optimizer = program.setup(self.fmodel, self.params, opts.device)
                if self.optimizer is not None:
                    self.optimizers.append(self.optimizer)
                    if self.float8 is not None and self.float8.fsdp_float8_all_gather:
                        # torchtitan's post-optimizer hook: one amax all-reduce for all weights
                        from .float8 import precompute_scales

                        self.optimizer.register_step_post_hook(precompute_scales(self.fmodel))
            self.step_model = self.fmodel
            self.user_compiled_graphs = 0  # graphs of the user's own torch.compile calls, eager
            if opts.compile is not None:
                self._compile_model()
            elif compiled_modules(self.fmodel):
                self._run_compiled_modules_eagerly()
            try:
                with self._recording():
                    if program.reusable:
                        if opts.loss_fn is not None:  # else the step says which default it used
                            self.loss_described = describe_loss(opts.loss_fn)
                        self._trace_steps()
                    else:
                        self._trace_user_steps()
            except TapescopeError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure of user code becomes a message
                if raised_by_tapescope(e):
                    raise  # our bug, not the user's: keep the traceback
                if getattr(e, "tapescope_phase", None) is None:
                    try:
                        e.tapescope_phase = self.tape.current_phase
                    except AttributeError:  # exception types that refuse attributes
                        pass
                raise from_trace_failure(e) from e
        if opts.compile is not None and not self.compile_record.regions:
            self._compiled_nothing()
        if self.user_compiled_graphs:
            self.isolation.notes.append(
                f"code compiled with torch.compile outside the model (a compiled loss, ...: "
                f"{self.user_compiled_graphs} graph(s)) ran eagerly in this profile, its ops as "
                "dynamo captured them, unfused")
        if self.shape_env is not None:
            self._record_shape_facts()
        self.values.write(trace)
        if opts.mesh is not None:  # a simulated rank's storages, by the ops that filled them
            assign_roles(trace, self.sharded_names)
        return trace, self._run_facts()

    def _run_facts(self) -> RunFacts:
        """What the run taught besides the trace, once it is over."""
        opts, fidelity = self.options, self.recorder.fidelity
        described = self.program.describe()
        notes = self.isolation.notes + self.isolation.leaks(self.model)
        unused = opts.sizes.unused(self.trace.assumptions)
        cpu = fidelity.cpu if opts.device.type == "cpu" else None
        return RunFacts(
            parameters=self.param_count,
            param_dtype=self.param_dtype,
            optimizer=_describe_optimizer(self.optimizers[0]) if self.optimizers else None,
            amp=None if opts.amp is None else str(opts.amp).replace("torch.", ""),
            heuristics={topic: list(texts) for topic, texts in fidelity.notes.items()},
            loss=self.loss_described,
            step=None if described is None else {**described,
                                                 "optimizers": len(self.optimizers)},
            isolation_notes=tuple(notes) if notes else None,
            sizes_unused=tuple(unused) if unused else None,
            gpu=None if opts.gpu is None else opts.gpu.key,
            sdpa_backends={k.split(":", 1)[1]: v for k, v in fidelity.counts.items()
                           if k.startswith("sdpa:")} if opts.device.type == "cuda" else None,
            cpu=None if cpu is None else {"isa": cpu.isa, "threads": cpu.threads,
                                          "detected": cpu.detected},
            checkpointing=tuple(p.to_dict() for p in opts.checkpointing)
            if opts.checkpointing else None,
            accumulate=opts.accumulate if opts.accumulate > 1 else None,
            accumulate_traced=self.accumulate_traced,
            compiled=self.compile_record,
            step2_not_reused=self.step2_not_reused)

    def _make_fake_model(self) -> None:
        """The fake copy of the model and inputs, their tensors registered with the tape."""
        opts, tape = self.options, self.tape
        # the model's private copy: parameters and buffers on the traced device and dtype; tensors
        # of other state (caches, closures) keep their device, as model.to() leaves them
        buffers = {}
        for fqn, b in self.model.named_buffers(remove_duplicate=False):
            buffers.setdefault(id(b), fqn)

        def module_tensor(t):  # a small integer buffer keeps its values (data_values.py)
            fake = fake_tensor_like(t, opts.device, opts.dtype)
            self.values.give_constant(fake, t, buffers.get(id(t)))
            return fake

        def state_tensor(t):  # in a module's list or dict (torchvision's cell anchors): as above
            fake = fake_tensor_like(t, opts.device if t.device.type == "meta" else t.device, None)
            self.values.give_constant(fake, t, None)
            return fake

        self.isolation = Isolation(module_tensor, state_tensor)
        with tape.unrecorded_through_front():  # ~100 us an op saved per tensor copied
            self.fmodel = self.isolation.copy_model(self.model)
        self.float8 = None
        if opts.float8 is not None:  # the copy's Linears, before any parallelisation
            from .float8 import convert_float8

            layout = getattr(opts.parallelize, "layout", None)
            self.float8 = convert_float8(self.fmodel, opts.float8,
                                         fsdp=layout is not None and layout.fsdp > 1,
                                         tensor_parallel=layout is not None and layout.tp > 1)
            self.isolation.notes.append(self.float8.describe())
        wrapped: list = []  # (wrapper, module, fqn) of a plan applied before the parallelisation
        if self.prepare is not None and opts.checkpointing:
            # torchtitan's order: activation checkpointing first (apply_ac), then FSDP / TP
            # shard the wrapped blocks, as a training script applying both writes it
            from .checkpointing import apply_policies

            apply_policies(self.fmodel, opts.checkpointing,
                           on_wrap=lambda w, m, fqn: wrapped.append((w, m, fqn)))
        if self.prepare is not None:
            with tape.phase(0, SETUP), self._capability_answered():
                self.fmodel = self.prepare(self.fmodel)
                # what prepare replaced can sit in reference cycles (FSDP2's module <-> state),
                # freed whenever the collector next runs; a training script's step 1 starts
                # long after that, so collect now, while the frees are recorded
                gc.collect()
            self.sharded_names = sharded_parameter_names(self.fmodel)
        sizes = {}
        if self.shape_env is not None:
            sizes, hints = _symbols(self.shape_env, opts.symbolic, (self.args, self.kwargs))
            self.trace.hints = hints
            self.trace.symbols = {name: s.node.expr for name, s in sizes.items()}
        with tape.unrecorded_through_front():
            self.fargs, self.fkwargs = fake_inputs((self.args, self.kwargs), opts.device,
                                                   opts.dtype, sizes)
        self.names = module_names(self.fmodel)
        if wrapped:  # the plan's wrappers and what they hold keep the user's names
            self.names = {k: _without_wrapper_prefix(v) for k, v in self.names.items()}
            for wrapper, module, fqn in wrapped:
                self.names[id(wrapper)] = self.names[id(module)] = fqn
        self.param_fqn: dict[int, str] = {}
        for fqn, p in self.fmodel.named_parameters(remove_duplicate=False):
            fqn = _without_wrapper_prefix(fqn) if wrapped else fqn
            self.param_fqn.setdefault(id(p), fqn)
            tape.register(p, fqn, PARAMETER, owner=fqn)
        self.buffer_fqn: dict[int, str] = {}
        for fqn, b in self.fmodel.named_buffers(remove_duplicate=False):
            fqn = _without_wrapper_prefix(fqn) if wrapped else fqn
            self.buffer_fqn.setdefault(id(b), fqn)
            tape.register(b, fqn, BUFFER, owner=fqn)
        inputs = [x for x in tree_leaves((self.fargs, self.fkwargs)) if isinstance(x, torch.Tensor)]
        for i, t in enumerate(inputs):
            tape.register(t, f"input{i}", INPUT)
        given = [x for x in tree_leaves((self.args, self.kwargs), is_leaf=lambda x: isinstance(x, Spec))
                 if isinstance(x, (torch.Tensor, Spec))]
        for i, (x, t) in enumerate(zip(given, inputs)):
            if isinstance(x, torch.Tensor) and x.device.type != "meta":
                self.values.give_input(t, x, f"input{i}")
        if opts.checkpointing and not wrapped:  # after naming: the user's names stay
            from .checkpointing import apply_policies

            def name_wrapper(wrapper, module, fqn):  # the wrapper runs as the module it wraps
                self.names.setdefault(id(wrapper), fqn)

            apply_policies(self.fmodel, opts.checkpointing, on_wrap=name_wrapper)
        self.params = list(self.fmodel.parameters())
        self.param_count = sum(p.numel() for p in self.params)
        self.param_dtype = _main_dtype(self.params)
        # step 2 accumulates into an input's .grad if one gathers it: then it cannot be reused
        self.inputs_gather_grads = any(t.requires_grad and t.is_leaf for t in inputs)

    @contextmanager
    def _recording(self):
        rec = self.recorder
        with torch_globals_kept(), self.isolation.shadows(), \
                track_modules(rec.modules, self.names), \
                rec.saved.active(), rec.hooks.recording(), track_rng_states(rec.tape), \
                _quiet_fake_tensor_log(), library_branches(rec.tape), \
                sdpa_composite_of_the_gpu(rec.fidelity), \
                autocast_casts_cleared_with_torchs(rec.fidelity), rec.function_rules, \
                self._compiling():
            yield

    # ---- a compiled step (options.compile) ---------------------------------------------------

    def _compile_model(self) -> None:
        """The model as torch.compile runs it, compiled by tapescope's backend (compiled.py)."""
        from .compiled import CompileRecord, compile_model

        opts = self.options
        self.compile_record = record = CompileRecord(opts.compile)
        # the graphs' inputs by the names the user's model gives them (before a plan's wrappers)
        fqns = {**self.buffer_fqn, **self.param_fqn}
        # modules the user's code compiled itself (`block.compile()` in a parallelize function,
        # as torchtitan's apply_compile does) are the regions tapescope compiles, with its backend
        blocks = compiled_modules(self.fmodel)
        if not blocks and not self.program.reusable:
            # a user's step gets the model itself (its .parameters(), its submodules), so the
            # regions compiled are the ones its code compiled, as they would be for real
            raise TapescopeError(
                "with step=, compile= compiles the modules your model's code compiled itself "
                "(`block.compile()`, as torchtune's compile_model does), and this model compiled "
                "none: call .compile() on its blocks in the build function, or drop compile=")
        if blocks or opts.mesh is not None:
            # a parallelised model is compiled per transformer block (torchtitan's apply_compile),
            # each block with its FSDP2/TP wrapping as parallelize left it
            from .compiled import compile_blocks
            from .model import transformer_blocks

            blocks = blocks or transformer_blocks(self.fmodel)
            if not blocks:
                raise TapescopeError(
                    "a distributed compiled profile compiles each transformer block (torchtitan's "
                    "apply_compile), and this model has no repeated blocks (an nn.ModuleList of "
                    "one class); profile it with compile= alone, or without the mesh")
            compile_blocks(blocks, opts.compile, record, self.tape.compiled_call, fqns)
            return
        self.step_model = compile_model(self.fmodel, opts.compile, record, self.tape.compiled_call,
                                        fqns)

    def _compiled_nothing(self) -> None:
        """compile= was asked and dynamo handed the backend no graph (frames skipped, or code it
        is told not to trace): the step profiled is the eager one. Said, never silent."""
        self.isolation.notes.append(
            "compile: dynamo produced no graph for this step (no frame it traced held an op it "
            "compiles), so every op ran eagerly and this profile is the eager step's; "
            "TORCH_LOGS=graph_breaks,dynamo on your own torch.compile run shows why")

    def _run_compiled_modules_eagerly(self) -> None:
        """An eager profile of a model whose code compiled some modules (`block.compile()`):
        those run eagerly in the private copy (a real compile would run inductor's kernels,
        which fake tensors cannot feed), and the profile says so."""
        modules = compiled_modules(self.fmodel)
        for m in modules:
            m._compiled_call_impl = None
        names = [self.names.get(id(m), type(m).__name__) or "(root)" for m in modules]
        self.isolation.notes.append(
            f"modules compiled with Module.compile() ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}) ran eagerly in this profile; pass --compile "
            "(compile=True) to profile them compiled, with tapescope's backend")

    def _capability_answered(self):
        """The user's parallelize asks the GPU what it can do (a float8 converter: sm89+?) as it
        would on the profiled GPU (gpu_less.capability_answered)."""
        opts = self.options
        if opts.device.type != "cuda" or opts.gpu is None:
            return nullcontext()
        from .gpu_less import capability_answered

        return capability_answered(opts.gpu)

    def _gpu_answered(self):
        """Inductor's CUDA path, GPU-less: the device queries answered for the named GPU
        (gpu_less.py) while inductor compiles."""
        opts = self.options
        if opts.device.type != "cuda" or opts.compile.backend != "inductor":
            return nullcontext()
        from .gpu_less import cuda_answered

        return cuda_answered(opts.gpu)

    def _compiling(self):
        if self.options.compile is None:
            return self._user_compiles_run_eagerly()
        from contextlib import ExitStack

        from .compiled import compiling, user_compiles

        stack = ExitStack()
        stack.enter_context(compiling(self.options.compile, unrecorded=self._while_compiling))
        # a compiled loss (or any torch.compile of the user's outside the model): tapescope's
        # backend as well, its graphs regions of the step's record
        stack.enter_context(user_compiles(self.options.compile, self.compile_record,
                                          self.tape.compiled_call))
        return stack

    def _user_compiles_run_eagerly(self):
        """An eager profile: code the user compiled with torch.compile outside the model
        (torchtitan's `--compile.components loss` wraps its loss in torch.compile) gets a backend
        that runs dynamo's graph as captured, op by op, and counts it, so the profile can say so.
        Left to its own backend, inductor would run compiled CPU kernels on fake tensors' data
        (a segfault). torch's own switch (`set_stance(force_backend=)`), restored on exit.
        Only once dynamo is imported (torch.compile imports it): importing it costs seconds, and
        before it nothing can have been compiled."""
        if "torch._dynamo" not in sys.modules:
            return nullcontext()

        def run_as_captured(gm, example_inputs):
            self.user_compiled_graphs += 1
            return gm.forward

        return torch.compiler.set_stance("default", force_backend=run_as_captured)

    @contextmanager
    def _while_compiling(self):
        """While torch.compile compiles (a first call, the lazy backward, a recompile): nothing
        is recorded, and autograd's saved-tensor hooks are the user's (none), as AOTAutograd
        would otherwise trace ours into its graphs."""
        from ..torch_compat import saved_tensor_hooks_suspended

        with self.tape.unrecorded(), saved_tensor_hooks_suspended(), self._joint_trace_engine(), \
                self._gpu_answered():
            yield

    @contextmanager
    def _joint_trace_engine(self):
        """AOTAutograd traces the joint graph by calling torch.autograd.grad, whose C++ engine
        stops on fake CUDA tensors without a GPU ("hasPrimaryContext expects a valid device
        index"): for a CUDA compile it runs on tapescope's engine, as the step's backward does."""
        if self.options.device.type != "cuda":
            yield
            return
        original = torch.autograd.grad
        engine = self.engine

        def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                 only_inputs=True, allow_unused=None, is_grads_batched=False,
                 materialize_grads=False):
            if create_graph or is_grads_batched or materialize_grads:
                return original(outputs, inputs, grad_outputs, retain_graph, create_graph,
                                only_inputs, allow_unused, is_grads_batched, materialize_grads)
            return engine.grad(outputs, inputs, grad_outputs, bool(allow_unused))

        with patched(torch.autograd, grad=grad):
            yield

    def _trace_steps(self) -> None:
        trace, opt = self.trace, self.optimizer
        before = _tensors_fingerprint(self.fmodel)
        self._step(1, end=False)  # ended below, once step 2's tracing is decided
        if self.options.steps == 1 or opt is None:
            self._end_step(1)
            return
        # step 2 repeats step 1's forward and backward when the model kept its tensors, no input
        # gathers a .grad and the optimizer step freed only what it made. (After FSDP2's prepare
        # too: its first forward initialises lazily, bookkeeping that allocates as later forwards
        # do; tests/test_distributed.py checks steady peaks against real runs.)
        if (_tensors_fingerprint(self.fmodel) == before
                and not self.inputs_gather_grads
                and not self.values.counts_left()  # sizes given for step 2's own calls
                and _self_contained(trace, trace.segments[-1])):
            with self._phase(2, OPTIMIZER):
                opt.step()
            self._mark_grads_and_state()
            # step 1's loss, alive since its forward, is step 2's: it dies in step 2's reset,
            # the segment that also ends step 1's view (analysis/steps.py)
            self._end_step(2)
            trace.step2 = "reused"
        else:
            self._end_step(1)
            self._step(2)
            trace.step2 = "traced"

    def _step(self, step: int, end: bool = True) -> None:
        opts = self.options
        forward_context = (lambda: autocast(opts.device, opts.amp)) if opts.amp is not None \
            else nullcontext
        runtime = StepRuntime(phase=self._phase, backward=self._run_backward,
                              forward_context=forward_context,
                              loss_context=lambda: self.recorder.modules.entered(LOSS_MODULE),
                              on_default_loss=self._default_loss_used)
        train_context = getattr(opts.parallelize, "train_context", None)  # presets.py (CP)
        if train_context is not None:
            runtime.train_context = train_context
        if self._may_stop_repeating():
            ends: list = []  # (ops, events, Python state) when each micro-batch ended
            runtime.micro_batch_done = lambda i, n: self._micro_batch_repeats(ends, i, n)
        self._loss = self.program.run(self.step_model, self.fargs, self.fkwargs, self.optimizer,
                                      step, runtime, end=end)
        self._mark_grads_and_state()

    def _default_loss_used(self, what: str) -> None:
        self.loss_described = what

    # ---- gradient accumulation: micro-batches that repeat ----------------------------------

    def _may_stop_repeating(self) -> bool:
        """Micro-batches are traced until one repeats the one before it; then the rest are
        counted, not traced (`--accumulate 10000` traced 10,000 identical micro-batches). On a
        mesh too: each rank's micro-batch repeats its all-gathers and reduce-scatters, counted
        with it (analysis/timing.py prices a repeated collective once per run). Not for a
        symbolic or compiled step, whose analyses read every op of the trace."""
        opts = self.options
        return opts.accumulate > 2 and not opts.symbolic and opts.compile is None

    def _micro_batch_repeats(self, ends: list, i: int, n: int) -> bool:
        """After micro-batch i of n: True when it repeated micro-batch i-1 (the first allocates
        the gradients, so from the third on), which proves that the next ones repeat it too:
        the same ops on the same shapes, from a state with the same live storages (each micro-batch
        frees as much as it allocates, in the same pattern), reading no tensor's value and leaving
        the modules' plain Python values as they were (what a later call could branch on). Its
        ops then stand for n-i+1 micro-batches (`Trace.repeated`)."""
        trace = self.trace
        ends.append((len(trace.ops), len(trace.events), _python_state(self.fmodel)))
        if i < 3:
            return False
        (o0, e0, _), (o1, e1, before), (o2, e2, after) = ends[-3:]
        if before != after:  # a Python counter on a module moved: later calls may branch on it
            return False
        if not _same_micro_batch(trace, (o0, o1, e0, e1), (o1, o2, e1, e2)):
            return False
        trace.repeated.append((o1, o2, n - i + 1))
        self.accumulate_traced = i
        return True

    # ---- a user's own step (options.step) --------------------------------------------------

    def _trace_user_steps(self) -> None:
        """The user's step, as written, traced in full for each step (what it does between
        forward, backward and optimizer is its own: nothing of step 1 is assumed for step 2).
        Its setup, if any, is recorded as step 0: what it makes is alive when step 1 starts."""
        if getattr(self.options.parallelize, "train_context", None) is not None:
            raise TapescopeError(
                "the --cp preset opens torch's context_parallel around the built-in step's "
                "forward and backward; a step of your own opens it itself: wrap your forward and "
                "backward in torch.distributed.tensor.experimental.context_parallel(mesh['cp'], "
                "buffers=[...], buffer_seq_dims=[...]) and pass --parallelize with --mesh")
        program = self.program
        if program.records_setup:
            with self.tape.phase(0, SETUP):
                self.state = program.setup(self.fmodel, self.params, self.options.device)
            self.optimizers += optimizers_in(self.state)
            self.state_tensors = state_tensors(self.state)
        else:
            self.state = self.optimizer
        self._mark_grads_and_state()
        opts = self.options
        # (amp: a user's step opens its own autocast, so only a pipelined step has one here)
        forward_context = (lambda: autocast(opts.device, opts.amp)) if opts.amp is not None \
            else nullcontext
        runtime = StepRuntime(phase=self._user_phase, backward=self._run_backward,
                              grad=self._run_grad, on_optimizer=self._saw_optimizer,
                              forward_context=forward_context,
                              first_step_only=self._first_step_only)
        with steps_of(program, runtime):
            if self.options.steps == 2 and program.step2_from_step1 \
                    and self.step2_not_reused is None:
                self._steps_sharing_step1(runtime)
                return
            for step in range(1, self.options.steps + 1):
                program.run(self.step_model, self.fargs, self.fkwargs, self.state, step, runtime)
                self._mark_grads_and_state()
        self.trace.step2 = "traced" if self.options.steps == 2 else None

    def _steps_sharing_step1(self, runtime: StepRuntime) -> None:
        """Steps 1 and 2 of a program whose step 2 may be step 1 less its first-step work
        (capture/first_step.py has the proof and its conditions): step 1 without its gradient
        reset, then, where the conditions hold, step 2's optimizer step and the reset that ends
        both steps (as `_trace_steps` does for the built-in step); else step 1 is ended and
        step 2 traced in full. `Trace.step2` says which."""
        program, trace, model = self.program, self.trace, self.step_model
        before = (_tensors_fingerprint(self.fmodel), _python_state(self.fmodel))
        first = len(trace.segments)
        program.run(model, self.fargs, self.fkwargs, self.state, 1, runtime, end=False)
        self._mark_grads_and_state()
        gradients = {self.tape.storage_id(p.grad) for p in self.params if p.grad is not None}
        why, left = why_not_repeated(trace, first, gradients)
        if why is None:
            why = self._why_step2_runs_other_code(before)
        if why is not None:
            self.step2_not_reused = why
            program.end_step(self.state, 1, runtime)
            program.run(model, self.fargs, self.fkwargs, self.state, 2, runtime)
            self._mark_grads_and_state()
            trace.step2 = "traced"
            return
        step2 = len(trace.segments)
        program.optimizer_step(model, self.state, 2, runtime)
        self._mark_grads_and_state()
        program.end_step(self.state, 2, runtime)
        why = why_reset_differs(trace, step2, left)
        if why is not None:
            raise StepNotRepeated(why)
        trace.step2 = "reused"

    def _why_step2_runs_other_code(self, before: tuple) -> str | None:
        """Conditions 1 and 2 of capture/first_step.py, besides the value reads."""
        if not self.program.first_step_done(self.state):
            return "the program's first-step work would run again"
        if self.first_step_nested:
            return "a phase opened inside the first step's own work"
        if _tensors_fingerprint(self.fmodel) != before[0]:
            return "step 1 changed the tensors the model holds"
        if _python_state(self.fmodel) != before[1]:
            return "step 1 changed a plain Python value the model holds"
        if self.inputs_gather_grads:
            return "an input gathers a .grad"
        if self.values.counts_left():
            return "data-dependent sizes were given for step 2's own calls"
        return None

    @contextmanager
    def _first_step_only(self, step: int):
        """What the program runs in its first step alone, one FIRST_STEP_ONLY segment
        (`StepRuntime.first_step_only`)."""
        first = len(self.trace.segments)
        with self.tape.phase(step, OTHER, FIRST_STEP_ONLY):
            yield
        self.first_step_nested |= nested_first_step(self.trace, first)

    @contextmanager
    def _user_phase(self, step: int, name: str):
        with self.tape.phase(step, name):
            yield
        if name == BACKWARD:
            self._mark_grads_and_state()
        if self.progress is not None:
            self.progress(step, name)

    def _saw_optimizer(self, optimizer) -> None:
        """An optimizer's step begins or ends: its gradients and state are named (an optimizer
        in the backward frees each gradient right after its step)."""
        if not any(o is optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        self._mark_optimizer(optimizer)

    def _run_grad(self, outputs, inputs, grad_outputs=None, retain_graph=None,
                  allow_unused=False):
        if self.options.engine != "python":
            return _TORCH_GRAD(outputs, inputs, grad_outputs, retain_graph,
                               allow_unused=allow_unused)
        return self.engine.grad(outputs, inputs, grad_outputs, allow_unused,
                                keep_graph=bool(retain_graph))

    def _end_step(self, step: int) -> None:
        """What train_step(end=False) left to the caller: zero_grad, then the loss dies, inside
        the step's reset segment as in train_step (capture/step.py)."""
        with self._phase(step, ZERO_GRAD):
            zero_grad(self.step_model, self.optimizer)
            self._loss = None

    def _run_backward(self, tensors, grad_tensors=None, retain_graph=None) -> None:
        """torch.autograd.backward(tensors, grad_tensors, retain_graph) of the step."""
        for t in (tensors,) if isinstance(tensors, torch.Tensor) else tensors:
            _name_forward_nodes(t, self.trace, self.tape.user_frame())
        if self.options.engine == "python":
            self.engine.run_backward(tensors, grad_tensors, retain_graph)
        else:
            _TORCH_BACKWARD(tensors, grad_tensors, retain_graph)

    @contextmanager
    def _phase(self, step: int, name: str):
        # the gradient reset is a segment of the optimizer phase, told apart by its label
        phase, label = (OPTIMIZER, ZERO_GRAD) if name == ZERO_GRAD else (name, None)
        with self.tape.phase(step, phase, label), self._function_rules_in(phase):
            yield
        if name == BACKWARD:
            self._mark_grads_and_state()
        if self.progress is not None:
            self.progress(step, name)

    def _function_rules_in(self, phase: str):
        """The FunctionRulesMode off while torch's own optimizer steps or resets (a builtin
        step's OPTIMIZER phase runs nothing else), where no FUNCTION rule acts
        (optimizers.steps_outside_function_rules)."""
        if (phase == OPTIMIZER and self.optimizer is not None
                and steps_outside_function_rules(self.optimizer)):
            return function_mode_lifted(self.recorder.function_rules)
        return nullcontext()

    @without_torch_function  # tapescope's bookkeeping, not the user's calls
    def _mark_grads_and_state(self) -> None:
        """Name the storages of gradients and optimizer state after the parameter they serve."""
        fqn = self.param_fqn
        for p in self.params:
            if p.grad is not None:
                self.tape.mark_role(p.grad, GRADIENT, fqn.get(id(p), "?"))
        for optimizer in self.optimizers:
            self._mark_optimizer(optimizer)
        for t in self.state_tensors:  # a user step's own state (an EMA's weights)
            if not any(t is p for p in self.params):
                self.tape.mark_role(t, OPTIMIZER_STATE)

    @without_torch_function
    def _mark_optimizer(self, optimizer) -> None:
        fqn = self.param_fqn
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.tape.mark_role(p.grad, GRADIENT, fqn.get(id(p), "?"))
        for p, state in optimizer.state.items():
            for t in _state_leaves(state):
                if isinstance(t, torch.Tensor):
                    self.tape.mark_role(t, OPTIMIZER_STATE, fqn.get(id(p), "?"))

    def _record_shape_facts(self) -> None:
        """The ShapeEnv's guards, replacements and ranges, as plain data on the trace."""
        trace = self.trace
        guards, replacements, ranges = shape_env_facts(self.shape_env, trace.symbols)
        trace.guards = [GuardRecord(expr, where or str(sloc).strip("() "),
                                    where == INTERNAL_GUARD) for expr, where, sloc in guards]
        trace.replacements = replacements
        trace.ranges = ranges


# ---- helpers ----------------------------------------------------------------------------------

def compiled_modules(model: nn.Module) -> list:
    """The modules `Module.compile()` was called on (their calls go through
    `_compiled_call_impl`)."""
    return [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]


@without_torch_function  # tapescope's bookkeeping, not the user's calls
def _tensors_fingerprint(model: nn.Module) -> tuple:
    """Which tensors the model holds and where they live; equal before and after a step unless the
    step replaced or added tensors."""
    from ..torch_compat import storage_key

    out = []
    for mod in model.modules():
        for k, v in mod.__dict__.items():
            if isinstance(v, torch.Tensor):
                out.append((id(mod), k, id(v), storage_key(v)))
        for d in (mod._parameters, mod._buffers):
            for k, v in d.items():
                out.append((id(mod), k, id(v), None if v is None else storage_key(v)))
                out += [(id(mod), k, name, id(x)) for name, x in _held_tensors(v)]
    return tuple(out)


def _held_tensors(t) -> list:
    """The tensors a parameter of a wrapper subclass holds besides its data (through DTensor's
    local shard): torchao's float8 weight gets a `_precomputed_scale` after the optimizer step
    (precompute_float8_dynamic_scale_for_fsdp), and the next forward's all-gather then skips its
    amax all-reduce, so step 2 is not step 1's forward again."""
    inner = getattr(t, "_local_tensor", t)
    if inner is None or isinstance(inner, FakeTensor) or \
            not hasattr(type(inner), "__tensor_flatten__"):
        return []
    return [(k, x) for k, x in vars(inner).items() if isinstance(x, torch.Tensor)]


def _symbols(shape_env, names, inputs) -> tuple[dict, dict]:
    """One SymInt per named dimension, its hint the size the inputs give it (at least 2: the
    shape environment specialises sizes 0 and 1)."""
    found: dict[str, int] = {}
    for x in tree_leaves(inputs, is_leaf=lambda x: isinstance(x, Spec)):
        if isinstance(x, Spec):
            for size, name in zip(x.shape, x.dim_names()):
                if name in names:
                    found.setdefault(name, size)
    missing = [n for n in names if n not in found]
    if missing:
        raise TapescopeError(
            f"no input has a dimension named {', '.join(missing)}: name dimensions with "
            "tapescope.spec(shape, dims=('batch', 'seq', ...)) (zoo models name theirs)")
    sizes, hints = {}, {}
    for name, size in found.items():
        hint = max(size, 2)
        source = constant_source(name)
        sym = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
        sizes[name] = shape_env.create_symintnode(sym, hint=hint, source=source)
        hints[name] = hint
    return sizes, hints


def _guards_name_user_lines(shape_env, tape: Tape) -> None:
    """Make every guard remember the model's source line that asked for it (ShapeEnv finds user
    frames only under dynamo); a guard tapescope's own bookkeeping asked for is marked internal."""
    dirs = source_dirs()
    torch_dir = dirs.torch
    ours = dirs.in_package("capture/", "analysis/", "devices/")
    # frames that only pass an op through to the dispatcher: the guard belongs to their caller
    dispatch = dirs.in_package("capture/tape.py", "capture/replay.py", "capture/fidelity/")

    def locate(sloc):
        f = sys._getframe(2)
        while f is not None and (f.f_code.co_filename.startswith(torch_dir)
                                 or f.f_code.co_filename.startswith(dispatch)):
            f = f.f_back
        if f is not None and f.f_code.co_filename.startswith(ours):
            return user_source_location(sloc.framework_loc, INTERNAL_GUARD)
        frame = tape.user_frame()
        return user_source_location(sloc.framework_loc,
                                    str(frame) if frame is not None else sloc.maybe_user_loc)

    hook_guard_locations(shape_env, locate)


def _as_specs(inputs):
    """Tensors become Specs (dim 0 named "batch") so that a symbolic trace can size them."""

    def convert(x):
        if isinstance(x, torch.Tensor):
            return Spec(tuple(x.shape), x.dtype, None, x.requires_grad)
        return x

    return tree_map(convert, inputs, is_leaf=lambda x: isinstance(x, Spec))


_READS_A_VALUE = torch.ops.aten._local_scalar_dense.default  # .item(), bool(t), int(t)
_PLAIN = (bool, int, float, str, type(None))


def _python_state(model: nn.Module) -> tuple:
    """The plain Python values (numbers, strings, flags) the model's modules hold: a counter a
    forward increments changes it."""
    return tuple((name, k, v) for name, m in model.named_modules()
                 for k, v in vars(m).items() if isinstance(v, _PLAIN))


def _same_micro_batch(trace: Trace, a: tuple, b: tuple) -> bool:
    """Two consecutive micro-batches, each (first op, end op, first event, end event), ran the
    same ops on the same shapes and allocated and freed the same sizes in the same places, what
    they freed of the state before them included, freeing as many bytes as they allocated."""
    ao, ao_end, ae, ae_end = a
    bo, bo_end, be, be_end = b
    if ao_end - ao != bo_end - bo or ae_end - ae != be_end - be:
        return False
    ops = trace.ops
    for x, y in zip(ops[ao:ao_end], ops[bo:bo_end]):
        if x.func is _READS_A_VALUE:
            return False  # the step decides on a value (a counter, a draw): it may change later
        if x.func != y.func or [t.shape for t in x.tensor_outputs()] != \
                [t.shape for t in y.tensor_outputs()] or \
                [t.shape for t in x.tensor_inputs()] != [t.shape for t in y.tensor_inputs()]:
            return False
    storages, events = trace.storages, trace.events
    net = 0
    for (xo, xs, xd), (yo, ys, yd) in zip(events[ae:ae_end], events[be:be_end]):
        sx, sy = storages[xs], storages[ys]
        x_own = sx.created_by is not None and sx.created_by >= ao
        y_own = sy.created_by is not None and sy.created_by >= bo
        if xo - ao != yo - bo or xd != yd or sx.nbytes != sy.nbytes or x_own != y_own \
                or sx.device != sy.device:
            return False
        net += xd * sy.nbytes
    return net == 0


_PLAIN_LEAVES = (int, float, bool, str, type(None))


def _state_leaves(state) -> list:
    """tree_leaves(state), in its order: a parameter's optimizer state is most often a flat dict
    of tensors and numbers (Adam's step, exp_avg, exp_avg_sq), whose leaves are its values in
    insertion order, without pytree's walk (~1.4 us; each state each time it is marked: ~300 a
    GPT-2 profile)."""
    if type(state) is not dict:
        return tree_leaves(state)
    values = list(state.values())
    for v in values:
        if not (type(v) in _PLAIN_LEAVES
                or (isinstance(v, torch.Tensor) and type(v) not in pytree_node_types)):
            return tree_leaves(state)  # a container (or a tensor type pytree flattens)
    return values


@contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback when a meta kernel rejects its inputs (a shape mismatch in
    the user's model). We turn that error into a message; the log would only repeat it."""
    logs = [logging.getLogger(name) for name in (
        FakeTensorMode.__module__,  # fake_tensor.py's logger is its module's
        # a guard evaluated with an assumed value logs each one (data_values.py): the report
        # names the assumptions instead
        "torch.fx.experimental.symbolic_shapes")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _self_contained(trace: Trace, seg) -> bool:
    """True if a segment frees only storages it allocated itself (its temporaries)."""
    ops = seg.ops
    for i in seg.events:
        op, sid, delta = trace.events[i]
        if delta < 0:
            made = trace.storages[sid].created_by
            if made is None or made not in ops:
                return False
    return True


def _main_dtype(params: list) -> str | None:
    """The parameters' floating-point dtype with the most elements (the report's header)."""
    by_dtype: dict = {}
    for p in params:
        if p.is_floating_point():
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return str(max(by_dtype, key=by_dtype.get)).replace("torch.", "") if by_dtype else None


def _describe_optimizer(opt: torch.optim.Optimizer) -> dict:
    from .optimizers import default_foreach

    d = opt.defaults
    foreach = d.get("foreach")
    if foreach is None and not d.get("fused"):  # torch's choice at step time, for plain tensors
        p = next((p for g in opt.param_groups for p in g["params"]), None)
        foreach = p is not None and not d.get("differentiable") and default_foreach(p.device)
    impl = "fused" if d.get("fused") else "foreach" if foreach else "for-loop"
    return {"name": type(opt).__name__, "implementation": impl}


def _name_forward_nodes(loss: torch.Tensor, trace: Trace, where=None) -> None:
    """Map seq_nr -> autograd node name for every node reachable from the loss; `where`: the
    user's line that asked for the backward."""
    from ..torch_compat import node_sequence_nr

    fn = loss.grad_fn
    if fn is None:
        raise TapescopeError(
            "the loss does not require grad (PyTorch: element 0 of tensors does not require grad "
            "and does not have a grad_fn): no parameter of the model took part in computing it "
            "(are all parameters frozen, or is the forward under no_grad?)"
            + ("" if where is None else f"; backward called at {where}"))
    seen, stack, names = set(), [fn], trace.node_names
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.setdefault(node_sequence_nr(node), node.name())
        stack.extend(n for n, _ in node.next_functions)
