"""Step time on a named GPU: each kernel priced alone (analysis/kernel_cost.py), then scheduled on
the host that launches them and on the GPU's streams.

Views and metadata ops launch nothing.

The host issues ops one after another (eager PyTorch) and the GPU runs them in order on one stream,
starting each when the host has launched it and the previous one has finished; a read of a GPU value
on the host (`.item()`) waits for the GPU. The step takes until both are done, so a step of many
small ops is host-bound, as real eager steps are.

Collectives of a distributed step (`comm`: op -> seconds on the interconnect, from
analysis.collectives) run on their process group's NCCL stream (ProcessGroupNCCL keeps one per
group: FSDP's and TP's collectives run side by side, one group's in order): a collective starts
when the host has issued it, its group's stream is free and the ops that wrote its inputs are
done; an op that reads what a collective wrote waits for it. Ops issued on another CUDA stream (the trace records each op's stream: FSDP2 casts the
parameters to their compute dtype and copies them in for the all-gather on its all-gather
copy-in stream, and copies gradients in for the reduce-scatter and casts / accumulates the
reduced shards on its reduce-scatter stream) run in that stream's own queue, not behind the
compute stream's: so the all-gather of the next block overlaps this block's compute, as FSDP2
schedules it, and a tensor-parallel all-reduce whose output the next op needs is exposed. A
stream also waits for the events it was made to wait on (`OpRecord.waits`: the op starts no
earlier than the ops marked by them end), which is how FSDP2 bounds its prefetching: the next
all-gather's copy-in and collective wait for an earlier block's copy-out event, and the
reduce-scatter waits for the compute stream's queue (`wait_stream`). A collective issued on a
side stream waits for that stream's queue and holds it until it ends (ProcessGroupNCCL orders its
NCCL stream after the issuing stream, and for async_op=False distributed_c10d calls work.wait(),
which blocks the current CUDA stream until the collective completes: FSDP2's all-gathers in
forward and its reduce-scatters are issued so); one on the default stream waits only for its
inputs (a reader of its output waits for it). While a collective runs it holds NCCL_SMS
of the GPU's SMs, and compute overlapped with it runs on the others (slower by that share).
`exposed_comm` is the time compute waited on collectives; `comm_overlap` the share of
communication hidden behind compute.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from ..capture.records import Trace
from ..devices.efficiency import HOST_OP_S, HOST_VIEW_S, NCCL_SMS
from .kernel_cost import TENSOR_CORE, kernel_of, kernel_time
from .op_classes import launches_kernel, op_class

__all__ = ["StepTime", "estimate_step_time", "kernel_seconds"]

_ITEM = torch.ops.aten._local_scalar_dense


def kernel_seconds(op, gpu) -> tuple[float, bool]:
    """(seconds on the GPU, whether every constant used was measured on it) of one eager op's
    kernel (analysis.kernel_cost prices it)."""
    return kernel_time(kernel_of(op), gpu)


@dataclass
class StepTime:
    seconds: float
    gpu_busy: float                 # sum of kernel times
    host: float                     # host time to issue the step's ops
    by_phase: dict                  # phase -> seconds of the step's wall time
    op_seconds: list = field(repr=False, default_factory=list)   # per op, GPU time (all runs)
    mfu: float = 0.0
    calibrated: bool = False
    bound: str = ""                 # "gpu", or "host" when the GPU idles half the step or more
    recompute: float = 0.0          # GPU seconds of ops recomputed by activation checkpointing
    comm: float = 0.0               # seconds of collectives on the interconnect
    exposed_comm: float = 0.0       # seconds compute waited for collectives

    @property
    def comm_overlap(self) -> float:
        """Share of the collectives' time hidden behind compute (1 without collectives)."""
        return 1.0 - self.exposed_comm / self.comm if self.comm else 1.0

    def to_dict(self) -> dict:
        d = {"seconds": self.seconds, "gpu_busy": self.gpu_busy, "host": self.host,
             "by_phase": self.by_phase, "mfu": self.mfu, "calibrated": self.calibrated,
             "bound": self.bound, "recompute": self.recompute}
        if self.comm:
            d.update(comm=self.comm, exposed_comm=self.exposed_comm,
                     comm_overlap=self.comm_overlap)
        return d


