"""The collectives of a distributed step and their time on the interconnect.

A collective is an op of the `c10d` or `_c10d_functional` namespace in the trace (FSDP2 issues
c10d ops through the process group; DTensor issues functional ones). Capture records, per
collective op, the process group it ran on, and per group the mesh dimensions it spans and its
global ranks (`DistributedFacts.collective_groups` and `.groups`, distributed/profile.py).

Bytes are the collective's size as nccl-tests count it: the gathered output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce or broadcast. Time is the ring algorithm's
(NCCL's for large messages), as NCCL's own tuning model (src/graph/tuning.cc) writes it: a
latency of RING_BASE_LATENCY_S plus one hop latency per ring step (n - 1 steps for an all-gather
or reduce-scatter, 2 (n - 1) for an all-reduce; the steps that cross nodes at the network's hop
latency), plus the bytes through each rank's link - S (n - 1) / n for an all-gather or
reduce-scatter of S bytes, twice that for an all-reduce - at the bus bandwidth NCCL reaches.

Topology: ranks fill nodes in order (`gpus_per_node` consecutive ranks to a node), as torchrun
and init_device_mesh lay them out. A group inside one node runs at NVLink (or PCIe) speed. A ring
that spans nodes leaves each node once per ring, and NCCL runs one ring per NIC: a group with k
ranks in each node has k NICs per node (one per GPU in the reference servers, or the node's
network shared by its GPUs) for the node's crossing, so its bus bandwidth is
min(NVLink's, k x each GPU's network share): FSDP over whole nodes runs near NVLink speed on a
DGX, a replicate group of one GPU per node at one NIC's.

Efficiencies: NCCL's all-gather / reduce-scatter bus bandwidth on 8 H100 SXM or A100 SXM over
NVSwitch reaches about 80% of the NVLink rate in NVIDIA's published nccl-tests runs, and about
90% of an InfiniBand NIC across nodes (priors until measured on a cluster, docs/distributed.md).
Checked against NCCL's maintainer on 8 x H100 (NVIDIA/nccl-tests#212, #326): "450GB/s is the line
rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"
and "360 GB/s is exactly what we'd expect on H100" for all_gather / ring all_reduce bus bandwidth;
0.8 x 450 = 360 GB/s here.

All-reduce inside one node on NVLink 4/5 NVSwitch (Hopper, Blackwell) runs NVLink SHARP (NVLS)
by default, which reduces in the switch: "On 8 GPUs, you should reach a peak busBw of ~480GB/s
(algbw ~275GB/s)" (same thread, #212), i.e. each rank's bytes at 275 / 450 = 0.61 of the line
rate whatever the group size (the switch does the reduction: each rank sends and receives its
tensor once). NCCL's tuner takes the faster of ring and NVLS for each call, so does this model
(ring wins for 2 ranks: 360 GB/s algbw). A100's NVSwitch has no SHARP: ring only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.records import op_name

__all__ = ["Collective", "CollectiveRow", "collectives", "collective_table", "collective_seconds",
           "KINDS", "NVLINK_EFFICIENCY", "NETWORK_EFFICIENCY", "NVLS_ALGBW_SHARE",
           "RING_BASE_LATENCY_S",
           "HOP_LATENCY_S"]

NVLINK_EFFICIENCY = 0.8      # intra-node bus bandwidth NCCL reaches / link rate (prior)
NETWORK_EFFICIENCY = 0.9     # inter-node (prior)
# NVLS all-reduce: the tensor's bytes per rank over the NVLink line rate (nccl-tests#212: algbw
# ~275 GB/s of 450 on 8 H100)
NVLS_ALGBW_SHARE = 275 / 450
# NCCL src/graph/tuning.cc (2.x), ring algorithm, Simple protocol (large messages): baseLat 8.4 us;
# hwLat per step NVLink 3.4 us, PCI 5.7 us, NET 6.6 us
RING_BASE_LATENCY_S = 8.4e-6
HOP_LATENCY_S = {"nvlink": 3.4e-6, "pci": 5.7e-6, "net": 6.6e-6}

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
    # the NCCL stream it runs on: its process group's name. ProcessGroupNCCL takes a stream
    # from the pool for each communicator it makes and keeps it per process group
    # (initNCCLComm: ncclStreams_.emplace(deviceKey, getStreamFromPool(...))), so collectives
    # of different groups (FSDP's and TP's) run side by side, those of one group in order
    stream: str = ""
    # times it runs in the step: >1 inside a traced micro-batch (or pipeline block) that later
    # ones were proven to repeat (Trace.repeated, analysis.ops.Op.runs); `seconds` is one run's
    runs: int = 1


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
    """(seconds, spans nodes) of one collective of `nbytes` on the ranks `group_ranks` (module
    doc: ring time with NCCL's latencies, bus bandwidth by topology)."""
    ranks = list(group_ranks)
    n = len(ranks)
    per_node: dict = {}
    for r in ranks:
        per_node[r // ic.gpus_per_node] = per_node.get(r // ic.gpus_per_node, 0) + 1
    nodes = len(per_node)
    if inter_node is None:
        inter_node = nodes > 1
    if n <= 1:
        return 0.0, inter_node
    hop = HOP_LATENCY_S["pci" if "PCIe" in ic.intra_kind else "nvlink"]
    bw = ic.intra_node * NVLINK_EFFICIENCY
    per_step = 2 if kind == "all_reduce" else 1
    steps, net_steps = per_step * (n - 1), 0
    if inter_node:
        from ..devices.gpus import DEFAULT_INTER_NODE_BANDWIDTH

        nics = min(per_node.values()) if nodes > 1 else 1   # one ring per NIC, k NICs a node
        net = (ic.inter_node or DEFAULT_INTER_NODE_BANDWIDTH) * NETWORK_EFFICIENCY
        bw = min(bw, nics * net)
        net_steps = per_step * (max(nodes, 2) - 1)
    latency = RING_BASE_LATENCY_S + (steps - net_steps) * hop + net_steps * HOP_LATENCY_S["net"]
    ring = nbytes * _TRAFFIC.get(kind, lambda n: 1.0)(n) / bw + latency
    if kind == "all_reduce" and not inter_node and _has_nvls(ic):
        # NVLink SHARP: the switch reduces; NCCL's tuner takes whichever is faster
        nvls = nbytes / (ic.intra_node * NVLS_ALGBW_SHARE) + RING_BASE_LATENCY_S + 2 * hop
        return min(ring, nvls), inter_node
    return ring, inter_node


def _has_nvls(ic) -> bool:
    """NVLink SHARP needs third-generation NVSwitch (NVLink 4, Hopper) or later."""
    return "NVSwitch" in ic.intra_kind and ic.intra_kind.startswith(("NVLink 4", "NVLink 5"))


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


def measured_seconds(kind: str, nbytes: int, n: int, calibration) -> float | None:
    """A collective inside one node priced by a calibration file's NCCL measurements (made over
    the GPUs of one node): the nearest measured one of its kind in (ranks, bytes), scaled by the
    bytes through each rank's link; None when the file has none of that kind."""
    from ..devices.calibration import nearest

    p = nearest((c for c in calibration.nccl if c.collective == kind),
                lambda c: (c.ranks, c.bytes), (n, max(nbytes, 1)))
    if p is None:
        return None
    traffic = _TRAFFIC.get(kind, lambda n: 1.0)
    return p.seconds * (nbytes * traffic(n)) / (p.bytes * traffic(p.ranks))


def collectives(ops: list, groups: dict, by_op: dict, gpu=None, ic=None,
                calibration=None) -> list[Collective]:
    """The collectives among a step's ops (analysis.ops.Op), with their time on `gpu`'s
    interconnect, or on `ic` (a devices.gpus.Interconnect: a cluster of your own); 0 without
    either. With a calibration (devices.calibration.Calibration), those inside one node take
    its measured NCCL times (measured_seconds); those across nodes keep the network model.
    groups: group name -> its label and global ranks (distributed.groups.GroupInfo); by_op: op
    index -> the name of the group the collective ran on."""
    from ..devices.gpus import interconnect
    if ic is None and gpu is not None:
        ic = interconnect(gpu)
    out = []
    for op in ops:
        rec = op.record
        kind = kind_of(rec.func)
        if kind is None:
            continue
        g = groups.get(by_op.get(rec.index))
        ranks = tuple(g.ranks) if g is not None else ()
        size = len(ranks) or 1
        nbytes = _size(kind, rec, size)
        seconds, inter = collective_seconds(kind, nbytes, ranks, ic) if ic is not None \
            else (0.0, False)
        if calibration is not None and calibration.nccl and not inter and size > 1:
            seconds = measured_seconds(kind, nbytes, size, calibration) or seconds
        out.append(Collective(op.index, kind, g.label if g is not None else "?", size, nbytes,
                              op.phase, op.module, inter, seconds, str(by_op.get(rec.index, "")),
                              op.runs))
    return out


def collective_table(items: list[Collective], gpu=None) -> list[CollectiveRow]:
    """Collectives grouped by kind, group and size, largest total time (else bytes) first; a
    collective that stands for several runs (Collective.runs) counts, and takes time, for each,
    as the step time prices it."""
    from ..devices.gpus import interconnect

    ic = interconnect(gpu) if gpu is not None else None
    rows: dict = {}
    for c in items:
        key = (c.kind, c.group, c.group_size, c.nbytes)
        r = rows.setdefault(key, [0, set(), 0.0, c.inter_node])
        r[0] += c.runs
        r[1].add(c.phase)
        r[2] += c.seconds * c.runs
    out = []
    for (kind, group, size, nbytes), (count, phases, seconds, inter) in rows.items():
        link = "-" if ic is None else (ic.inter_kind if inter else ic.intra_kind)
        out.append(CollectiveRow(kind, group, size, nbytes, count, tuple(sorted(phases)), link,
                                 seconds))
    out.sort(key=lambda r: (r.seconds, r.nbytes * r.count), reverse=True)
    return out
