"""The op table of one step: one `Op` per aten op, with FLOPs, bytes, module and fwd<->bwd link."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..capture.records import (BACKWARD, BUILDS_GRAPH, OTHER, Frame, OpRecord, TensorRef,
                               Trace, op_name, slot_init)
from .flops import op_flops
from .steps import StepView
from .traffic import op_traffic

__all__ = ["Op", "expanded_ops", "OpCosts", "step_ops"]

_NO_NODE = 2**64 - 1  # seq_nr of AccumulateGrad and other nodes outside the forward sequence


@slot_init
@dataclass(frozen=True, slots=True)
class Op:
    """One aten op of the step.

    `forward_op` is the index of the forward op whose autograd node produced this backward op
    (same `seq_nr`); `autograd_node` names that node. `flops` is None when no formula applies.
    `recompute` marks a forward op run again during backward (activation checkpointing): its
    phase is "backward", when it runs; its module, source and node are a forward op's.
    """

    index: int
    name: str
    phase: str
    module: str | None
    seq_nr: int | None
    forward_op: int | None
    autograd_node: str | None
    inputs: tuple
    outputs: tuple
    flops: int | None
    bytes_read: int
    bytes_written: int
    saved: bool
    source: Frame | None
    record: OpRecord = field(repr=False, compare=False)  # what capture saw (arguments included)
    recompute: bool = False
    # times it runs in the step: >1 for the ops of a traced micro-batch that later micro-batches
    # were proven to repeat (Trace.repeated); totals (FLOPs, time) count it that many times
    runs: int = 1

    @property
    def total_flops(self) -> int | None:
        """FLOPs of all its runs in the step (None: no formula)."""
        return None if self.flops is None else self.flops * self.runs

    def to_dict(self) -> dict:
        def t(x: TensorRef):
            return {"shape": [int(s) if isinstance(s, int) else str(s) for s in x.shape],
                    "dtype": str(x.dtype).replace("torch.", ""), "storage": x.storage}

        return {
            "index": self.index, "name": self.name, "phase": self.phase, "module": self.module,
            "seq_nr": self.seq_nr, "forward_op": self.forward_op,
            "autograd_node": self.autograd_node,
            "inputs": [t(x) for x in self.inputs], "outputs": [t(x) for x in self.outputs],
            "flops": _num(self.flops), "bytes_read": _num(self.bytes_read),
            "bytes_written": _num(self.bytes_written), "saved": self.saved,
            "source": None if self.source is None else str(self.source),
            "recompute": self.recompute, "runs": self.runs,
        }


def _num(x):
    return x if x is None or isinstance(x, int) else str(x)


def param_module(fqn: str) -> str:
    """The module owning a parameter: 'h.0.attn.c_attn.weight' -> 'h.0.attn.c_attn'."""
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


class OpCosts:
    """FLOPs and traffic of trace ops, computed once each (step 2 reuses step 1's forward), and
    once per distinct op: a model's identical blocks repeat the same (op, shapes, scalars), 186
    distinct ones among GPT-2's 4,911 recorded ops.

    The content key holds everything the formulas read from a record: the op, its arguments and
    outputs with each TensorRef as (shape, dtype, its storage's size: traffic counts at most the
    storage), floats by their bits and bools by type (2.0 == 2, -0.0 == 0.0 and True == 1 in
    Python). Storage and value ids are left out: no formula reads them.
    """

    def __init__(self, trace: Trace):
        self.trace = trace
        self._memo: dict[int, tuple] = {}
        self._by_content: dict[tuple, tuple] = {}

    def __call__(self, index: int) -> tuple:
        c = self._memo.get(index)
        if c is None:
            r = self.trace.ops[index]
            try:
                kwargs = r.kwargs  # (most ops have none: no items tuple to make and walk)
                key = (r.func, self._content(r.args),
                       self._content(tuple(kwargs.items())) if kwargs else (),
                       self._content(r.outputs))
                c = self._by_content.get(key)
            except TypeError:  # an unhashable argument, symbolic sizes (SymInts do not hash)
                key = c = None
            if c is None:
                c = (op_flops(r), *op_traffic(r, self.trace))
                if key is not None:
                    self._by_content[key] = c
            self._memo[index] = c
        return c

    def _content(self, x):
        kind = type(x)
        if kind is TensorRef:
            size = -1 if x.storage < 0 else self.trace.storages[x.storage].nbytes
            return (x.shape, x.dtype, size)
        if kind is tuple or kind is list:
            # a record's arguments and outputs: tensors and ints, the common items, inline
            storages = self.trace.storages
            items = []
            for y in x:
                k = type(y)
                if k is TensorRef:
                    items.append((y.shape, y.dtype,
                                  -1 if y.storage < 0 else storages[y.storage].nbytes))
                elif k is int or y is None:
                    items.append(y)
                else:
                    items.append(self._content(y))
            # a list is not equal to the tuple of its items; its key must not be either
            return tuple(items) if kind is tuple else (list, tuple(items))
        if kind is float:  # 2.0 == 2 and -0.0 == 0.0 in Python; the bits tell them apart
            return (float, x.hex())
        if kind is bool:  # True == 1
            return (bool, x)
        return x


def expanded_ops(ops: list[Op]) -> list[Op]:
    """The step's ops in the order they ran: each block of a micro-batch that stands for several
    (consecutive trace ops with the same `runs` > 1) repeated that many times."""
    out, k = [], 0
    while k < len(ops):
        op = ops[k]
        if op.runs == 1:
            out.append(op)
            k += 1
            continue
        end = k + 1
        while (end < len(ops) and ops[end].runs == op.runs
               and ops[end].record.index == ops[end - 1].record.index + 1):
            end += 1
        out.extend(ops[k:end] * op.runs)
        k = end
    return out


def step_ops(trace: Trace, view: StepView, costs: OpCosts | None = None) -> list[Op]:
    costs = costs or OpCosts(trace)
    records = [trace.ops[i] for i in view.ops]
    owner: dict[int, int] = {}  # seq_nr -> local index of the forward op that created the node
    for k, r in enumerate(records):
        if (r.phase in BUILDS_GRAPH or r.recompute) and r.owns_node:
            owner.setdefault(r.seq_nr, k)
    saved = trace.saved_values
    storage_owner = trace.storage_owner
    # each storage's owning module, asked for once (an optimizer step asks ~5 times an op)
    owner_of: dict[int, str | None] = {}

    def owner_module(r, outputs: tuple) -> str | None:
        """The module whose parameters (or their gradients / optimizer state) an op touches; None
        for ops over many modules' parameters at once (foreach and fused optimizers)."""
        found = None
        for t in (*outputs, *r.inputs):
            sid = t.storage
            try:
                m = owner_of[sid]
            except KeyError:
                fqn = storage_owner.get(sid)
                m = owner_of[sid] = None if fqn is None else param_module(fqn)
            if m is not None:
                if found is not None and m != found:
                    return None
                found = m
        return found

    base = trace.seq_base

    def relative(seq):
        """seq_nr counted from the capture's first autograd node (None: no node, or before it)."""
        return None if seq is None or seq == _NO_NODE or seq < base else seq - base

    runs_of = {i: runs for first, end, runs in trace.repeated for i in range(first, end)}
    ops = []
    for k, r in enumerate(records):
        outputs = r.tensor_outputs()
        fwd = None
        node = r.grad_fn
        module = r.module
        if r.phase in BUILDS_GRAPH or r.recompute:
            if r.owns_node:
                node = trace.node_names.get(r.seq_nr)
            if module is None and r.phase == OTHER:  # a step's own code over parameters (an EMA)
                module = owner_module(r, outputs)
        elif r.phase == BACKWARD:
            if r.seq_nr is not None and r.seq_nr != _NO_NODE:
                fwd = owner.get(r.seq_nr)
            module = records[fwd].module if fwd is not None else owner_module(r, outputs)
        else:
            module = owner_module(r, outputs)
        flops, read, written = costs(r.index)
        is_saved = False
        for o in outputs:  # (a loop: most ops have one output, a generator costs more)
            if o.value in saved:
                is_saved = True
                break
        # positional, in the order of Op's fields (a frozen dataclass's keywords cost ~0.3 us)
        ops.append(Op(k, op_name(r.func), r.phase, module, relative(r.seq_nr), fwd, node,
                      r.inputs, outputs, flops, read, written, is_saved,
                      r.frame if r.frame is not None or fwd is None else records[fwd].frame,
                      r, r.recompute, runs_of.get(r.index, 1) if runs_of else 1))
    return ops
