"""`tapescope.profile`: capture a training step on fake tensors, then analyse it."""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from .analysis.memory import MemoryReport, memory_report, peak_bytes, storage_categories
from .analysis.ops import Op, OpCosts, step_ops
from .analysis.steps import step_views
from .capture.model import resolve_dtype
from .capture.records import BACKWARD, FORWARD, OPTIMIZER, Trace
from .capture.session import capture
from .errors import TapescopeError

__all__ = ["profile", "Profile"]


@dataclass
class Profile:
    """What one training step does, op by op, with its FLOPs and memory.

    The op table, FLOPs and `memory` describe the steady-state step (step 2, optimizer state
    present) when `steps=2`, else the first step. `first_step_peak_bytes` is the first step's peak.
    """

    model: str
    device: str
    dtype: str | None
    inputs: list
    steps: int
    ops: list                    # Op
    memory: MemoryReport
    first_step_peak_bytes: int
    facts: dict = field(default_factory=dict)
    trace: Trace | None = field(default=None, repr=False)
    symbolic: object = field(default=None, repr=False)  # analysis.symbolic.SymbolicProfile

    @property
    def peak_bytes(self):
        return self.memory.peak_bytes

    @cached_property
    def first_step_memory(self) -> MemoryReport:
        """The first step's memory report (its op indices refer to the first step's ops)."""
        if self.steps == 1:
            return self.memory
        view = step_views(self.trace)[1]
        ops = step_ops(self.trace, view, self._costs)
        return memory_report(self.trace, view, ops, self._categories)

    @cached_property
    def flops(self) -> dict:
        """FLOPs by phase and in total (a multiply-add is 2). Uncounted ops add nothing here."""
        out = dict.fromkeys((FORWARD, BACKWARD, OPTIMIZER), 0)
        for op in self.ops:
            if op.flops:
                out[op.phase] += op.flops
        out["total"] = sum(out.values())
        return out

    @cached_property
    def uncounted_ops(self) -> dict:
        """Ops with no FLOP formula -> how many times they ran (their FLOPs are not in `flops`)."""
        return dict(Counter(op.name for op in self.ops if op.flops is None))

    @cached_property
    def module_flops(self) -> dict:
        """Module fqn -> FLOPs of its ops and its submodules' ops (forward and backward)."""
        from .analysis.memory import _ancestors

        out: Counter = Counter()
        for op in self.ops:
            if op.flops and op.module is not None:
                for m in _ancestors(op.module):
                    out[m] += op.flops
        return dict(out)

    @cached_property
    def gpu(self):
        """The GPU whose kernels the trace follows (device="cuda"), a devices.gpus.GPU."""
        from .devices.gpus import get_gpu

        return get_gpu(self.facts["gpu"]) if self.facts.get("gpu") else None

    @cached_property
    def cuda_memory(self):
        """What torch.cuda would report: the caching allocator replayed over the steps (cuda)."""
        from .analysis.gpu_memory import predict_cuda_memory

        return predict_cuda_memory(self.trace, self.gpu) if self.gpu is not None else None

    @cached_property
    def time(self):
        """Estimated wall time of the step on the GPU (analysis.timing), None off CUDA."""
        from .analysis.timing import estimate_step_time

        return estimate_step_time(self, self.gpu) if self.gpu is not None else None

    @cached_property
    def graph(self) -> torch.fx.GraphModule:
        """The step as one FX graph: forward, backward and optimizer nodes in execution order."""
        from .analysis.graph import build_graph

        return build_graph(self)

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
        if self._retrace is None:
            raise TapescopeError(f"sizes {sizes} are outside the range of the formulas {sp.ranges}")
        p = self._retrace(full)
        return Estimate(full, p.peak_bytes, p.first_step_peak_bytes, dict(p.flops),
                        dict(p.memory.at_peak), p.memory.peak_op)

    def summary(self) -> str:
        from .report.text import summary_text

        return summary_text(self)

    def ops_table(self) -> str:
        from .report.text import ops_table_text

        return ops_table_text(self)

    def to_dict(self, with_ops: bool = True, with_timeline: bool = True) -> dict:
        d = {
            "tapescope_version": _version(), "torch_version": torch.__version__,
            "model": self.model, "device": self.device, "dtype": self.dtype,
            "inputs": self.inputs, "steps": self.steps,
            "peak_bytes": _n(self.peak_bytes), "first_step_peak_bytes": _n(self.first_step_peak_bytes),
            "flops": {k: _n(v) for k, v in self.flops.items()},
            "uncounted_ops": self.uncounted_ops,
            "facts": self.facts,
            "memory": self.memory.to_dict(with_timeline),
            "first_step_memory": self.first_step_memory.to_dict(False),
            "module_flops": {k: _n(v) for k, v in self.module_flops.items()},
        }
        if self.gpu is not None:
            d["gpu"] = {"key": self.gpu.key, "name": self.gpu.name}
            d["cuda_memory"] = {k: getattr(self.cuda_memory, k) for k in (
                "max_allocated", "max_reserved", "steady_allocated", "steady_reserved",
                "fragmentation", "context_bytes", "capacity", "oom", "oom_at")}
            d["cuda_memory"]["nvidia_smi"] = self.cuda_memory.nvidia_smi
            d["time"] = self.time.to_dict()
        if self.symbolic is not None:
            sp = self.symbolic
            d["symbolic"] = {"dims": list(sp.names), "ranges": sp.ranges,
                             "peak_bytes": str(sp.peak_expr()),
                             "flops": {k: str(v) for k, v in sp.flops.items()},
                             "guards": [g.__dict__ for g in sp.guards],
                             "specialized": sp.specialized, "fitted": sp.fitted}
        if with_ops:
            d["ops"] = [op.to_dict() for op in self.ops]
        return d


