"""Bytes each op reads and writes: the memory traffic of a roofline model.

An op reads each tensor argument once (but an `out=` argument, which it only writes) and writes
each result once: `numel * itemsize`, capped at
the size of the storage behind it (a broadcast `expand` of a vector reads the vector, not the
broadcast). Views, aliases and uninitialised allocations move nothing. Kernel-internal traffic
(tiling re-reads, a matmul's second pass over an operand) is not modelled here.
"""

from __future__ import annotations

from ..capture.records import OpRecord, Trace
from .op_classes import moves_no_data

__all__ = ["op_traffic"]


def op_traffic(op: OpRecord, trace: Trace) -> tuple[int, int]:
    """(bytes read, bytes written) of one op."""
    func = op.func
    if moves_no_data(func):
        return 0, 0
    storages = trace.storages

    def moved(t):
        return t.nbytes if t.storage < 0 else min(t.nbytes, storages[t.storage].nbytes)

    outputs = op.tensor_outputs()
    inputs = op.tensor_inputs()
    if _has_out_arguments(func):  # `out=` (inductor's extern kernels): written, never read
        written = {t.storage for t in outputs}
        inputs = [t for t in inputs if t.storage not in written]
    return sum(moved(t) for t in inputs), sum(moved(t) for t in outputs)


def _has_out_arguments(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.is_out for a in schema.arguments)
