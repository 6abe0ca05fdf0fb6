"""What torch.cuda would report for the traced steps: the caching allocator replayed over them.

The trace gives every storage's size and lifetime; real CUDA memory adds what the allocator and the
libraries do with them:
- the caching allocator (analysis.allocator): 512-byte rounding, 2 MiB / 20 MiB segments, splitting,
  and the cache that keeps freed segments reserved;
- the cuBLAS workspace: the first matmul on a stream allocates it through the caching allocator and
  keeps it (CublasHandlePool.cpp, parseChosenWorkspaceSize: 32 MiB on compute capability 9.x, 10.x
  and 12.x, else 8 MiB + 128 KiB; cuBLASLt shares it by default, TORCH_CUBLASLT_UNIFIED_WORKSPACE);
- the CUDA context, outside the allocator: what nvidia-smi shows beyond max_memory_reserved;
- streams: each storage is allocated on the stream of the op that made it (a distributed CUDA
  profile tells FSDP2's copy-in and reduce-scatter streams from the compute stream), or, re-
  allocated by `resize_` between ops, on the stream current then (StorageRecord.stream: FSDP2's
  re-unshards, on the compute stream); the allocator keeps each stream's freed blocks for that
  stream alone (analysis.allocator).

The run replayed is the validation harness's: the model and inputs are created, then step 1, then
the steady step twice (the allocator's cache reaches its steady state on the second). `max_*` are
over the whole run (what torch reports without a reset); `steady_*` are over the last step (what it
reports after torch.cuda.reset_peak_memory_stats() following warm-up steps).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from ..capture.records import Trace
from ..devices.gpus import cuda_context_bytes
from .allocator import AllocatorConfig, simulate
from .events import device_events, live_after
from .op_classes import MATMUL
from .reallocations import Reallocations
from .steps import step_views

__all__ = ["CudaMemory", "predict_cuda_memory", "cublas_workspace_bytes"]


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    if compute_capability[0] in (9, 10, 12):
        return 32 << 20
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class CudaMemory:
    max_allocated: int       # torch.cuda.max_memory_allocated() over the run
    max_reserved: int        # torch.cuda.max_memory_reserved() over the run
    steady_allocated: int    # ... over the last steady step (after a peak reset)
    steady_reserved: int
    fragmentation: float     # 1 - allocated / reserved when allocated memory peaks
    context_bytes: int       # outside the allocator
    capacity: int | None     # the GPU's memory
    oom: bool                # the allocator could not satisfy a request within capacity
    oom_at: str | None       # which op / phase hit it
    settings: str = ""       # the allocator settings replayed (PYTORCH_ALLOC_CONF form)
    # max_reserved of the same replay with every allocation on one stream (None: the run has
    # one stream), replayed when `stream_cached` is first read: the layout search reads only
    # the peaks, and a second replay of a 70B rank's step costs it up to a second
    one_stream_reserved: Callable[[], int] | None = field(default=None, repr=False,
                                                         compare=False)

    @cached_property
    def stream_cached(self) -> int:
        """max_reserved beyond what the same replay with every allocation on one stream
        reserves: the side streams' own caches (FSDP2's copy-in and reduce-scatter buffers);
        0 on one stream."""
        return 0 if self.one_stream_reserved is None else \
            self.max_reserved - self.one_stream_reserved()

    @property
    def nvidia_smi(self) -> int:
        """What nvidia-smi would show for this process at the peak."""
        return self.max_reserved + self.context_bytes


@dataclass(frozen=True)
class _Labels:
    """What names each of `_events`' events, kept as the op index of each event and where each
    run begins: the text is made by `at` for the one event that runs out of memory (a string per
    event cost ~2% of a 70B pipelined candidate, hundreds of thousands of events, to read one)."""

    ops: list             # each event's op index (-1: none)
    starts: list          # (first event, run name) of each run, in order
    cublas: int | None    # the event of cuBLAS's workspace

    def run_of(self, i: int) -> str:
        return self.starts[bisect_right(self.starts, (i, "~")) - 1][1]

    def steady(self, n: int) -> tuple[int, int]:
        """(first, last) event of the replayed steady step (every event if it has none)."""
        first = next((at for at, run in self.starts if run == "step3"), n)
        return (first, n - 1) if first < n else (0, n - 1)

    def at(self, trace: Trace, events: list, i: int) -> str:
        run, op = self.run_of(i), self.ops[i]
        if i == self.cublas:
            return "cuBLAS workspace"
        if run == "setup":
            return run
        key, nbytes = events[i][:2]
        if nbytes is not None and trace.storages[key[1]].resized_by is not None:
            return f"{run}: {Reallocations(trace).of(key[1]).describe()}"  # not made by op
        return f"{run}: {trace.ops[op].name}" if 0 <= op < len(trace.ops) else run


def _events(trace: Trace, gpu=None):
    """(key, nbytes) / (key, None) for setup, step 1 and the steady step twice, plus _Labels."""
    storages, device = trace.storages, trace.device
    views = step_views(trace)
    steady = views[max(views)]
    out, ops, starts, cublas = [], [], [(0, "setup")], None
    # key[1] -> the key of the latest allocation event with that key[1]: what a free of a
    # storage alive before its step frees (a scan back over the events per such free was
    # quadratic: seconds at a 70B step's hundreds of thousands of events)
    latest: dict = {}
    for sid in sorted(views[1].initial):  # the model and inputs, made before the first step
        s = storages[sid]                  # (or by a setup step: a rank's parallelisation)
        if s.device == device:
            out.append((("setup", s.id), s.nbytes))
            latest[s.id] = ("setup", s.id)
            ops.append(-1)
    workspace_at = None
    if gpu is not None:  # the first matmul on the stream allocates cuBLAS's workspace
        workspace_at = next((i for i in views[1].ops
                             if trace.ops[i].func.overloadpacket in MATMUL), None)
    successors = _successors(trace, views[1], steady) if steady is not views[1] else {}
    for run, view in (("step1", views[1]), ("step2", steady), ("step3", steady)):
        starts.append((len(out), run))
        live_keys = {}
        freed_successors: set = set()  # step 2's leftovers step 3 has freed (_successors)
        for e, _, sid, delta in device_events(trace, view):
            op = view.events[e][0]
            if delta > 0:
                key = (run, sid)
                live_keys[sid] = key
                stream = storages[sid].stream
                if stream is None:
                    stream = trace.ops[op].stream if 0 <= op < len(trace.ops) else 0
                out.append((key, storages[sid].nbytes, stream))
                latest[sid] = key
            else:
                key = live_keys.pop(sid, None)
                if key is None and run == "step3" and sid in successors:
                    # what step 1 left and step 2 freed: step 3 frees what step 2 left instead
                    key = ("step2", successors[sid])
                    if key in freed_successors:
                        continue  # several of step 1's stood for this one of step 2
                    freed_successors.add(key)
                if key is None:  # alive before this step: setup, or a previous step's state
                    key = latest.get(sid, ("setup", sid))
                out.append((key, None))
            ops.append(op)
            if run == "step1" and op == workspace_at and delta > 0:
                out.append((("cublas", 0), cublas_workspace_bytes(gpu.compute_capability)))
                latest[0] = ("cublas", 0)   # (as the scan it replaces found it for storage 0)
                cublas = len(ops)
                ops.append(-1)
                workspace_at = None
    return out, _Labels(ops, starts, cublas)


def _successors(trace: Trace, first, steady) -> dict:
    """What the steady step frees of what the first step left alive, each mapped to what the
    steady step leaves alive in its place: the same device and size, in the order made. The
    replayed third step is the steady step again, so where it frees a storage of step 1 it frees
    step 2's counterpart. (A zero-bubble pipeline schedule keeps its stages' last outputs until
    the next step starts.)"""
    storages = {s.id: s for s in trace.storages}
    end1 = live_after(trace, first)
    end2 = live_after(trace, steady)
    freed = [sid for sid in sorted(end1 - first.initial) if sid not in end2]
    left: dict = {}
    for sid in sorted(end2 - steady.initial):
        left.setdefault((storages[sid].device, storages[sid].nbytes), []).append(sid)
    out = {}
    unpaired = []
    for sid in freed:
        same = left.get((storages[sid].device, storages[sid].nbytes))
        if same:
            out[sid] = same.pop(0)
        else:
            unpaired.append(sid)
    out.update(_successors_by_bytes(storages, unpaired, [s for ss in left.values() for s in ss]))
    return out


def _successors_by_bytes(storages: dict, freed: list, left: list) -> dict:
    """What the same-size pairing left over, paired by bytes when, on a device, step 1's
    leftovers and step 2's add up to the same: several storages of step 1 stand for one of step 2
    (torchao's float8 weights: step 1's all-gathers compute a 4-byte scale per weight, which the
    gathered weights keep; from step 2 on they keep views of the one scale tensor the optimizer's
    `precompute_float8_dynamic_scale_for_fsdp` made). Each freed storage maps to the leftover that
    holds its first byte, in the order made; step 3 frees each leftover once (_events)."""
    out = {}
    for device in {storages[s].device for s in freed}:
        old = sorted(s for s in freed if storages[s].device == device)
        new = sorted(s for s in left if storages[s].device == device)
        if not new or sum(storages[s].nbytes for s in old) != \
                sum(storages[s].nbytes for s in new):
            continue
        start, ends, i = 0, [], 0
        for s in new:
            ends.append((start := start + storages[s].nbytes, s))
        start = 0
        for s in old:
            while start >= ends[i][0]:
                i += 1
            out[s] = ends[i][1]
            start += storages[s].nbytes
    return out


def predict_cuda_memory(trace: Trace, gpu=None, config: AllocatorConfig | None = None) -> CudaMemory:
    events, labels = _events(trace, gpu)
    capacity = None
    context = 0
    if gpu is not None:
        context = cuda_context_bytes(gpu)
        capacity = (gpu.reported_memory_bytes or gpu.memory_bytes) - context
    config = config or AllocatorConfig()
    r = simulate(events, capacity, config)
    one_stream = None
    if any(len(e) > 2 and e[2] for e in events):
        def one_stream():
            return simulate([e[:2] for e in events], capacity, config).max_reserved
    first_step3, last = labels.steady(len(events))
    steady_alloc = max(r.allocated_timeline[first_step3:last + 1], default=r.max_allocated)
    steady_res = max(r.reserved_timeline[first_step3:last + 1], default=r.max_reserved)
    return CudaMemory(r.max_allocated, r.max_reserved, steady_alloc, steady_res, r.fragmentation,
                      context, None if gpu is None else gpu.reported_memory_bytes or gpu.memory_bytes,
                      r.oom, labels.at(trace, events, r.first_oom_event)
                      if r.oom and r.first_oom_event is not None else None, config.describe(),
                      one_stream)
