"""`tapescope.profile`: capture a training step on fake tensors, then analyse it.

The pipeline: `Options.create` checks and resolves what the user asked for -> `capture` runs the
steps on fake tensors and returns a Trace (plain records) -> `analyse` turns the trace into the
op table and the memory report -> a `Profile` holds them, and computes the rest (the FX graph, the
GPU's allocator and step time, the module roll-ups) from the same records when first asked.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from .analysis.memory import MemoryReport, memory_report, peak_bytes, storage_categories
from .analysis.modules import ancestors, module_rollup
from .analysis.ops import OpCosts, step_ops
from .analysis.steps import step_views
from .capture.records import BACKWARD, FORWARD, OPTIMIZER, RunFacts, Trace
from .capture.session import capture
from .errors import TapescopeError
from .option_table import OPTIONS, profile_options_doc
from .options import CompileOptions, Options, Workload
from .torch_compat import tree_map

if TYPE_CHECKING:  # the option values' types, for the signature
    from .devices.calibration import Calibration
    from .devices.gpus import GPU
    from .values.allocator import AllocatorConfig
    from .values.mesh import MeshSpec
    from .values.pipeline import PipelineSpec
    from .values.sizes import Sizes

__all__ = ["profile", "profile_workload", "Profile"]


@dataclass(frozen=True, eq=False)
class Profile:
    """What one training step does, op by op, with its FLOPs and memory.

    The op table, FLOPs and `memory` describe the steady-state step (step 2, optimizer state
    present) when `steps=2`, else the first step. `first_step_peak_bytes` is the first step's peak.

    Built once, by `analyse`, and frozen: the analyses the report needs later are computed from
    these fields when first asked (the cached properties below).
    """

    model: str
    device: str
    dtype: str | None
    inputs: list
    steps: int
    ops: list                    # Op
    memory: MemoryReport
    first_step_peak_bytes: int
    run: RunFacts                # what the capture learned besides the trace (`facts`: as a dict)
    trace: Trace | None = field(default=None, repr=False)
    symbolic: object = field(default=None, repr=False)  # analysis.symbolic.SymbolicProfile
    # analysis.data_sizes.DataSizeReport: the assumptions data-dependent sizes were given, the
    # peak as their formula; None when no size depended on tensor values
    data_sizes: object = field(default=None, repr=False)
    options: Options | None = field(default=None, repr=False)
    # a compiled step (profile(..., compile=...)): what torch.compile did, and the eager step
    compiled: object = field(default=None, repr=False)  # analysis.compiled.CompiledReport
    eager: "Profile | None" = field(default=None, repr=False)
    # a distributed profile (mesh=...): every rank's memory (distributed.profile.RankProfile) and
    # the mesh, rank classes and process groups (DistributedFacts); the rest of this Profile is
    # the trace of the rank with the highest peak
    ranks: list | None = None
    distributed: object = field(default=None, repr=False)
    # what analyse computed on the way that the lazy analyses reuse (the first step's memory)
    op_costs: OpCosts | None = field(default=None, repr=False)
    storage_categories: dict | None = field(default=None, repr=False)
    # a symbolic profile: traces the step again at sizes {dimension: size} (at(), outside the
    # formulas' range) and returns that Profile
    retrace: Callable | None = field(default=None, repr=False)

    @property
    def peak_bytes(self):
        return self.memory.peak_bytes

    @cached_property
    def facts(self) -> Mapping:
        """What the run taught besides the op table, as a read-only dict by name (the JSON's
        "facts"): `run`'s fields (RunFacts.as_dict), "step2" (how the steady step was obtained:
        "reused", "traced"), "data_sizes" (analysis.data_sizes' report), "compile" (the compile
        options of a compiled step) and a distributed rank's place in its job
        (DistributedFacts.as_facts). Kept for the documented keys; code reads the typed fields."""
        out = self.run.as_dict()
        out["step2"] = self.trace.step2
        if self.data_sizes is not None:
            out["data_sizes"] = self.data_sizes.to_dict()
        if self.compiled is not None:
            out["compile"] = self.options.compile.to_dict()
        if self.distributed is not None:
            out.update(self.distributed.as_facts())
        return MappingProxyType(out)

    @cached_property
    def first_step_memory(self) -> MemoryReport:
        """The first step's memory report (its op indices refer to the first step's ops)."""
        if self.steps == 1:
            return self.memory
        view = step_views(self.trace)[1]
        ops = step_ops(self.trace, view, self.op_costs)
        return memory_report(self.trace, view, ops, self.storage_categories)

    @cached_property
    def flops(self) -> dict:
        """FLOPs by phase and in total (a multiply-add is 2). Uncounted ops add nothing here.
        A compiled step counts its compiled graphs' FLOPs, recomputation included."""
        if self.compiled is not None:
            return dict(self.compiled.flops)
        out = dict.fromkeys((FORWARD, BACKWARD, OPTIMIZER), 0)
        for op in self.ops:  # a user's step also has OTHER: its own code's ops
            if op.flops:
                out[op.phase] = out.get(op.phase, 0) + op.total_flops
        out["total"] = sum(out.values())
        return out

    @cached_property
    def recompute_flops(self) -> int:
        """FLOPs of the forward ops activation checkpointing runs again during backward (they
        are part of flops["backward"], when they run)."""
        return sum(op.total_flops or 0 for op in self.ops if op.recompute)

    @cached_property
    def uncounted_ops(self) -> dict:
        """Ops with no FLOP formula -> how many times they ran (their FLOPs are not in `flops`)."""
        counts: Counter = Counter()
        for op in self.ops:
            if op.flops is None:
                counts[op.name] += op.runs
        return dict(counts)

    @cached_property
    def module_own_flops(self) -> dict:
        """Module fqn -> FLOPs of its own ops (not its submodules'); a compiled step's from its
        graphs' nodes (analysis/compiled.py)."""
        if self.compiled is not None:
            return dict(self.compiled.module_flops)
        return module_rollup(self.ops, lambda op: op.total_flops, own=True)

    @cached_property
    def module_flops(self) -> dict:
        """Module fqn -> FLOPs of its ops and its submodules' ops (forward and backward)."""
        out: dict = {}
        for fqn, f in self.module_own_flops.items():
            for m in ancestors(fqn):
                out[m] = out.get(m, 0) + f
        return out

    @cached_property
    def gpu(self):
        """The GPU whose kernels the trace follows (device="cuda"), a devices.gpus.GPU."""
        from .devices.gpus import get_gpu

        if self.options is not None and self.options.gpu is not None:
            return self.options.gpu
        return get_gpu(self.run.gpu) if self.run.gpu else None

    @cached_property
    def cuda_memory(self):
        """What torch.cuda would report: the caching allocator replayed over the steps (cuda),
        with the allocator settings of the options (PYTORCH_ALLOC_CONF by default)."""
        from .analysis.gpu_memory import predict_cuda_memory

        if self.gpu is None or self.trace.device.type != "cuda":
            return None
        config = self.options.alloc_conf if self.options is not None else None
        return predict_cuda_memory(self.trace, self.gpu, config)

    @cached_property
    def time(self):
        """Estimated wall time of the step on the GPU (analysis.timing), None off CUDA. An
        inductor-compiled step is timed by the kernels its generated wrappers launched
        (analysis.compiled_time) with the eager ops around its compiled regions."""
        from .analysis.timing import estimate_step_time

        if self.gpu is None or self.trace.device.type != "cuda":
            return None
        from .analysis.time_band import profile_band

        comm = {c.op: c.seconds for c in self.collectives} if self.collectives else None
        streams = {c.op: c.stream for c in self.collectives} if self.collectives else None
        calibration = self.options.calibration if self.options is not None else None
        t = estimate_step_time(self.ops, self.trace, self.gpu, comm, streams, calibration,
                               self.compiled_schedule, self.kernels)
        # the error measured on published runs of its kind (none for times a file calibrated)
        t.band = profile_band(self, calibrated=calibration is not None, step_time=t)
        return t

    @cached_property
    def kernels(self) -> tuple:
        """Per op of `ops`, the Kernel it launches on the GPU (analysis.kernel_cost), None where
        it launches none: found once for the time model and whatever else prices the kernels."""
        from .analysis.kernel_cost import step_kernels

        return step_kernels(self.ops, self.trace.storages)

    @cached_property
    def kernel_prices(self) -> tuple:
        """Per op of `ops`, the seconds its kernel takes alone on the GPU (the kernel model,
        uncalibrated; one run), 0.0 where it launches none (the layout search's bounds)."""
        from .analysis.kernel_cost import kernel_time

        return tuple(0.0 if k is None else kernel_time(k, self.gpu)[0] for k in self.kernels)

    @cached_property
    def compiled_schedule(self):
        """What an inductor-compiled step's wrappers launched, priced for the schedule
        (analysis.compiled_time.CompiledSchedule); None for an eager or aot_eager step."""
        from .analysis.compiled_time import compiled_schedule

        if self.compiled is None or self.compiled.options.get("backend") != "inductor":
            return None
        return compiled_schedule(self.trace, self.ops, self.compiled.options)

    @cached_property
    def collectives(self) -> list:
        """The step's collectives (analysis.collectives.Collective), with their time on the GPU's
        interconnect; empty for a single-device profile."""
        from .analysis.collectives import collectives

        if self.distributed is None:
            return []
        calibration = self.options.calibration if self.options is not None else None
        return collectives(self.ops, self.distributed.groups, self.distributed.collective_groups,
                           self.gpu, calibration=calibration)

    @cached_property
    def collective_table(self) -> list:
        """The collectives grouped by kind, mesh dimension and size (CollectiveRow)."""
        from .analysis.collectives import collective_table

        return collective_table(self.collectives, self.gpu)

    @cached_property
    def graph(self) -> torch.fx.GraphModule:
        """The step as one FX graph: forward, backward and optimizer nodes in execution order."""
        from .analysis.graph import build_graph

        return build_graph(self.ops, self.trace)

    def at(self, **sizes):
        """Peak memory, first-step peak, FLOPs and the categories at the peak for other sizes of
        the named dimensions (a symbolic profile: `profile(..., symbolic=("batch", "seq"))`).

        Exact: the formulas are the trace's own arithmetic. Outside the range where the trace's
        guards hold (or for a dimension a guard pinned) the step is traced again at those sizes.
        """
        from .analysis.symbolic import Estimate

        sp = self.symbolic
        if sp is None:
            raise TapescopeError("at() needs a symbolic profile: profile(..., symbolic=('batch',))")
        full = {**sp.hints, **sp.specialized, **sizes}
        if sp.valid(full):
            return sp.at(**full)
        if self.retrace is None:
            raise TapescopeError(f"sizes {sizes} are outside the range of the formulas {sp.ranges}")
        p = self.retrace(full)
        return Estimate(full, p.peak_bytes, p.first_step_peak_bytes, dict(p.flops),
                        dict(p.memory.at_peak), p.memory.peak_op)

    def summary(self) -> str:
        from .report.text import summary_text

        return summary_text(self)

    def ops_table(self) -> str:
        from .report.text import ops_table_text

        return ops_table_text(self)

    def to_dict(self, with_ops: bool = True, with_timeline: bool = True) -> dict:
        from .report.json import profile_dict

        return profile_dict(self, with_ops, with_timeline)