def estimate_step_time(ops: list, trace: Trace, gpu, comm: dict | None = None,
                       comm_streams: dict | None = None, compiled=None) -> StepTime:
    """Wall time of a step's ops (analysis.ops.Op, in order) on `gpu` (a devices.gpus.GPU).

    comm: op index (in the step) -> seconds of that collective on the interconnect.
    comm_streams: op index -> the NCCL stream it runs on (its process group,
    analysis.collectives.Collective.stream); collectives of one stream run in order, those of
    different streams side by side. Without it, every collective shares one stream.
    compiled: an inductor-compiled step's analysis.compiled_time.CompiledSchedule: the generated
    kernels issued between the ops (on the compute stream, after the kernels before them and
    the collectives whose outputs they read), and the host cost of the ops its wrappers run."""
    comm = comm or {}
    comm_streams = comm_streams or {}
    comm_at: dict = {}    # NCCL stream -> when its last collective ends
    comm_total = exposed = 0.0
    side_t: dict = {}     # stream (other than the default) -> when its last op is done
    dataflow = bool(comm) or any(op.record.stream or op.record.waits for op in ops)
    end: dict = {}        # trace op index -> when its stream had done it (what events mark)
    collectives: set = set()   # trace op indices of the collectives
    held: dict = {}       # stream -> the waits of its ops that launched nothing, not yet applied
    ready: dict = {}     # storage -> when the collective that last wrote it is done
    written: dict = {}   # storage -> when the op that last wrote it is done
    intervals: list = []   # (start, end) when some collective runs: ordered, disjoint
    first = 0              # the first of them not over before the compute stream's time
    host = gpu_t = busy = recompute = 0.0
    calibrated = True
    op_seconds = []
    phase_end: dict = {}
    phase_spans: dict = {}  # phase -> wall time from the previous op's end to its ops' ends
    last_end = 0.0

    def span(phase: str, end: float) -> float:
        nonlocal last_end
        now = max(end, last_end)
        phase_spans[phase] = phase_spans.get(phase, 0.0) + now - last_end
        last_end = now
        return end
    model_dtype = None
    total_flops = 0
    storages = trace.storages
    # share of the SMs a running collective holds; while two groups' collectives run at once,
    # compute is slowed as by one (their spans are merged: a lower bound on the slowdown)
    slow = NCCL_SMS / gpu.sms if comm else 0.0
    launches = compiled.launches if compiled is not None else {}
    host_of = compiled.host if compiled is not None else {}

    def issue(launch) -> None:
        """A generated kernel (or a compiled graph's call, host work alone) of a compiled step."""
        nonlocal host, gpu_t, busy, total_flops, calibrated, exposed
        host += launch.host * launch.runs
        if launch.kernel is None:
            return
        t, measured = kernel_time(launch.kernel, gpu)
        t *= launch.runs
        calibrated &= measured
        total_flops += launch.kernel.flops * launch.runs
        start = max(gpu_t, host)
        if dataflow:
            waits = max((max(ready.get(s, 0.0), written.get(s, 0.0)) for s in launch.args),
                        default=0.0)
            if waits > start:
                if any(ready.get(s, 0.0) > start for s in launch.args):
                    exposed += waits - start
                start = waits
        gpu_t = start + t
        busy += t
        if dataflow:
            for s in launch.writes:
                written[s] = gpu_t
        phase_end[launch.phase] = span(launch.phase, max(gpu_t, host))

    for position, op in enumerate(ops):
        for launch in launches.get(position, ()):
            issue(launch)
        func = op.record.func
        kernel = launches_kernel(func)
        # an op of a repeated micro-batch runs op.runs times: counted back to back (the block's
        # own order of host and GPU work is not replayed op.runs times)
        runs = op.runs
        host += (host_of[position] if position in host_of else
                 HOST_OP_S if kernel else HOST_VIEW_S) * runs
        t = 0.0
        total_flops += op.total_flops or 0
        rec = op.record
        stream = rec.stream
        # the events this op's stream waits on: it starts no earlier than the ops they mark end
        # (those a stream waited on before ops that launch nothing hold for its next kernel)
        marks = held.pop(stream, ()) + rec.waits if held else rec.waits
        after = max((end.get(w, 0.0) for w in marks), default=0.0)
        c = comm.get(op.index)
        if c is not None:
            nccl = comm_streams.get(op.index, "")
            start = max(comm_at.get(nccl, 0.0), host, after,
                        side_t.get(stream, 0.0) if stream else 0.0,
                        *(written.get(r.storage, 0.0) for r in op.inputs),
                        *(ready.get(r.storage, 0.0) for r in op.inputs))   # another group's
            comm_t = comm_at[nccl] = start + c
            first = min(first, _occupy(intervals, start, comm_t))
            comm_total += c
            for r in op.outputs:
                ready[r.storage] = comm_t
            if stream:
                side_t[stream] = comm_t
            end[rec.index] = comm_t
            collectives.add(rec.index)
            op_seconds.append(0.0)
            phase_end[op.phase] = span(op.phase, max(gpu_t, host, comm_t))
            continue
        if kernel:
            t, measured = kernel_seconds(op, gpu)
            t *= runs
            calibrated &= measured
            if op_class(func) == "matmul" and model_dtype is None and op.inputs:
                model_dtype = op.inputs[0].dtype
            if stream:
                # another stream's queue (FSDP2's copy-in / reduce-scatter streams): it waits for
                # its inputs and its events, not for the compute stream's queue
                start = max(side_t.get(stream, 0.0), host, after,
                            *(written.get(r.storage, 0.0) for r in op.inputs),
                            *(ready.get(r.storage, 0.0) for r in op.inputs))
                side_t[stream] = start + t
                busy += t
                for r in op.outputs:
                    written[r.storage] = side_t[stream]
                end[rec.index] = side_t[stream]
                op_seconds.append(t)
                phase_end[op.phase] = span(op.phase, max(gpu_t, host, side_t[stream]))
                continue
            start = max(gpu_t, host)
            waits = max((max(ready.get(r.storage, 0.0), written.get(r.storage, 0.0))
                         for r in op.inputs), default=0.0) if dataflow else 0.0
            waits = max(waits, after)
            if waits > start:
                if any(ready.get(r.storage, 0.0) > start for r in op.inputs) or \
                        any(w in collectives and end[w] > start for w in marks):
                    exposed += waits - start
                start = waits
            if slow and intervals:
                while first < len(intervals) and intervals[first][1] <= start:
                    first += 1          # compute starts only move forward
                t = _stretched(start, t, intervals, slow, first)
            gpu_t = start + t
            busy += t
            if op.recompute:
                recompute += t
            if dataflow:
                for r in op.outputs:
                    written[r.storage] = gpu_t
        elif marks:   # no kernel: the stream's next kernel waits for these events
            held[stream] = marks
        end[rec.index] = max(side_t.get(stream, 0.0) if stream else gpu_t,
                             after if not kernel else 0.0)
        if func.overloadpacket is _ITEM and op.inputs and op.inputs[0].storage >= 0 \
                and storages[op.inputs[0].storage].device.type == "cuda":
            host = max(host, gpu_t)  # .item() waits for the GPU
        op_seconds.append(t)
        phase_end[op.phase] = span(op.phase, max(gpu_t, host))
    for launch in launches.get(len(ops), ()):
        issue(launch)
    total = max(gpu_t, host, *comm_at.values(), *side_t.values())
    by_phase, start = {}, 0.0
    if "other" not in phase_end:
        for phase in ("forward", "backward", "optimizer"):
            if phase in phase_end:
                by_phase[phase] = phase_end[phase] - start
                start = phase_end[phase]
    else:  # a user's step interleaves its phases: each phase's stretches, added up
        by_phase = phase_spans
    peak = gpu.peak(TENSOR_CORE.get(model_dtype, "fp32")) or gpu.peak("fp32")
    mfu = (total_flops / total / peak) if total and peak else 0.0
    # host-bound: the GPU waits for launches more than half the step
    return StepTime(total, busy, host, by_phase, op_seconds, mfu, calibrated,
                    "gpu" if busy >= total / 2 else "host", recompute, comm_total, exposed)


