"""The step as one torch.fx graph: forward, backward and optimizer ops in execution order.

Unlike an AOTAutograd joint graph the ops are not functionalised: an in-place op is a node whose
result is its mutated argument, as the step really runs it. Tensors the step did not produce
(parameters, buffers, inputs) are placeholders named after them. Every node's meta carries
`phase`, `seq_nr`, `nn_module`, `stack_trace`, `flops`, `saved`, `autograd_node`, `forward_op`,
`bytes_read`, `bytes_written`, `tensor_meta` (shape and dtype of each result) and `recompute`
(a forward op run again during backward by activation checkpointing).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture.records import TensorRef, Trace

__all__ = ["build_graph"]


def build_graph(ops: list, trace: Trace) -> fx.GraphModule:
    """One FX graph of a step's ops (analysis.ops.Op, in order) from the trace they came from."""
    g = fx.Graph()
    nodes: dict[int, object] = {}  # value id -> fx.Node, or (node, index) until a getitem is needed

    def ref_node(ref: TensorRef):
        n = nodes.get(ref.value)
        if isinstance(n, tuple):
            base, i = n
            n = nodes[ref.value] = g.call_function(operator.getitem, (base, i))
            n.meta["tensor_meta"] = [_tmeta(ref)]
        return n

    # placeholders first, in order of first use
    for op in ops:
        for ref in op.inputs:
            if ref.value not in nodes:
                name = trace.external_values.get(ref.value)
                if name is None:
                    continue  # produced by an op of the other step (cannot happen within one step)
                ph = nodes[ref.value] = g.placeholder(_identifier(name))
                ph.meta["tensor_meta"] = [_tmeta(ref)]

    def convert(a):
        if type(a) is TensorRef:
            n = ref_node(a) if a.value in nodes else None
            if n is None:  # a real constant lifted into the program, or a tensor of another step
                n = nodes[a.value] = g.placeholder(_identifier(f"tensor_{a.value}"))
                n.meta["tensor_meta"] = [_tmeta(a)]
            return n
        if type(a) in (tuple, list):
            return type(a)(convert(x) for x in a)
        return a

    for op in ops:
        rec = op.record
        node = g.call_function(rec.func, tuple(convert(a) for a in rec.args),
                               {k: convert(v) for k, v in rec.kwargs.items()})
        node.meta.update(
            phase=op.phase, seq_nr=op.seq_nr, nn_module=op.module,
            stack_trace=None if op.source is None else
            f'  File "{op.source.filename}", line {op.source.lineno}, in {op.source.function}',
            flops=op.flops, saved=op.saved, autograd_node=op.autograd_node,
            forward_op=op.forward_op, bytes_read=op.bytes_read, bytes_written=op.bytes_written,
            tensor_meta=[None if o is None else _tmeta(o) for o in rec.outputs],
            recompute=op.recompute,
        )
        returns = rec.func._schema.returns
        if len(returns) == 1 and str(returns[0].type) == "Tensor":
            for o in rec.outputs:
                if o is not None:
                    nodes[o.value] = node
        elif returns:
            for i, o in enumerate(rec.outputs):
                if o is not None:
                    nodes[o.value] = (node, i)
        else:  # the op returns nothing and mutates its arguments: they stay their own nodes
            written = [convert(a) for a in _written_refs(rec)]
            for o, n in zip(rec.outputs, written):
                nodes[o.value] = n
    g.output(None)
    return fx.GraphModule(torch.nn.Module(), g, class_name="TrainingStep")


def _written_refs(rec):
    for i, arg in enumerate(rec.func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        a = rec.args[i] if i < len(rec.args) else rec.kwargs.get(arg.name)
        if type(a) is TensorRef:
            yield a
        elif type(a) in (tuple, list):
            yield from (x for x in a if type(x) is TensorRef)


def _tmeta(ref: TensorRef) -> dict:
    return {"shape": tuple(ref.shape), "dtype": ref.dtype}


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"_{out}"
