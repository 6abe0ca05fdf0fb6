"""Run the same training step for real and read what the allocator says: the ground truth.

The step is `capture.step.train_step`, the very function tapescope traces. Everything the step
touches (model copy, inputs, optimizer) is created inside `torch.profiler.profile(profile_memory=True)`,
so the allocator's own running total (`total_allocated` on each allocation event) covers all of it;
live bytes are that total minus its value before the first allocation.

Each allocation event keeps the aten op that made it, so a disagreement with the trace can be
followed to the op (see `real_allocations`).
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

from ..native_logs import quiet_native_logs

from ..analysis.dispatch import decomposes_above_autograd
from ..capture.model import real_inputs
from ..options import resolve_dtype
from ..capture.optimizers import make_optimizer
from ..capture.step import train_step

__all__ = ["RealStep", "Allocation", "run_real_steps"]


@dataclass(frozen=True)
class Allocation:
    step: int        # 0: setup
    phase: str | None
    op: str | None   # the innermost aten op that allocated (or freed)
    nbytes: int      # positive: allocation, negative: free
    live: int        # live bytes after this event
    top_op: int | None = None  # index in RealStep.ops of the dispatched op it happened in


@dataclass
class RealStep:
    peaks: dict = field(default_factory=dict)       # step -> peak live bytes
    events: list = field(default_factory=list)      # Allocation, in time order
    ops: list = field(default_factory=list)         # (step, phase, "aten::name"), in order
    # compiled steps: ("dynamo", [source of each graph input]) for each graph dynamo made, then
    # ("forward" | "backward", graph) for each partitioned graph compiled from it, in order
    compiled_graphs: list = field(default_factory=list)

    def op_names(self, step: int, phases=("forward", "backward", "optimizer")) -> list[str]:
        """The step's aten ops as tapescope names them without overload: 'aten.mm'."""
        return [n.replace("::", ".") for s, p, n in self.ops if s == step and p in phases]


def _build(model, device, dtype):
    if isinstance(model, nn.Module):
        m = copy.deepcopy(model)  # the user's model stays untouched
    else:
        with torch.device(device):
            m = model()
    m = m.to(device)
    if dtype is not None:
        m = m.to(dtype)
    return m


def run_real_steps(model, inputs=(), input_kwargs=None, *, loss_fn=None, optimizer="adamw",
                   device="cpu", dtype=None, amp=None, steps: int = 2, seed: int = 0,
                   compile=None) -> RealStep:
    """Run `steps` real training steps on `device` and return each step's peak live bytes.

    compile: True, a dict or options.CompileOptions: the model runs as
    `torch.compile(model, mode=..., fullgraph=..., dynamic=...)` (inductor, real kernels), with
    functorch's activation_memory_budget when given, and `optimizer.step` compiled when asked.
    """
    device = torch.device(device)
    dtype, amp = resolve_dtype(dtype), resolve_dtype(amp)
    extra = {"forward_context": lambda: torch.autocast(device.type, dtype=amp)} if amp else {}
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # Garbage of earlier work (a traceback's frames holding tensors, say) must not be collected
    # during the run: its frees would count against this step's live bytes.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        prof, graphs = _profiled_steps(model, inputs, input_kwargs, loss_fn, optimizer, device,
                                       dtype, extra, steps, gen, activities, compile)
    finally:
        if was_enabled:
            gc.enable()
    real = _read_allocations(prof, device)
    real.compiled_graphs = graphs
    return real


def _profiled_steps(model, inputs, input_kwargs, loss_fn, optimizer, device, dtype, extra, steps,
                    gen, activities, compile):
    # record_shapes: the recorded inputs tell an op's overload (and so how it is dispatched)
    graphs: list = []
    with quiet_native_logs(), \
            profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        with record_function("tapescope::step0"):
            m = _build(model, device, dtype)
            args, kwargs = real_inputs((tuple(inputs), input_kwargs or {}), device, dtype, gen)
            opt = make_optimizer(optimizer, list(m.parameters()), device)
            m, opt = _compiled(m, opt, compile, graphs)

        def phase(step, name):
            return record_function(f"tapescope::phase::{name}")

        with _compile_config(compile):
            for s in range(1, steps + 1):
                with record_function(f"tapescope::step{s}"):
                    train_step(m, args, kwargs, loss_fn, opt, step=s, phase=phase, **extra)
                    with record_function("tapescope::phase::zero_grad"):
                        if opt is not None:
                            opt.zero_grad(set_to_none=True)
                        else:
                            for p in m.parameters():
                                p.grad = None
    return prof, graphs


