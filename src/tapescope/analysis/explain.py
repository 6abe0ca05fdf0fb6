"""Why an op becomes what it becomes on a device: the dispatch path, what autograd records, and which
ops the recorded node's backward runs.

Three sources, all from PyTorch itself:
- the dispatcher's computed table for each op (analysis.dispatch): which kernel the Autograd key and
  the backend key run on this device, and where they were registered;
- the profiler's call tree of the op run on fake tensors of the device: a CompositeImplicitAutograd
  op shows the ops its decomposition calls; an op that reaches the dispatch mode is a real kernel;
- a Tape trace of the op, forward and backward (tapescope's engine, so this works for CUDA without a
  GPU): the autograd nodes created and the ops each node's backward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dispatch import Kernel, dispatch_table

__all__ = ["CallNode", "NodeInfo", "Explanation", "explain_op", "explain_profile", "render"]

_BACKEND_KEY = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta"}
_AUTOGRAD_KEY = {"cpu": "AutogradCPU", "cuda": "AutogradCUDA", "meta": "AutogradMeta"}


@dataclass
class CallNode:
    """One op call as the dispatcher saw it; `children` are the ops a decomposition called."""

    op: str
    autograd: Kernel | None
    backend: Kernel | None
    dispatched: bool  # reached the dispatch mode below autograd: a kernel, not a decomposition
    children: list = field(default_factory=list)


@dataclass
class NodeInfo:
    """An autograd node the forward created, and what its backward ran."""

    node: str
    forward_op: str
    backward_ops: list


@dataclass
class Explanation:
    op: str
    device: str
    calls: list              # CallNode trees
    forward_ops: list        # what a dispatch mode (and so the trace) records, in order
    nodes: list              # NodeInfo
    note: str = ""


def _kernels(op: str, device_type: str) -> tuple[Kernel | None, Kernel | None]:
    t = dispatch_table(op)
    autograd = t.get(_AUTOGRAD_KEY.get(device_type, "AutogradOther")) or t.get("AutogradOther")
    backend = t.get(_BACKEND_KEY.get(device_type, device_type))
    return autograd, backend


def _qualified(name: str) -> str:
    """'aten::add' from the profiler -> an overload name the dispatcher tables know."""
    ns, _, base = name.partition("::")
    packet = getattr(getattr(torch.ops, ns, None), base, None)
    if packet is None:
        return name
    names = packet.overloads()
    return getattr(packet, "default" if "default" in names else names[0]).name()


def _call_tree(prof, device_type: str, recorded: list) -> list:
    """The profiler's op tree; a call that reached the dispatch mode takes the exact overload of the
    op the tape recorded there (the profiler names ops without their overload)."""
    from ..torch_compat import profiler_event_tree, profiler_event_types

    _EventType = profiler_event_types()

    recorded = list(recorded)

    def build(e):
        if e.tag != _EventType.TorchOp or not ("::" in e.name):
            return [c for ch in e.children for c in build(ch)]
        if e.name == "PythonDispatchMode":
            return []
        reached = any(c.name == "PythonDispatchMode" for c in e.children)
        qual = _qualified(e.name)
        if reached and recorded and recorded[0].split(".")[0] == e.name:
            qual = recorded.pop(0)
        autograd, backend = _kernels(qual, device_type)
        node = CallNode(qual, autograd, backend, reached)
        if not reached:
            node.children = [c for ch in e.children for c in build(ch)]
        return [node]

    return [n for root in profiler_event_tree(prof) for n in build(root)]


def _sample_args(func, device, dtype):
    """Small inputs from an op's schema: square (8, 8) tensors (so matrix products, norms over
    the last dimension and elementwise ops all accept them), defaults."""
    from ..torch_compat import schema_types

    C = schema_types()

    def tensor(shape=(8, 8)):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=dtype.is_floating_point)

    args = []
    for a in func._schema.arguments:
        if a.kwarg_only:
            break
        t = a.type
        inner = t.getElementType() if isinstance(t, C.OptionalType) else t
        if isinstance(t, C.TensorType):
            args.append(tensor())
        elif isinstance(inner, C.TensorType):  # Tensor?
            args.append(tensor((8,)) if a.name in ("weight", "bias") else None)
        elif isinstance(t, C.ListType) and isinstance(t.getElementType(), C.TensorType):
            args.append([tensor(), tensor()])
        elif a.has_default_value():
            args.append(a.default_value)
        elif isinstance(t, C.ListType):
            args.append([8] if a.name == "normalized_shape" else [-1] if "dim" in a.name else [8, 8])
        elif isinstance(inner, (C.IntType, C.SymIntType)):
            args.append(-1 if "dim" in a.name else 1)
        elif isinstance(inner, C.FloatType):
            args.append(1e-5 if "eps" in a.name else 0.5)
        elif isinstance(inner, C.BoolType):
            args.append(False)
        elif isinstance(inner, C.NumberType):
            args.append(1)
        else:
            raise ValueError(f"cannot make a sample for argument '{a.name}: {t}'")
    return args


def explain_op(op: str, device: str = "cuda", dtype=torch.float32) -> Explanation:
    """Run one op (sample inputs from its schema) on fake tensors of `device` and explain it."""
    from torch.profiler import profile as torch_profile

    from ..capture.records import BACKWARD, FORWARD
    from ..capture.session import trace_call
    from ..options import check_device_build, resolve_device

    name = op if "::" in op else op.replace(".", "::", 1)
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns, None), base, None)
    if packet is None:
        raise ValueError(f"no operator {op!r} (write it like aten::rms_norm or aten.add.Tensor)")
    func = getattr(packet, overload or ("default" if "default" in packet.overloads()
                                        else packet.overloads()[0]))
    dev = resolve_device(device)
    check_device_build(dev)
    from ..native_logs import quiet_native_logs

    prof = torch_profile()
    with quiet_native_logs():  # Kineto logs when the trace starts, stops and is read
        try:
            trace = trace_call(dev, lambda: _sample_args(func, dev, dtype), func,
                               observe=lambda: prof)
        except RuntimeError as e:  # the op refuses the schema's sample shapes (a convolution)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{func.name()} refused the sample inputs made from its schema "
                             f"(square 8 x 8 tensors): {first}; profile a model that calls it "
                             "and use `tapescope ops` instead") from None
        calls = _call_tree(prof, dev.type, [r.func.name() for r in trace.ops if r.phase == FORWARD])
    fwd = [r for r in trace.ops if r.phase == FORWARD]
    owners = {r.seq_nr: r.name for r in fwd if r.owns_node}
    nodes: dict = {}
    for r in trace.ops:
        if r.phase == BACKWARD and r.grad_fn and r.seq_nr in owners:
            info = nodes.setdefault(r.seq_nr, NodeInfo(r.grad_fn, owners[r.seq_nr], []))
            info.backward_ops.append(r.name)
    return Explanation(func.name(), str(dev), calls, [r.name for r in fwd],
                       [n for _, n in sorted(nodes.items())])


def explain_profile(ops: list, device_type: str) -> list[tuple]:
    """For every distinct forward op of a step's ops (analysis.ops.Op): (op, autograd kernel,
    backend kernel, autograd node, backward ops)."""
    rows, seen = [], set()
    backward: dict = {}
    for op in ops:
        if op.phase == "backward" and op.forward_op is not None:
            backward.setdefault(op.forward_op, []).append(op.name)
    for op in ops:
        if op.phase != "forward" or op.name in seen:
            continue
        seen.add(op.name)
        autograd, backend = _kernels(op.record.func.name(), device_type)
        rows.append((op.name, autograd, backend, op.autograd_node if op.record.owns_node else None,
                     backward.get(op.index, [])))
    return rows


def describe_kernel(k: Kernel | None) -> str:
    if k is None:
        return "no kernel"
    what = {"math kernel": "CompositeImplicitAutograd decomposition",
            "autograd kernel": "autograd kernel (records a node)",
            "kernel": "kernel", "default backend kernel": "CompositeExplicitAutograd kernel",
            "fallthrough": "fallthrough", "backend fallback": "fallback"}.get(k.kind, k.kind)
    return f"{what}, registered at {k.where}"


def render(e: Explanation) -> str:
    lines = [f"{e.op} on {e.device}", "", "Dispatch (the dispatcher's own table, and the calls it made):"]

    def walk(n: CallNode, depth: int):
        pad = "  " * depth
        if n.autograd is not None and n.autograd.kind == "math kernel":
            how = "decomposes above autograd (CompositeImplicitAutograd), calling:"
        elif n.dispatched:
            how = ("autograd kernel records a node; backend: "
                   + (n.backend.kind if n.backend else "no kernel"))
        else:
            how = "calls:"
        lines.append(f"{pad}- {n.op}: {how}")
        lines.append(f"{pad}    Autograd key: {describe_kernel(n.autograd)}")
        lines.append(f"{pad}    backend key:  {describe_kernel(n.backend)}")
        for c in n.children:
            walk(c, depth + 1)

    for n in e.calls:
        walk(n, 1)
    lines += ["", "Ops a dispatch mode records (what tapescope traces): " + ", ".join(e.forward_ops), "",
              "Autograd records:"]
    for n in e.nodes:
        lines.append(f"  - {n.node} (for {n.forward_op}); its backward runs: {', '.join(n.backward_ops) or 'nothing'}")
    if e.note:
        lines += ["", e.note]
    return "\n".join(lines)
