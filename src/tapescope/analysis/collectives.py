"""The collectives of a distributed step and their time on the interconnect.

A collective is an op of the `c10d` or `_c10d_functional` namespace in the trace (FSDP2 issues
c10d ops through the process group; DTensor issues functional ones). Capture records, per
collective op, the process group it ran on, and per group the mesh dimensions it spans and its
global ranks (`facts["collective_groups"]`, `facts["process_groups"]`, distributed/profile.py).

Bytes are the collective's size as nccl-tests count it: the gathered output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce or broadcast. Time is the ring algorithm's
(NCCL's for large messages): an all-gather or reduce-scatter of S bytes on n ranks moves
S (n - 1) / n through each rank's link, an all-reduce twice that; divided by the bus bandwidth
NCCL reaches on that link, plus a fixed latency. A group whose ranks sit in one node uses NVLink
(or PCIe); one that spans nodes is held to each GPU's share of the network (devices/gpus.py,
INTERCONNECTS). Ranks fill nodes in order (`gpus_per_node` consecutive ranks to a node), as
torchrun and init_device_mesh lay them out.

Efficiency and latency are priors until measured on a cluster (docs/distributed.md): NCCL's
all-reduce bus bandwidth on 8 H100 SXM over NVSwitch reaches about 80-85% of the NVLink rate in
NVIDIA's published nccl-tests runs, and about 90% of an NDR NIC across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.records import op_name

__all__ = ["Collective", "CollectiveRow", "collectives", "collective_table", "collective_seconds",
           "KINDS", "NVLINK_EFFICIENCY", "NETWORK_EFFICIENCY"]

NVLINK_EFFICIENCY = 0.8      # intra-node bus bandwidth NCCL reaches / link rate (prior)
NETWORK_EFFICIENCY = 0.9     # inter-node (prior)
INTRA_LATENCY_S = 10e-6      # per collective (prior)
INTER_LATENCY_S = 25e-6

# op packet name -> kind of collective; ops of these namespaces not listed here (waits, the
# autograd wrappers) are not collectives
KINDS = {
    "c10d.allgather_": "all_gather", "c10d._allgather_base_": "all_gather",
    "c10d.allgather_coalesced_": "all_gather", "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d.reduce_scatter_": "reduce_scatter", "c10d._reduce_scatter_base_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
    "c10d.broadcast_": "broadcast", "c10d.alltoall_": "all_to_all",
    "c10d.alltoall_base_": "all_to_all", "c10d.scatter_": "scatter", "c10d.gather_": "gather",
    "c10d.send": "send", "c10d.recv_": "recv", "c10d.barrier": "barrier",
    "_c10d_functional.all_gather_into_tensor": "all_gather",
    "_c10d_functional.all_gather_into_tensor_out": "all_gather",
    "_c10d_functional.all_gather_into_tensor_coalesced": "all_gather",
    "_c10d_functional.reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional.reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_c10d_functional.all_reduce": "all_reduce", "_c10d_functional.all_reduce_": "all_reduce",
    "_c10d_functional.all_reduce_coalesced": "all_reduce",
    "_c10d_functional.all_reduce_coalesced_": "all_reduce",
    "_c10d_functional.all_to_all_single": "all_to_all",
    "_c10d_functional.broadcast": "broadcast", "_c10d_functional.broadcast_": "broadcast",
}
# which arguments hold the collective's data, by kind (schema argument names)
_OUTPUT_ARGS = ("output_tensor", "output_tensors", "output", "out")
_INPUT_ARGS = ("input_tensor", "input_tensors", "input", "inputs", "tensor", "tensors", "self")
# bytes through each rank's link per byte of the collective, on n ranks (ring)
_TRAFFIC = {
    "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0, "scatter": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n,
    "send": lambda n: 1.0, "recv": lambda n: 1.0, "barrier": lambda n: 0.0,
}


@dataclass(frozen=True)
class Collective:
    """One collective of the step."""

    op: int            # index of the op in the step
    kind: str          # all_gather, reduce_scatter, all_reduce, ...
    group: str         # the mesh dimensions its group spans, e.g. "dp", "tp", "dp+tp"
    group_size: int
    nbytes: int        # the collective's size, per rank (see the module doc)
    phase: str
    module: str | None
    inter_node: bool   # its group spans nodes
    seconds: float     # on the interconnect, alone


@dataclass(frozen=True)
class CollectiveRow:
    """Collectives of one kind, group and size: one row of the table."""

    kind: str
    group: str
    group_size: int
    nbytes: int
    count: int
    phases: tuple
    link: str
    seconds: float     # all of them together

    def to_dict(self) -> dict:
        return {"kind": self.kind, "group": self.group, "group_size": self.group_size,
                "bytes_per_rank": self.nbytes, "count_per_step": self.count,
                "phases": list(self.phases), "link": self.link, "seconds": self.seconds}


def kind_of(func) -> str | None:
    packet = op_name(func).rsplit(".", 1)[0]
    return KINDS.get(packet)


def collective_seconds(kind: str, nbytes: int, group_ranks, ic, inter_node: bool | None = None
                       ) -> tuple[float, bool]:
    """(seconds, spans nodes) of one collective of `nbytes` on the ranks `group_ranks`."""
    n = len(group_ranks)
    if inter_node is None:
        inter_node = len({r // ic.gpus_per_node for r in group_ranks}) > 1
    if n <= 1:
        return 0.0, inter_node
    if inter_node:
        from ..devices.gpus import DEFAULT_INTER_NODE_BANDWIDTH

        bw = (ic.inter_node or DEFAULT_INTER_NODE_BANDWIDTH) * NETWORK_EFFICIENCY
        latency = INTER_LATENCY_S
    else:
        bw, latency = ic.intra_node * NVLINK_EFFICIENCY, INTRA_LATENCY_S
    return nbytes * _TRAFFIC.get(kind, lambda n: 1.0)(n) / bw + latency, inter_node


def _arg_bytes(record, names) -> int:
    total = 0
    schema = record.func._schema.arguments
    for i, arg in enumerate(schema):
        if arg.name not in names:
            continue
        a = record.args[i] if i < len(record.args) else record.kwargs.get(arg.name)
        for t in (a if isinstance(a, tuple) else (a,)):
            for x in (t if isinstance(t, tuple) else (t,)):
                if hasattr(x, "nbytes") and hasattr(x, "storage"):
                    total += x.nbytes
        if total:
            return total
    return total


def _size(kind: str, record, group_size: int) -> int:
    if kind == "all_gather":
        out = _arg_bytes(record, _OUTPUT_ARGS) or sum(o.nbytes for o in record.outputs if o is not None)
        return out or _arg_bytes(record, _INPUT_ARGS) * group_size
    return _arg_bytes(record, _INPUT_ARGS)


def collectives(ops: list, facts: dict, gpu=None) -> list[Collective]:
    """The collectives among a step's ops (analysis.ops.Op), with their time on `gpu`'s
    interconnect (0 without a GPU)."""
    from ..devices.gpus import interconnect

    groups = facts.get("process_groups", {})
    by_op = facts.get("collective_groups", {})
    ic = interconnect(gpu) if gpu is not None else None
    out = []
    for op in ops:
        rec = op.record
        kind = kind_of(rec.func)
        if kind is None:
            continue
        g = groups.get(by_op.get(rec.index), {})
        ranks = tuple(g.get("ranks", ()))
        size = len(ranks) or 1
        nbytes = _size(kind, rec, size)
        seconds, inter = collective_seconds(kind, nbytes, ranks, ic) if ic is not None \
            else (0.0, False)
        out.append(Collective(op.index, kind, g.get("label", "?"), size, nbytes, op.phase,
                              op.module, inter, seconds))
    return out


def collective_table(items: list[Collective], gpu=None) -> list[CollectiveRow]:
    """Collectives grouped by kind, group and size, largest total time (else bytes) first."""
    from ..devices.gpus import interconnect

    ic = interconnect(gpu) if gpu is not None else None
    rows: dict = {}
    for c in items:
        key = (c.kind, c.group, c.group_size, c.nbytes)
        r = rows.setdefault(key, [0, set(), 0.0, c.inter_node])
        r[0] += 1
        r[1].add(c.phase)
        r[2] += c.seconds
    out = []
    for (kind, group, size, nbytes), (count, phases, seconds, inter) in rows.items():
        link = "-" if ic is None else (ic.inter_kind if inter else ic.intra_kind)
        out.append(CollectiveRow(kind, group, size, nbytes, count, tuple(sorted(phases)), link,
                                 seconds))
    out.sort(key=lambda r: (r.seconds, r.nbytes * r.count), reverse=True)
    return out
