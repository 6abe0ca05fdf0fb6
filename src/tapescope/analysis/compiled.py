"""What torch.compile did to the step: the partitioner's saved and recomputed tensors, graph breaks,
and FLOPs with recomputation, as pure functions of the compile record and the trace.

Saved: the backward graph of each compiled region receives the forward's saved tensors as its
placeholders (everything but `tangents_*`, AOTAutograd's names for the incoming gradients); symbolic
sizes saved alongside (`Sym(s0)`) hold no memory and are listed apart.

Recomputed: the min-cut partitioner copies cheap forward ops into the backward instead of saving
their outputs. Both graphs are cut from one joint graph and keep its node names, so a backward
node with the name of a forward node is that forward op run a second time.

FLOPs: inside a compiled region the generated kernels do the work, so a region's FLOPs are its
graphs' (every node, fused or not, through the same formulas as eager ops; recomputed nodes count
again); ops that run eagerly (the loss outside the model, graph breaks, the optimizer) count as
recorded. Per module likewise: a graph node's module is the one dynamo recorded for it
(`nn_module_stack`, and for a backward node the forward's, `fwd_nn_module_stack`); the module
hooks that name an eager op's module do not run inside compiled code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..capture.records import BACKWARD, FORWARD, OPTIMIZER, OpRecord, TensorRef
from ..torch_compat import OpOverload, tree_leaves
from .flops import op_flops

__all__ = ["SavedTensor", "RecomputedOp", "CompiledReport", "compiled_report", "graph_flops",
           "node_flops", "side_by_side", "speedup", "saved_at_end_of_forward"]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor the forward saves for the backward (a backward graph input)."""

    region: int
    name: str            # its node name in the partitioned graphs ("addmm_2", "primals_3")
    shape: tuple
    dtype: str
    nbytes: int          # its storage's bytes; 0 when it shares a storage listed before
    op: str | None       # the aten op that made it in the forward graph (None: a graph input)
    input: str | None = None    # for a graph input: which ("c1.weight", "input 0")
    view_of: str | None = None  # the saved tensor whose storage it shares

    @property
    def is_activation(self) -> bool:
        """Made by the forward (not a parameter, buffer or step input, nor a view of one)."""
        return self.input is None and self.op is not None


@dataclass(frozen=True)
class RecomputedOp:
    region: int
    name: str
    op: str
    flops: int | None


@dataclass
class CompiledReport:
    options: dict
    regions: int
    graph_breaks: list           # capture.compiled.GraphBreak
    saved: list                  # SavedTensor
    saved_symbols: list          # names of saved symbolic sizes
    recomputed: list             # RecomputedOp
    flops: dict                  # phase -> FLOPs of the compiled step (recompute included)
    recompute_flops: int
    module_flops: dict = field(default_factory=dict)  # module fqn -> FLOPs of its own ops/nodes
    graphs: list = field(default_factory=list, repr=False)  # capture.compiled.CompiledGraph
    approximations: tuple = ()

    @property
    def saved_bytes(self) -> int:
        """Bytes of the saved activations (graph inputs saved hold no new memory)."""
        return sum(s.nbytes for s in self.saved if s.is_activation)

    def to_dict(self) -> dict:
        return {
            "options": self.options, "regions": self.regions,
            "graph_breaks": [{"reason": b.reason, "where": b.where} for b in self.graph_breaks],
            "saved": [s.__dict__ for s in self.saved], "saved_symbols": self.saved_symbols,
            "saved_bytes": _n(self.saved_bytes),
            "recomputed": [r.__dict__ for r in self.recomputed],
            "flops": {k: _n(v) for k, v in self.flops.items()},
            "recompute_flops": _n(self.recompute_flops),
            "approximations": list(self.approximations),
        }


def _n(x):
    return x if isinstance(x, int) else str(x)


def _hint(x):
    """A concrete size for a symbolic one (dynamic=True graphs): its hint."""
    if isinstance(x, torch.SymInt):
        return x.node.hint if x.node.hint is not None else x
    return x


def _ref(val) -> TensorRef | None:
    if isinstance(val, torch.Tensor):
        return TensorRef(tuple(_hint(s) for s in val.shape), val.dtype, -1, -1)
    return None


