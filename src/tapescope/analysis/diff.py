"""Two profiles of the same step (say device meta vs cuda) side by side: where their op sequences
differ, why the dispatcher made them differ, and what it costs in memory and FLOPs."""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from ..capture.records import BACKWARD, FORWARD
from .explain import _kernels

__all__ = ["Hunk", "StepDiff", "diff_steps"]


@dataclass
class Hunk:
    phase: str
    modules: list       # modules the differing ops belong to
    a_ops: list         # op names only in A (in order)
    b_ops: list
    reasons: list       # why, from the dispatch tables and autograd
    a_flops: int
    b_flops: int
    a_saved: int        # bytes these ops left saved for backward
    b_saved: int


@dataclass
class StepDiff:
    hunks: list
    same_ops: int       # forward and backward ops the two steps share, in order


def _kind(op: str, device_type: str) -> str | None:
    k = _kernels(op, device_type)[0]
    return None if k is None else k.kind


def _forward_of(step_ops, ops):
    return [step_ops[o.forward_op] for o in ops if o.forward_op is not None]


def _reasons(a_ops, b_ops, a_dev: str, b_dev: str, a_nodes, b_nodes, a=None, b=None) -> list[str]:
    """a, b: the two steps' whole op lists (to find a backward op's forward op)."""
    out = []
    if a is not None and a_ops and a_ops[0].phase == BACKWARD:
        # a backward difference follows from the forward ops whose nodes these are
        fa, fb = _forward_of(a, a_ops), _forward_of(b, b_ops)
        inner = _reasons(fa, fb, a_dev, b_dev, set(), set())
        nodes = lambda ops: sorted({o.autograd_node for o in ops if o.autograd_node})  # noqa: E731
        out.append(f"these are the backward ops of {nodes(a_ops) or 'no node'} on {a_dev} and of "
                   f"{nodes(b_ops) or 'no node'} on {b_dev}")
        return out + [r for r in inner if not r.startswith("different kernels")]
    for op in dict.fromkeys(a_ops):
        name = op.record.func.name()
        kb = _kind(name, b_dev)
        if kb == "math kernel":
            out.append(f"{op.name} has an autograd kernel on {a_dev} ({op.autograd_node or 'no node'}),"
                       f" but on {b_dev} its CompositeImplicitAutograd decomposition runs above "
                       f"autograd, so autograd records the ops it calls instead")
    for op in dict.fromkeys(b_ops):
        name = op.record.func.name()
        ka = _kind(name, a_dev)
        if ka == "math kernel":
            out.append(f"{op.name} has an autograd kernel on {b_dev} ({op.autograd_node or 'no node'}),"
                       f" but on {a_dev} its CompositeImplicitAutograd decomposition runs above "
                       f"autograd, so autograd records the ops it calls instead")
    a_names = {o.name for o in a_ops}
    b_names = {o.name for o in b_ops}
    attn = [n for n in a_names | b_names if "attention" in n]
    if attn:
        out.append("different attention kernel: scaled_dot_product_attention picks its backend "
                   "from the device (tapescope explain aten::scaled_dot_product_attention)")
    if a_nodes != b_nodes and not out:
        out.append(f"autograd records different nodes: {sorted(a_nodes - b_nodes)} vs "
                   f"{sorted(b_nodes - a_nodes)}")
    if not out:
        out.append("different kernels for the same computation on the two devices")
    return out


def _seq(ops, phase):
    return [op for op in ops if op.phase == phase]


def diff_steps(a_ops: list, b_ops: list, a_device: str, b_device: str) -> StepDiff:
    """Align the forward and backward op sequences of two traced steps (analysis.ops.Op lists)
    on two device types and explain each difference from the dispatch tables."""
    hunks, same = [], 0
    for phase in (FORWARD, BACKWARD):
        sa, sb = _seq(a_ops, phase), _seq(b_ops, phase)
        sm = SequenceMatcher(a=[o.name for o in sa], b=[o.name for o in sb], autojunk=False)
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                same += i2 - i1
                continue
            ao, bo = sa[i1:i2], sb[j1:j2]
            mods = list(dict.fromkeys(o.module for o in (*ao, *bo) if o.module is not None))
            a_nodes = {o.autograd_node for o in ao if o.autograd_node}
            b_nodes = {o.autograd_node for o in bo if o.autograd_node}
            hunks.append(Hunk(
                phase, mods, [o.name for o in ao], [o.name for o in bo],
                _reasons(ao, bo, a_device, b_device, a_nodes, b_nodes, a_ops, b_ops),
                sum(o.total_flops or 0 for o in ao), sum(o.total_flops or 0 for o in bo),
                sum(t.nbytes for o in ao if o.saved for t in o.outputs),
                sum(t.nbytes for o in bo if o.saved for t in o.outputs)))
    return StepDiff(hunks, same)