def profile(model, *inputs, loss_fn: Callable | str | None = None,
            optimizer: str | type | Callable | None = "adamw",
            device: str | torch.device | None = None, gpu: str | GPU | None = None,
            dtype: str | torch.dtype | None = None, amp: str | torch.dtype | None = None,
            steps: int = 2, accumulate: int = 1, engine: str = "python",
            symbolic: str | tuple = (), alloc_conf: str | AllocatorConfig | None = None,
            checkpointing: list | tuple = (),
            compile: bool | dict | CompileOptions | None = None, threads: int | None = None,
            cpu_isa: str | None = None, mesh: dict | MeshSpec | None = None,
            parallelize: Callable | None = None, sizes: Sizes | dict | None = None,
            step: Callable | str | None = None, setup: Callable | str | None = None,
            pipeline: str | dict | PipelineSpec | None = None,
            calibration: str | Calibration | None = None, float8: str | None = None,
            input_kwargs: dict | None = None,
            name: str | None = None, progress: Callable | None = None) -> Profile:
    """Trace a training step of `model` on fake tensors and analyse it.

    model: an nn.Module (any device, meta included; it is not modified) or a function that builds one
        (it is built on the meta device, so init code never allocates).
    inputs: tensors (real or meta) or `tapescope.spec(shape, dtype=...)`; `input_kwargs` for keyword
        inputs. A tensor given with values keeps them where the step reads them (a mask, a
        label, a target box: named in the report as an assumption "input").
    name: the model's name in the report (default: its class's or function's).
    progress: progress(step, phase) is called as each phase of each step is traced.
    """
    given = locals()  # every option's keyword, passed on as given (option_table.OPTIONS)
    options = Options.create(**{o.name: given[o.name] for o in OPTIONS})
    return profile_workload(Workload(model, tuple(inputs), dict(input_kwargs or {}), name),
                            options, progress)


