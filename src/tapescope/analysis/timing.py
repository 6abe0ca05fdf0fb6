"""Step time on a named GPU: each kernel priced alone (analysis/kernel_cost.py), then scheduled on
the host that launches them and on the GPU's streams.

Views, metadata ops, autograd wrappers and ops on host tensors launch nothing (kernel_cost prices
them at 0; they cost the host a dispatch).

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

The host: each op costs it its dispatch (HOST_OP_S, HOST_VIEW_S), and some ops carry Python the
trace does not record (PYTHON_HOST_S: FSDP2's per-group all-gather work). When the host has not
yet issued a kernel its stream could run, the GPU waits (`host_wait`, by phase); a phase is
host-bound when it waits so for half its time or more, and the step's `bound` names what its
wall time goes to most: the compute stream's kernels ("gpu"), waiting for the host ("host") or
for collectives ("communication").

Each second of the compute stream is attributed to the mechanism that priced it, and the waits
to the host or the collectives (`mechanisms`): the error band weighs each mechanism's
uncertainty by them (analysis/time_band.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from ..capture.records import Trace, op_name
from ..devices.efficiency import HOST_OP_S, HOST_VIEW_S, NCCL_SMS, PYTHON_HOST_S
from ..devices.uncertainty import COLLECTIVES, HOST
from .kernel_cost import TENSOR_CORE, kernel_of, kernel_time, step_kernels
from .op_classes import op_class
from .time_band import mechanism_of

__all__ = ["StepTime", "estimate_step_time", "kernel_seconds"]

_ITEM = torch.ops.aten._local_scalar_dense


def kernel_seconds(op, gpu, storages=(), calibration=None) -> tuple[float, bool]:
    """(seconds on the GPU, whether every constant used was measured on it) of one eager op's
    kernel (analysis.kernel_cost prices it, from the calibration file's figures where given); 0
    for an op that launches none."""
    return kernel_time(kernel_of(op, storages), gpu, calibration)


@dataclass
class StepTime:
    seconds: float
    gpu_busy: float                 # sum of kernel times
    host: float                     # host time to issue the step's ops
    by_phase: dict                  # phase -> seconds of the step's wall time
    op_seconds: list = field(repr=False, default_factory=list)   # per op, GPU time (all runs)
    mfu: float = 0.0
    calibrated: bool = False
    bound: str = ""                 # what the wall time goes to most: gpu, host, communication
    recompute: float = 0.0          # GPU seconds of ops recomputed by activation checkpointing
    comm: float = 0.0               # seconds of collectives on the interconnect
    exposed_comm: float = 0.0       # seconds compute waited for collectives
    # the model's measured error on published runs of this kind (analysis.time_band.TimeBand),
    # set by the profile that knows its kind
    band: object = None
    calibration: str | None = None  # the calibration file that priced it (Calibration.label)
    # seconds of the step priced by each mechanism (devices/uncertainty.py names): the compute
    # stream's kernels by what priced them, the waits for the host and for collectives
    mechanisms: dict = field(default_factory=dict)
    host_wait: dict = field(default_factory=dict)   # phase -> seconds the GPU waited for the host
    host_bound_phases: tuple = ()   # phases that waited for the host half their time or more

    @property
    def comm_overlap(self) -> float:
        """Share of the collectives' time hidden behind compute (1 without collectives)."""
        return 1.0 - self.exposed_comm / self.comm if self.comm else 1.0

    def to_dict(self) -> dict:
        d = {"seconds": self.seconds, "gpu_busy": self.gpu_busy, "host": self.host,
             "by_phase": self.by_phase, "mfu": self.mfu, "calibrated": self.calibrated,
             "bound": self.bound, "recompute": self.recompute, "mechanisms": self.mechanisms,
             "host_wait": self.host_wait, "host_bound_phases": list(self.host_bound_phases)}
        if self.comm:
            d.update(comm=self.comm, exposed_comm=self.exposed_comm,
                     comm_overlap=self.comm_overlap)
        if self.band is not None:
            d["error_band"] = self.band.to_dict()
        if self.calibration:
            d["calibration"] = self.calibration
        return d


def estimate_step_time(ops: list, trace: Trace, gpu, comm: dict | None = None,
                       comm_streams: dict | None = None, calibration=None,
                       compiled=None, kernels: tuple | None = None) -> StepTime:
    """Wall time of a step's ops (analysis.ops.Op, in order) on `gpu` (a devices.gpus.GPU).

    comm: op index (in the step) -> seconds of that collective on the interconnect.
    comm_streams: op index -> the NCCL stream it runs on (its process group,
    analysis.collectives.Collective.stream); collectives of one stream run in order, those of
    different streams side by side. Without it, every collective shares one stream.
    calibration: a devices.calibration.Calibration of `gpu`: kernels priced by its measurements
    where it has them, and each kernel-launching op costs the host its measured time.
    compiled: an inductor-compiled step's analysis.compiled_time.CompiledSchedule: the generated
    kernels issued between the ops (on the compute stream, after the kernels before them and
    the collectives whose outputs they read), and the host cost of the ops its wrappers run.
    kernels: per op, the Kernel it launches (None: none), as kernel_cost.step_kernels finds
    them (a Profile's, shared with what else prices its kernels); found here when not given."""
    if kernels is None:
        kernels = step_kernels(ops, trace.storages)
    schedule = _Schedule(gpu, trace.storages, comm or {}, comm_streams or {},
                         dataflow=bool(comm) or any(op.record.stream or op.record.waits
                                                    for op in ops), calibration=calibration)
    launches = compiled.launches if compiled is not None else {}
    host_of = compiled.host if compiled is not None else {}
    for position, op in enumerate(ops):
        for launch in launches.get(position, ()):
            schedule.generated_kernel(launch)
        schedule.run(op, kernels[position], host_of.get(position))
    for launch in launches.get(len(ops), ()):
        schedule.generated_kernel(launch)
    return schedule.result()


class _Schedule:
    """The schedule of one step's ops, op by op, in named steps: the host issues the op
    (`issue`); its stream's event waits (`event_waits`); a collective runs on its NCCL stream
    (`collective`), a kernel on a side stream's queue (`side_stream`) or on the compute stream
    (`compute_stream`, behind its inputs and slowed while collectives hold SMs); `.item()` makes
    the host wait (`host_sync`); each op's end closes its phase (`close_phase`). A compiled
    step's generated kernels run between the ops (`generated_kernel`)."""

    def __init__(self, gpu, storages, comm: dict, comm_streams: dict, dataflow: bool,
                 calibration=None):
        self.gpu, self.storages, self.calibration = gpu, storages, calibration
        self.host_op_s = calibration.host_op_s if calibration is not None else HOST_OP_S
        self.comm, self.comm_streams, self.dataflow = comm, comm_streams, dataflow
        # share of the SMs a running collective holds; while two groups' collectives run at
        # once, compute is slowed as by one (their spans are merged: a lower bound)
        self.slow = NCCL_SMS / gpu.sms if comm else 0.0
        # clocks
        self.host = 0.0            # when the host has issued the ops so far
        self.gpu_t = 0.0           # when the compute stream has run its kernels so far
        self.side_t: dict = {}     # stream (other than the default) -> when its last op is done
        self.comm_at: dict = {}    # NCCL stream -> when its last collective ends
        # what later ops wait for
        self.end: dict = {}        # trace op index -> when its stream had done it (events)
        self.collective_ops: set = set()   # trace op indices of the collectives
        self.held: dict = {}       # stream -> waits of its no-kernel ops, for its next kernel
        self.ready: dict = {}      # storage -> when the collective that last wrote it is done
        self.written: dict = {}    # storage -> when the op that last wrote it is done
        self.intervals: list = []  # (start, end) when some collective runs: ordered, disjoint
        self.first = 0             # the first of them not over before the compute stream's time
        # totals
        self.busy = self.recompute = self.comm_total = self.exposed = 0.0
        self.mechanisms: dict = {}    # mechanism -> compute-stream seconds it priced
        self.host_wait: dict = {}     # phase -> seconds the compute stream waited for the host
        self.calibrated = True
        self.op_seconds: list = []
        self.model_dtype = None
        self.total_flops = 0
        # phases
        self.phase_end: dict = {}
        self.phase_spans: dict = {}   # phase -> wall time from the previous op's end to its end
        self.last_end = 0.0

    # ---- one op ---------------------------------------------------------------------------
    def run(self, op, kernel, host_s: float | None = None) -> None:
        """One op and the Kernel it launches (None: none); `host_s`: its host cost where a
        compiled wrapper issues it (not eager's)."""
        self.issue(op, kernel is not None, host_s)
        marks, after = self.event_waits(op)
        seconds = self.comm.get(op.index)
        if seconds is not None:   # (a repeated micro-batch's collective: once per run)
            self.collective(op, seconds * op.runs, after)
            return
        t = 0.0
        if kernel is not None:
            t, mechanism = self.price(op, kernel)
            if op.record.stream:
                self.side_stream(op, t, after)
                return
            t = self.compute_stream(op, t, marks, after, mechanism)
        elif marks:   # no kernel: the stream's next kernel waits for these events
            self.held[op.record.stream] = marks
        stream = op.record.stream
        self.end[op.record.index] = max(self.side_t.get(stream, 0.0) if stream else self.gpu_t,
                                        after if kernel is None else 0.0)
        self.host_sync(op)
        self.op_seconds.append(t)
        self.close_phase(op.phase, max(self.gpu_t, self.host))

    def issue(self, op, kernel: bool, host_s: float | None = None) -> None:
        """The host's dispatch of the op (runs times for a repeated micro-batch's op: counted
        back to back); `kernel`: whether it launches a GPU kernel (not a view, metadata op or
        autograd wrapper, nor an op on host tensors only: the optimizer's CPU step counters)."""
        if host_s is None:
            host_s = self.host_op_s if kernel else HOST_VIEW_S
        host_s += PYTHON_HOST_S.get(op_name(op.record.func).rsplit(".", 1)[0], 0.0)
        self.host += host_s * op.runs
        self.total_flops += op.total_flops or 0

    def event_waits(self, op) -> tuple:
        """(the events its stream waits on, when the ops they mark end): it starts no earlier;
        those a stream waited on before ops that launch nothing hold for its next kernel."""
        marks = self.held.pop(op.record.stream, ()) + op.record.waits if self.held \
            else op.record.waits
        return marks, max((self.end.get(w, 0.0) for w in marks), default=0.0)

    def price(self, op, kernel) -> tuple[float, str]:
        """The op's kernel time (analysis.kernel_cost), times its runs, and the mechanism that
        priced it (analysis.time_band.mechanism_of)."""
        t, measured = kernel_time(kernel, self.gpu, self.calibration)
        self.calibrated &= measured
        if op_class(op.record.func) == "matmul" and self.model_dtype is None and op.inputs:
            self.model_dtype = op.inputs[0].dtype
        return t * op.runs, mechanism_of(kernel, self.gpu.arch)

    def wait_for_host(self, phase: str) -> float:
        """When the compute stream can start its next kernel: after its previous one and the
        host's launch; the time it idles for the launch is the host's (`host_wait`)."""
        if self.host > self.gpu_t:
            self.host_wait[phase] = self.host_wait.get(phase, 0.0) + self.host - self.gpu_t
            return self.host
        return self.gpu_t

    def priced(self, mechanism: str, t: float) -> None:
        self.mechanisms[mechanism] = self.mechanisms.get(mechanism, 0.0) + t

    def _inputs_done(self, op) -> list:
        return [*(self.written.get(r.storage, 0.0) for r in op.inputs),
                *(self.ready.get(r.storage, 0.0) for r in op.inputs)]

    def collective(self, op, seconds: float, after: float) -> None:
        """On its process group's NCCL stream, after its inputs (another group's collective
        included), its events and the side stream that issued it, which it then holds."""
        stream, rec = op.record.stream, op.record
        nccl = self.comm_streams.get(op.index, "")
        start = max(self.comm_at.get(nccl, 0.0), self.host, after,
                    self.side_t.get(stream, 0.0) if stream else 0.0, *self._inputs_done(op))
        done = self.comm_at[nccl] = start + seconds
        self.first = min(self.first, _occupy(self.intervals, start, done))
        self.comm_total += seconds
        for r in op.outputs:
            self.ready[r.storage] = done
        if stream:
            self.side_t[stream] = done
        self.end[rec.index] = done
        self.collective_ops.add(rec.index)
        self.op_seconds.append(0.0)
        self.close_phase(op.phase, max(self.gpu_t, self.host, done))

    def side_stream(self, op, t: float, after: float) -> None:
        """Another stream's queue (FSDP2's copy-in / reduce-scatter streams): it waits for its
        inputs and its events, not for the compute stream's queue."""
        stream = op.record.stream
        start = max(self.side_t.get(stream, 0.0), self.host, after, *self._inputs_done(op))
        done = self.side_t[stream] = start + t
        self.busy += t
        for r in op.outputs:
            self.written[r.storage] = done
        self.end[op.record.index] = done
        self.op_seconds.append(t)
        self.close_phase(op.phase, max(self.gpu_t, self.host, done))

    def compute_stream(self, op, t: float, marks, after: float, mechanism: str) -> float:
        """The compute stream: after the previous kernel and the host's launch, its inputs and
        its events; the wait is exposed communication when a collective held it up. Runs on the
        SMs collectives leave free while they run. Returns its (stretched) time."""
        start = self.wait_for_host(op.phase)
        waits = max((max(self.ready.get(r.storage, 0.0), self.written.get(r.storage, 0.0))
                     for r in op.inputs), default=0.0) if self.dataflow else 0.0
        waits = max(waits, after)
        if waits > start:
            if any(self.ready.get(r.storage, 0.0) > start for r in op.inputs) or \
                    any(w in self.collective_ops and self.end[w] > start for w in marks):
                self.exposed += waits - start
            start = waits
        if self.slow and self.intervals:
            while self.first < len(self.intervals) and self.intervals[self.first][1] <= start:
                self.first += 1          # compute starts only move forward
            t = _stretched(start, t, self.intervals, self.slow, self.first)
        self.gpu_t = start + t
        self.busy += t
        self.priced(mechanism, t)
        if op.recompute:
            self.recompute += t
        if self.dataflow:
            for r in op.outputs:
                self.written[r.storage] = self.gpu_t
        return t

    def generated_kernel(self, launch) -> None:
        """A kernel an inductor wrapper launches (or a compiled graph's call: host work alone),
        on the compute stream after the kernels before it and what wrote its buffers."""
        self.host += launch.host * launch.runs
        if launch.kernel is None:
            return
        t, measured = kernel_time(launch.kernel, self.gpu, self.calibration)
        t *= launch.runs
        self.calibrated &= measured
        self.total_flops += launch.kernel.flops * launch.runs
        start = self.wait_for_host(launch.phase)
        if self.dataflow:
            waits = max((max(self.ready.get(s, 0.0), self.written.get(s, 0.0))
                         for s in launch.args), default=0.0)
            if waits > start:
                if any(self.ready.get(s, 0.0) > start for s in launch.args):
                    self.exposed += waits - start
                start = waits
        self.gpu_t = start + t
        self.busy += t
        self.priced(mechanism_of(launch.kernel, self.gpu.arch), t)
        if self.dataflow:
            for s in launch.writes:
                self.written[s] = self.gpu_t
        self.close_phase(launch.phase, max(self.gpu_t, self.host))

    def host_sync(self, op) -> None:
        """`.item()` of a GPU tensor waits for the GPU."""
        storages = self.storages
        if op.record.func.overloadpacket is _ITEM and op.inputs and op.inputs[0].storage >= 0 \
                and storages[op.inputs[0].storage].device.type == "cuda":
            self.host = max(self.host, self.gpu_t)

    def close_phase(self, phase: str, end: float) -> None:
        """The op's end closes its phase so far; a phase's span is the wall time from the
        previous op's end to its ops' ends (phases of a user's step interleave)."""
        now = max(end, self.last_end)
        self.phase_spans[phase] = self.phase_spans.get(phase, 0.0) + now - self.last_end
        self.last_end = now
        self.phase_end[phase] = end

    # ---- the step -------------------------------------------------------------------------
    def result(self) -> StepTime:
        total = max(self.gpu_t, self.host, *self.comm_at.values(), *self.side_t.values())
        by_phase, start = {}, 0.0
        if "other" not in self.phase_end:
            for phase in ("forward", "backward", "optimizer"):
                if phase in self.phase_end:
                    by_phase[phase] = self.phase_end[phase] - start
                    start = self.phase_end[phase]
        else:  # a user's step interleaves its phases: each phase's stretches, added up
            by_phase = self.phase_spans
        gpu = self.gpu
        peak = gpu.peak(TENSOR_CORE.get(self.model_dtype, "fp32")) or gpu.peak("fp32")
        mfu = (self.total_flops / total / peak) if total and peak else 0.0
        if self.host >= total and self.host > self.gpu_t and self.phase_end:
            # the host issues the step's last ops after the GPU ran out of work: a host tail
            last = max(self.phase_end, key=self.phase_end.get)
            self.host_wait[last] = self.host_wait.get(last, 0.0) + self.host - self.gpu_t
        waited = sum(self.host_wait.values())
        mechanisms = dict(self.mechanisms)
        if waited:
            mechanisms[HOST] = waited
        if self.exposed:
            mechanisms[COLLECTIVES] = self.exposed
        compute = sum(self.mechanisms.values())
        bound = max((("gpu", compute), ("host", waited), ("communication", self.exposed)),
                    key=lambda kv: kv[1])[0]
        host_bound = tuple(phase for phase, span in by_phase.items()
                           if span > 0 and self.host_wait.get(phase, 0.0) >= span / 2)
        return StepTime(total, self.busy, self.host, by_phase, self.op_seconds, mfu,
                        self.calibrated, bound, self.recompute, self.comm_total, self.exposed,
                        calibration=(self.calibration.label if self.calibration is not None
                                     else None),
                        mechanisms=mechanisms, host_wait=dict(self.host_wait),
                        host_bound_phases=host_bound)


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
