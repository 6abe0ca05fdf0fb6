"""What re-allocated a storage between ops, named so that a user can find the cause.

`UntypedStorage.resize_` allocates without dispatching an op. FSDP2 re-allocates every unsharded
parameter that way for each unshard after the first (`_fsdp_param.alloc_storage`, called from
`foreach_all_gather_copy_out`): the re-unshards of backward, of each micro-batch after the first,
of a pipeline stage's later micro-batches. The trace places such a storage after the last op
recorded (`StorageRecord.created_by`), which did not make it: FSDP2's all-gather on its own
stream, or the reduce-scatter of the block whose backward ended just before. An out-of-memory
label or a "made by" column naming that op points at a collective; what a user needs is what
asked for the bytes and for which module: the line that called `resize_`
(`StorageRecord.resized_by`) and the module of the op recorded next, which the bytes were
re-allocated for (FSDP2's copy-out into them, in the module's pre-forward or pre-backward hook).

A backward op's module is its forward op's, as analysis.ops.step_ops attributes it: the forward
op that made the autograd node it runs in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..capture.records import BACKWARD, BUILDS_GRAPH, Frame, Trace

__all__ = ["Reallocation", "Reallocations"]

# a library's file is shown from its package down (torch/distributed/fsdp/...), a user's whole
_SITE = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep


@dataclass(frozen=True, slots=True)
class Reallocation:
    """A storage re-allocated between ops: by the line `by`, before op `next_op` (a trace
    index; None: no op followed) of `module` in `phase`."""

    by: Frame
    next_op: int | None
    module: str | None
    phase: str | None

    @property
    def where(self) -> str:
        """The line that re-allocated it, as a Frame prints (a library's from its package)."""
        path = self.by.filename
        if path.startswith(_SITE):
            path = path[len(_SITE):]
        return f"{path}:{self.by.lineno} in {self.by.function}"

    def describe(self) -> str:
        """'resize_ at torch/distributed/fsdp/_fully_shard/_fsdp_param.py:1303 in alloc_storage,
        for module layers.3's backward'"""
        if self.module is not None:
            target = f", for module {self.module}'s {self.phase}"
        else:
            target = f", in the {self.phase}" if self.phase else ""
        return f"resize_ at {self.where}{target}"


class Reallocations:
    """The re-allocations of one trace, looked up by storage id (the forward ops that own the
    backward's nodes are indexed once, at the first backward lookup)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self._node_modules: dict | None = None  # seq_nr -> module of the forward op owning it

    def of(self, sid: int) -> Reallocation | None:
        """How storage `sid` was re-allocated; None: an op made it."""
        s = self.trace.storages[sid]
        if s.resized_by is None:
            return None
        ops = self.trace.ops
        nxt = (s.created_by + 1) if s.created_by is not None else 0
        if nxt >= len(ops):
            return Reallocation(s.resized_by, None, None, None)
        return Reallocation(s.resized_by, nxt, self._module_of(nxt), ops[nxt].phase)

    def _module_of(self, index: int) -> str | None:
        r = self.trace.ops[index]
        if r.module is not None or r.phase != BACKWARD:
            return r.module
        if self._node_modules is None:
            found: dict = {}
            for f in self.trace.ops:
                if f.owns_node and (f.phase in BUILDS_GRAPH or f.recompute):
                    found.setdefault(f.seq_nr, f.module)
            self._node_modules = found
        return self._node_modules.get(r.seq_nr)