if profile.__doc__:  # (none under python -OO) the options' paragraphs, from their declaration
    profile.__doc__ = profile.__doc__.rstrip() + "\n" + profile_options_doc() + "\n    "


def profile_workload(workload: Workload, options: Options, progress=None) -> Profile:
    """`profile` for an already resolved workload and options (what the CLI calls)."""
    if options.compile is not None:
        return _profile_compiled(workload, options, progress)
    if options.mesh is not None:
        return _profile_ranks(workload, options, progress)
    retrace = None
    if options.symbolic:
        from .capture.model import built_for

        # built once: at() traces it again outside the formulas' range
        workload = replace(workload, model=built_for(workload.model, options))

        def retrace(sizes):
            resized = replace(workload, args=_resize(workload.args, sizes),
                              kwargs=_resize(workload.kwargs, sizes))
            return profile_workload(resized, options.but(symbolic=()))

    trace, facts = capture(workload, options, progress)
    p = _analyse_captured(trace, facts, workload, options, retrace=retrace)
    if options.symbolic and p.symbolic.specialized:
        from .analysis.symbolic import fit_pinned

        fit_pinned(p.symbolic, retrace)
    return p


def _profile_compiled(workload: Workload, options: Options, progress=None) -> Profile:
    """The compiled step, with the eager step beside it (`p.eager`)."""
    from .capture.model import built_for

    workload = replace(workload, model=built_for(workload.model, options))  # built once for both
    eager = profile_workload(workload, options.but(compile=None), progress)
    if options.mesh is not None:  # every rank class compiled, each with its report
        return _profile_ranks(workload, options, progress, eager=eager)
    trace, facts = capture(workload, options, progress)
    with _gc_paused():
        return analyse(trace, facts, model=workload.display_name, options=options,
                       inputs=[_describe_input(x) for x in workload.args], eager=eager)