def _convert(a):
    if isinstance(a, torch.fx.Node):
        v = a.meta.get("val")
        r = _ref(v)
        return r if r is not None else _hint(v)
    if isinstance(a, (list, tuple)):
        return type(a)(_convert(x) for x in a)
    return _hint(a)


def node_flops(node: torch.fx.Node) -> int | None:
    """FLOPs of one call_function node of an aten graph, by the same formulas as recorded ops."""
    func = node.target
    if not isinstance(func, OpOverload):
        return 0  # getitem, symbolic arithmetic
    args = tuple(_convert(a) for a in node.args)
    kwargs = {k: _convert(v) for k, v in node.kwargs.items()}
    val = node.meta.get("val")
    outs = val if isinstance(val, (tuple, list)) else (val,)
    outputs = tuple(_ref(o) for o in outs)
    inputs = tuple(x for x in tree_leaves((args, kwargs))
                   if isinstance(x, TensorRef))
    rec = OpRecord(0, func, FORWARD, 1, args, kwargs, outputs, inputs)
    try:
        return op_flops(rec)
    except Exception:  # noqa: BLE001 - a formula that cannot read this node's arguments
        return None


def node_module(node: torch.fx.Node) -> str | None:
    """The fqn of the module a compiled graph's node came from ("" the compiled model itself),
    read off dynamo's module stack: paths such as "L['model'].layers.0.fc" or
    "L['self'].h[0]", relative to the stack's first entry (the model compiled)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    paths = [v[0] for v in (stack.values() if isinstance(stack, dict) else stack)]
    root, last = paths[0], paths[-1]
    if not (isinstance(root, str) and isinstance(last, str) and last.startswith(root)):
        return None
    rel = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", last[len(root):])
    return ".".join(p for p in rel.split(".") if p and p != "_modules")


def graph_module_flops(gm: torch.fx.GraphModule) -> dict:
    """Module fqn -> FLOPs of the graph's nodes that came from it (its own, not its
    submodules'); nodes with no module add nothing."""
    out: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        m = node_module(node)
        f = node_flops(node)
        if m is not None and f:
            out[m] = out.get(m, 0) + f
    return out


def graph_flops(gm: torch.fx.GraphModule, only=None) -> int:
    """FLOPs of a graph's call_function nodes (`only`: a set of node names to count)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and (only is None or node.name in only):
            f = node_flops(node)
            total += f or 0
    return total


def _saved(region: int, bw: torch.fx.GraphModule, fw: torch.fx.GraphModule | None,
           inputs: list) -> tuple[list, list]:
    fw_nodes = {n.name: n for n in fw.graph.nodes} if fw is not None else {}
    owner = _input_storages(fw_nodes, inputs)
    tensors, symbols, storages = [], [], {}
    for n in bw.graph.nodes:
        if n.op != "placeholder" or n.name.startswith("tangents"):
            continue
        source = fw_nodes.get(n.name, n)
        v = source.meta.get("val")
        if not isinstance(v, torch.Tensor):
            symbols.append(n.name)
            continue
        made = source.target if source.op == "call_function" else None
        key = v.untyped_storage()._cdata
        graph_input = owner.get(key)  # a graph input, or a view of one
        first = storages.setdefault(key, n.name)
        nbytes = _hint(v.untyped_storage().nbytes()) if first == n.name else 0
        tensors.append(SavedTensor(
            region, n.name, tuple(_hint(x) for x in v.shape), str(v.dtype).replace("torch.", ""),
            nbytes, None if made is None else str(getattr(made, "__name__", made)), graph_input,
            None if first == n.name else first))
    return tensors, symbols


def _input_storages(fw_nodes: dict, inputs: list) -> dict:
    """Storage key -> the graph input owning it, for the forward graph's tensor inputs."""
    out = {}
    for n in fw_nodes.values():
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            idx = getattr(n.meta.get("desc"), "idx", None)
            name = inputs[idx] if idx is not None and idx < len(inputs) else n.name
            out.setdefault(v.untyped_storage()._cdata, name)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _recomputed(region: int, bw: torch.fx.GraphModule, fw: torch.fx.GraphModule | None):
    if fw is None:
        return []
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    out = []
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.name in fw_names:
            out.append(RecomputedOp(region, n.name, str(n.target), node_flops(n)))
    return out