def _n(x):
    return x if isinstance(x, int) else str(x)


def _version() -> str:
    from . import __version__

    return __version__


def _describe_input(x, trace_hints=None) -> object:
    from .capture.model import Spec

    if isinstance(x, (Spec, torch.Tensor)):
        shape = list(x.shape)
        if trace_hints and isinstance(x, Spec):
            shape = [trace_hints.get(n, d) if n else d for d, n in zip(shape, x.dim_names())]
        return {"shape": shape, "dtype": str(x.dtype).replace("torch.", "")}
    return repr(x)


def profile(model, *inputs, loss_fn=None, optimizer="adamw", device="cpu", dtype=None,
            amp=None, steps: int = 2, input_kwargs: dict | None = None, name: str | None = None,
            engine: str = "python", symbolic=(), gpu=None, progress=None) -> Profile:
    """Trace a training step of `model` on fake tensors and analyse it.

    model: an nn.Module (any device, meta included; it is not modified) or a function that builds one
        (it is built on the meta device, so init code never allocates).
    inputs: tensors (real or meta) or `tapescope.spec(shape, dtype=...)`; `input_kwargs` for keyword
        inputs. Their values are never read.
    loss_fn: `loss_fn(output, *inputs) -> scalar`. Default: a scalar output is the loss; else an
        output's scalar `.loss`; else the sum of the floating-point outputs.
    optimizer: "sgd", "adam", "adamw" (torch defaults, with the foreach/fused choice torch makes on
        `device`), an Optimizer class, a function params -> optimizer, or None (no optimizer step).
    device: "cpu", "cuda" or "meta" - the device whose kernels and autograd formulas are traced.
    gpu: for device="cuda", the GPU whose kernel choices to follow ("h100", "a100", "l4", ...;
        default H100): attention backends depend on its compute capability.
    dtype: cast floating-point parameters and inputs (e.g. torch.bfloat16 or "bf16").
    amp: run forward and loss under torch.autocast with this dtype ("bf16", "fp16"): mixed
        precision with fp32 parameters (works for device="cuda" without a GPU).
    steps: 2 (default) reports the steady state, with optimizer state alive; 1 the first step.
    engine: "python" (default) runs backward with tapescope's own engine, which needs no GPU;
        "torch" calls loss.backward() (needs a GPU for device="cuda").
    symbolic: names of input dimensions to keep symbolic, e.g. ("batch", "seq"): one trace then
        gives memory and FLOPs as formulas (`p.symbolic`) and `p.at(batch=..., seq=...)`. The
        report itself is for the sizes the inputs have. Name dimensions with spec(..., dims=...).
    """
    dtype, amp = resolve_dtype(dtype), resolve_dtype(amp)
    if isinstance(symbolic, str):
        symbolic = (symbolic,)
    symbolic = tuple(symbolic or ())
    if not isinstance(model, torch.nn.Module) and callable(model) and symbolic:
        from .capture.model import build_on_meta

        model = build_on_meta(model)  # built once, traced again by at() outside the formulas
    trace, facts = capture(model, inputs, input_kwargs, loss_fn=loss_fn, optimizer=optimizer,
                           device=device, dtype=dtype, amp=amp, steps=steps, engine=engine,
                           symbolic=symbolic, gpu=gpu, progress=progress)
    facts["amp"] = None if amp is None else str(amp).replace("torch.", "")
    meta = dict(model=name or _model_name(model), device=str(device), dtype=dtype,
                inputs=[_describe_input(x) for x in inputs], steps=steps)
    sp = None
    with _gc_paused():  # analysis makes many small objects and no cycles: no collection needed
        if symbolic:
            from .analysis.symbolic import instantiate, symbolic_profile

            sp, sym_trace, conv = symbolic_profile(trace)
            trace = instantiate(sym_trace, conv, trace.hints)
            meta["inputs"] = [_describe_input(x, trace_hints=sp.hints) for x in inputs]
        p = analyse(trace, facts, **meta)
    p.symbolic = sp

    def retrace(sizes):
        resized = [_resize(x, sizes) for x in inputs]
        return profile(model, *resized, loss_fn=loss_fn, optimizer=optimizer, device=device,
                       dtype=dtype, amp=amp, steps=steps, input_kwargs=_resize(input_kwargs, sizes),
                       name=name, engine=engine, gpu=gpu)

    p._retrace = retrace if symbolic else None
    if sp is not None and sp.specialized:
        from .analysis.symbolic import fit_pinned

        fit_pinned(sp, retrace)
    return p


def _resize(x, sizes: dict):
    """Specs with their named dimensions set to `sizes`."""
    from torch.utils._pytree import tree_map

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


def analyse(trace: Trace, facts: dict, *, model: str, device: str, dtype, inputs, steps) -> Profile:
    views = step_views(trace)
    categories = storage_categories(trace)
    costs = OpCosts(trace)
    main = views[max(views)]
    ops = step_ops(trace, main, costs)
    memory = memory_report(trace, main, ops, categories)
    first_peak = memory.peak_bytes if main.step == 1 else peak_bytes(trace, views[1])
    facts = dict(facts, step2=trace.step2)
    p = Profile(model=model, device=device,
                dtype=None if dtype is None else str(dtype).replace("torch.", ""),
                inputs=inputs, steps=main.step, ops=ops, memory=memory,
                first_step_peak_bytes=first_peak, facts=facts, trace=trace)
    p._costs, p._categories, p._retrace = costs, categories, None
    return p


def _model_name(model) -> str:
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return getattr(model, "__name__", type(model).__name__)