# Profile's cached analyses that a job's Profile (analyse(of=...)) shares with its reported rank's
_SAME_FOR_THE_JOB = ("flops", "recompute_flops", "uncounted_ops", "module_own_flops",
                     "module_flops", "first_step_memory", "gpu", "cuda_memory", "time",
                     "kernels", "kernel_prices", "compiled_schedule", "collectives",
                     "collective_table")


def analyse(trace: Trace, facts: RunFacts, *, model: str, options: Options, inputs,
            symbolic=None, data_sizes=None, retrace=None, distributed=None, ranks=None,
            eager: Profile | None = None, of: Profile | None = None) -> Profile:
    """The Profile of a captured step: the op table and memory report of the traced steps (pure
    functions of the trace), a compiled step's report, and what the caller computed around them
    (a symbolic profile's formulas, a distributed rank's place in its job, the eager step beside
    a compiled one). The one place a Profile is made.

    of: a Profile of the same trace already analysed (a distributed job's reported rank): its
    analyses are kept, with this job's `ranks` and `distributed` facts."""
    if of is not None:
        kept = {f.name: getattr(of, f.name) for f in fields(Profile)}
        out = Profile(**{**kept, "ranks": ranks, "distributed": distributed,
                         "eager": eager if eager is not None else of.eager})
        # what `of` already computed stays computed: these read its trace, options and place
        # in the job, none of what the job adds (its rank classes and traced profiles); the
        # time model run again on a 70B rank cost up to a second
        for name in _SAME_FOR_THE_JOB:
            if name in of.__dict__:
                out.__dict__[name] = of.__dict__[name]
        return out
    views = step_views(trace)
    categories = storage_categories(trace)
    costs = OpCosts(trace)
    main = views[max(views)]
    ops = step_ops(trace, main, costs)
    memory = memory_report(trace, main, ops, categories)
    first_peak = memory.peak_bytes if main.step == 1 else peak_bytes(trace, views[1])
    compiled = None
    if facts.compiled is not None:  # what compiling recorded, as its report
        from .analysis.compiled import compiled_report

        compiled = compiled_report(facts.compiled, trace, main, ops)
    dtype = options.dtype  # the cast asked for, else the parameters' own
    return Profile(model=model, device=str(options.device),
                   dtype=facts.param_dtype if dtype is None else str(dtype).replace("torch.", ""),
                   inputs=inputs, steps=main.step, ops=ops, memory=memory,
                   first_step_peak_bytes=first_peak, run=facts, trace=trace,
                   symbolic=symbolic, data_sizes=data_sizes, options=options,
                   compiled=compiled, eager=eager, ranks=ranks, distributed=distributed,
                   op_costs=costs, storage_categories=categories, retrace=retrace)