def compiled_report(record, trace, view, ops) -> CompiledReport:
    """`record`: capture.compiled.CompileRecord; `trace`, `view`, `ops`: the compiled step's trace,
    the StepView reported and its ops."""
    graphs: dict = {}
    for g in record.graphs:
        graphs[f"{g.kind} {g.region}"] = g
    saved, symbols, recomputed = [], [], []
    for region in range(record.regions):
        fw = graphs.get(f"forward {region}")
        bw = graphs.get(f"backward {region}")
        if bw is not None:
            s, sym = _saved(region, bw.graph, fw.graph if fw else None,
                            record.inputs[region] if region < len(record.inputs) else [])
            saved += s
            symbols += sym
            recomputed += _recomputed(region, bw.graph, fw.graph if fw else None)

    # FLOPs: ops outside compiled code as recorded, plus each run of a compiled graph
    in_step = set(view.ops)
    inside = set()
    flops = dict.fromkeys((FORWARD, BACKWARD, OPTIMIZER), 0)
    by_module: dict = {}
    memo: dict = {}
    for label, start, end in trace.compiled_calls:
        inside.update(range(start, end))
        g = graphs.get(label)
        if g is None or start not in in_step or start >= len(trace.ops):
            continue
        if label not in memo:
            memo[label] = (graph_flops(g.graph), graph_module_flops(g.graph))
        total, per_module = memo[label]
        # a user's step has phases of its own (other, setup) besides these three
        phase = trace.ops[start].phase
        flops[phase] = flops.get(phase, 0) + total
        for m, f in per_module.items():
            by_module[m] = by_module.get(m, 0) + f
    for op in ops:
        if op.record.index not in inside and op.flops:
            flops[op.phase] = flops.get(op.phase, 0) + op.total_flops
            if op.module is not None:
                by_module[op.module] = by_module.get(op.module, 0) + op.total_flops
    flops["total"] = sum(flops.values())
    return CompiledReport(
        options=record.options.to_dict(), regions=record.regions, graph_breaks=list(record.breaks),
        saved=saved, saved_symbols=symbols, recomputed=recomputed, flops=flops,
        module_flops=by_module,
        recompute_flops=sum(r.flops or 0 for r in recomputed), graphs=list(record.graphs),
        approximations=tuple(record.approximations))


def saved_at_end_of_forward(p) -> int:
    """Bytes of saved activations alive when the forward ends (what the backward will read)."""
    from ..capture.records import SAVED

    last = max((i for i, op in enumerate(p.ops) if op.phase == FORWARD), default=None)
    series = p.memory.timeline_by_category.get(SAVED)
    return series[last] if last is not None and series else 0


def side_by_side(eager, compiled) -> dict:
    """name -> (eager value, compiled value) for the figures both steps have."""
    out = {
        "peak_bytes": (eager.peak_bytes, compiled.peak_bytes),
        "first_step_peak_bytes": (eager.first_step_peak_bytes, compiled.first_step_peak_bytes),
        "saved_activation_bytes": (saved_at_end_of_forward(eager), saved_at_end_of_forward(compiled)),
    }
    for k in (FORWARD, BACKWARD, OPTIMIZER, "total"):
        out[f"flops_{k}"] = (eager.flops.get(k), compiled.flops.get(k))
    et, ct = eager.time, compiled.time
    if et is not None and ct is not None:
        from .compiled_time import step_kernels

        out["time_seconds"] = (et.seconds, ct.seconds)
        # DRAM bytes all kernels load and store: what fusion saves
        out["kernel_bytes"] = tuple(sum(k.bytes * runs for k, runs in step_kernels(p.ops, s))
                                    for p, s in ((eager, None),
                                                 (compiled, compiled.compiled_schedule)))
    return out


def speedup(eager, compiled) -> float | None:
    """Eager step time / compiled step time (None where either has no time)."""
    et, ct = eager.time, compiled.time
    return et.seconds / ct.seconds if et is not None and ct is not None and ct.seconds else None