def _compiled(model, opt, options, graphs: list):
    """The model (and optimizer.step) as torch.compile runs them, with inductor's real kernels.
    Each graph inductor compiles is appended to `graphs` as (kind, GraphModule)."""
    from ..options import CompileOptions

    options = CompileOptions.of(options)
    if options is None:
        return model, opt
    if options.backend == "inductor":
        # torch.compile(backend="inductor", mode=...) is compile_fx with the mode's config
        # patches; the same call, with an inner compile that keeps each partitioned graph
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(gm, example_inputs, **kw):
            kind = "backward" if kw.get("is_backward") else (
                "inference" if kw.get("is_inference") else "forward")
            graphs.append((kind, gm))
            return compile_fx_inner(gm, example_inputs, **kw)

        patches = list_mode_options(options.mode, options.dynamic) if options.mode else {}

        def backend(gm, example_inputs):
            # compile_fx takes the graph over: keep what its inputs are (their sources) now
            graphs.append(("dynamo", [n.meta["grapharg"].source.name for n in gm.graph.nodes
                                      if n.op == "placeholder"]))
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
    else:
        backend = "aot_eager"
    model = torch.compile(model, backend=backend, fullgraph=options.fullgraph,
                          dynamic=options.dynamic)
    if opt is not None and options.optimizer:
        opt.step = torch.compile(opt.step, backend=backend)
    return model, opt


def _compile_config(options):
    """functorch's config while compiling: the partitioner's activation_memory_budget."""
    from contextlib import nullcontext

    from ..options import CompileOptions

    options = CompileOptions.of(options)
    if options is None:
        return nullcontext()
    import torch._functorch.config as functorch_config

    # AOTAutograd's cache would skip the partitioner, and with it the graphs we keep
    patches = {"enable_autograd_cache": False}
    if options.activation_memory_budget is not None:
        patches["activation_memory_budget"] = options.activation_memory_budget
    return functorch_config.patch(**patches)


def _overload_name(name: str, inputs=()) -> str:
    """The profiler names ops without overload: the overload whose arguments match the recorded
    inputs (tensors where the schema has tensors; `min(a, b)` is min.other, `min(a)` min.default),
    else the default one."""
    packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
    if packet is None:
        return name
    names = packet.overloads()
    is_tensor = [type(i).__name__ == "_TensorMetadata" for i in inputs]
    for n in names:
        args = getattr(packet, n)._schema.arguments
        if inputs and len(args) == len(inputs) and all(
                t == isinstance(a.type, torch.TensorType) for a, t in zip(args, is_tensor)):
            return getattr(packet, n).name()
    return getattr(packet, "default" if "default" in names else names[0]).name()


def _read_allocations(prof, device: torch.device) -> RealStep:
    from ..torch_compat import profiler_event_tree, profiler_event_types

    _EventType = profiler_event_types()
    raw = []
    out = RealStep()

    def walk(e, step, phase, inside_op):
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device.type:
                raw.append((e.start_time_ns, f.alloc_size, f.total_allocated, e,
                            inside_op if inside_op is not False else None))
        elif e.tag == _EventType.TorchOp:
            name = e.name
            if name.startswith("tapescope::step"):
                step = int(name[len("tapescope::step"):])
            elif name.startswith("tapescope::phase::"):
                phase = name[len("tapescope::phase::"):]
            elif (name.startswith("aten::") and inside_op is False
                  and not decomposes_above_autograd(_overload_name(name, e.extra_fields.inputs),
                                                    device.type)):
                inside_op = len(out.ops)
                out.ops.append((step, phase, name))
        for c in e.children:
            walk(c, step, phase, inside_op)

    for root in profiler_event_tree(prof):
        walk(root, 0, None, False)
    raw.sort(key=lambda r: r[0])
    if not raw:
        return out
    base = raw[0][2] - raw[0][1]
    level = {}
    for _, size, total, e, top in raw:
        step, phase, op = _context(e)
        live = total - base
        out.events.append(Allocation(step, phase, op, size, live, top))
        out.peaks[step] = max(out.peaks.get(step, live), live)
        level.setdefault(step, live - size)
    # a step's peak is at least what was alive when it began
    for step, start in level.items():
        out.peaks[step] = max(out.peaks[step], start)
    return out


def _context(e):
    step, phase, op = 0, None, None
    p = e.parent
    while p is not None:
        name = p.name
        if name.startswith("tapescope::step"):
            step = int(name[len("tapescope::step"):])
            break
        if name.startswith("tapescope::phase::"):
            phase = phase or name[len("tapescope::phase::"):]
        elif op is None and name.startswith("aten::"):
            op = name
        p = p.parent
    return step, phase, op