def _analyse_captured(trace: Trace, facts: RunFacts, workload: Workload, options: Options,
                      **around) -> Profile:
    """`analyse`, with the formulas of a trace that has symbols (named dimensions, or sizes the
    data decides) evaluated at their values. `around`: analyse's other arguments."""
    inputs = [_describe_input(x) for x in workload.args]
    sp = None
    with _gc_paused():  # analysis makes many small objects and no cycles: no collection needed
        from .analysis.data_sizes import data_size_report

        if trace.symbols:
            from .analysis.symbolic import NotPolynomial, converter, instantiate, \
                symbolic_profile

            try:
                sp, conv = symbolic_profile(trace)
            except NotPolynomial as e:
                if set(trace.symbols) - set(trace.unbacked.values()):
                    # a named input dimension: its formulas are what was asked for
                    raise TapescopeError(f"the memory is not a formula of the named dimensions: "
                                         f"{e}. Fix: profile at fixed sizes instead (without "
                                         f"--symbolic, or `profile` at each size)") from None
                # sizes the data decides, each with its one value: the step at those values
                # is exact without formulas (`keep[:100]` of a data-dependent keep is a Min)
                sp, conv = None, converter(trace)
            data_sizes = data_size_report(trace, sp)
            hints = dict(trace.hints)
            trace = instantiate(trace, conv, hints)
            inputs = [_describe_input(x, trace_hints=hints) for x in workload.args]
        else:
            data_sizes = data_size_report(trace, None)
        return analyse(trace, facts, model=workload.display_name, options=options,
                       inputs=inputs, symbolic=sp, data_sizes=data_sizes, **around)


def _profile_ranks(workload: Workload, options: Options, progress=None,
                   eager: Profile | None = None) -> Profile:
    """Every rank class of the job traced and analysed (distributed/profile.py); the Profile of
    the rank with the highest peak, with every rank's memory and the job's facts."""
    from .distributed.profile import profile_ranks

    def analyse_rank(trace, facts, distributed):
        return _analyse_captured(trace, facts, workload, options, distributed=distributed)

    top, ranks, job = profile_ranks(workload, options, analyse_rank, progress)
    return analyse(top.trace, top.run, model=top.model, options=options, inputs=top.inputs,
                   ranks=ranks, distributed=job, eager=eager, of=top)


def _describe_input(x, trace_hints=None) -> object:
    from .capture.model import Spec

    if isinstance(x, (Spec, torch.Tensor)):
        shape = list(x.shape)
        if trace_hints and isinstance(x, Spec):
            shape = [trace_hints.get(n, d) if n else d for d, n in zip(shape, x.dim_names())]
        return {"shape": shape, "dtype": str(x.dtype).replace("torch.", "")}
    return repr(x)


def _resize(x, sizes: dict):
    """Specs with their named dimensions set to `sizes`."""
    from .capture.model import Spec

    def one(s):
        if not isinstance(s, Spec):
            return s
        shape = tuple(sizes.get(n, d) if n else d for d, n in zip(s.shape, s.dim_names()))
        return replace(s, shape=shape)

    return tree_map(one, x, is_leaf=lambda s: isinstance(s, Spec))


@contextmanager
def _gc_paused():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