def _occupy(intervals: list, a: float, b: float) -> int:
    """Add a collective's run (a, b) to `intervals` (ordered, disjoint (start, end) spans when
    some collective runs), merging the spans it overlaps; the index of the span that holds it.
    Collectives of one stream come in order and never overlap, so this appends; those of another
    stream (TP's beside FSDP's) can start before or during earlier ones."""
    if not intervals or a >= intervals[-1][1]:
        intervals.append((a, b))
        return len(intervals) - 1
    i = bisect.bisect_right(intervals, a, key=lambda span: span[1])    # first ending after a
    j = bisect.bisect_left(intervals, b, key=lambda span: span[0])     # first starting >= b
    if i < j:
        a, b = min(a, intervals[i][0]), max(b, intervals[j - 1][1])
    intervals[i:j] = [(a, b)]
    return i


def _stretched(start: float, t: float, intervals: list, slow: float, first: int = 0) -> float:
    """Duration of a kernel of `t` seconds alone, started at `start`, when it runs at (1 - slow)
    of its speed while one of the collectives `intervals[first:]` ((start, end), in order, not
    overlapping each other) runs."""
    work, now = t, start
    for a, b in intervals[first:]:
        if b <= now:
            continue
        if a > now:                      # full speed until the collective starts
            step = min(work, a - now)
            work -= step
            now += step
            if work <= 0:
                break
        step = min(work, (b - now) * (1 - slow))   # reduced speed while it runs
        work -= step
        now += step / (1 - slow)
        if work <= 0:
            break
    return now + work - start
