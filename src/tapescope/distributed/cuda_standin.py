"""torch.cuda's stream, event and device calls for a machine without a GPU, while a profile runs.

FSDP2 asks the device for its streams and events (`FSDPCommContext.lazy_init` creates the
all-gather and reduce-scatter streams with `torch.cuda.Stream(priority=-1)`; every unshard
records an Event and the compute stream waits on it) and for the current device
(`_get_device_from_mesh` calls `torch.cuda.current_device()`). Without a GPU each of these
calls `torch.cuda._lazy_init()`, which raises "Found no NVIDIA driver on your system". Tracing on
fake CUDA tensors needs none of them to reach a driver: no kernel runs, so nothing needs ordering
while tracing (the order is kept for the timing model, below).

So while a distributed CUDA profile runs, these attributes of `torch.cuda` (and
`torch.accelerator.current_stream`) are replaced by stand-ins that need no driver, and restored
afterwards: current_device, set_device, device_count, is_initialized, Stream, Event,
current_stream, default_stream, stream, synchronize, and get_device_capability (c10d's broadcast
asks it, to decide how NCCL sends fp8), which answers the profiled GPU's compute capability; and
the query `torch.accelerator` answers from (torch_compat.accelerator_query), which answers "cpu" on a machine without a GPU where a GPU job's
answers "cuda" (`fully_shard(model)` without a mesh builds its default mesh on that device). Only
these names are replaced; the fake tensors themselves never touch the driver (FakeTensorMode
runs meta kernels).

The stand-in streams remember which stream is current (`StreamLog`), so the trace knows which ops
FSDP2 issued on its all-gather and reduce-scatter streams, and the waits between them: an Event
marks the last op issued on its stream when it was recorded, and a stream that waits on it
(`wait_event`, `Event.wait`, `wait_stream`) hands the mark to the next op issued on that stream
(`OpRecord.waits`), as CUDA orders a stream's later work after the event. FSDP2 bounds its
prefetching this way: the next all-gather's copy-in and collective wait for an earlier block's
copy-out (`_wait_all_gather_streams_on_event`), and the reduce-scatter stream waits for the
compute stream (`wait_stream(current_stream)`).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch

from ..torch_compat import accelerator_query, patched

__all__ = ["cuda_without_gpu", "StreamLog"]


class StreamLog:
    """The stand-in streams of one profile, and which one is current."""

    def __init__(self):
        self._ids = itertools.count()
        self.default = _Stream(self, priority=0, name="default")
        self.current = self.default
        self.last: dict = {}      # stream id -> index of the last op issued on it
        self.pending: dict = {}   # stream id -> op indices its next op waits for

    def issued(self, stream: int, index: int) -> tuple:
        """The op `index` is issued on `stream`: the op indices it waits for (events its stream
        was made to wait on since its previous op)."""
        self.last[stream] = index
        return tuple(self.pending.pop(stream, ()))

    def wait(self, stream, mark: int | None) -> None:
        """`stream`'s later work waits for the op `mark` (None: an event recorded before any op)."""
        if mark is not None:
            self.pending.setdefault(stream.id, []).append(mark)


class _Stream:
    def __init__(self, log: StreamLog, device=None, priority: int = 0, name: str | None = None,
                 **_):
        self.log, self.priority = log, priority
        self.id = next(log._ids)
        self.name = name or f"stream{self.id}"
        self.device = torch.device("cuda", 0)
        self.device_index, self.device_type = 0, "cuda"

    def wait_stream(self, stream) -> None:
        self.log.wait(self, self.log.last.get(stream.id))

    def wait_event(self, event) -> None:
        self.log.wait(self, getattr(event, "mark", None))

    def record_event(self, event=None):
        event = event if event is not None else _Event(self.log)
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        self._previous = self.log.current
        self.log.current = self
        return self

    def __exit__(self, *exc):
        self.log.current = self._previous

    def __repr__(self) -> str:
        return f"<stand-in cuda stream {self.name}>"


class _Event:
    def __init__(self, log: StreamLog, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, **_):
        self.log = log
        self.mark = None   # index of the last op on the recording stream when recorded

    def record(self, stream=None):
        stream = stream if stream is not None else self.log.current
        self.mark = self.log.last.get(stream.id)
        # torch.cuda.Event.record returns None; FSDP2's `Event().record()` (world size 1)
        # keeps that None as its all-gather event
        return None

    def wait(self, stream=None) -> None:
        self.log.wait(stream if stream is not None else self.log.current, self.mark)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@contextmanager
def cuda_without_gpu(compute_capability: tuple = (9, 0)):
    """Stand in for the driver-backed parts of torch.cuda that FSDP2 and DeviceMesh call."""
    log = StreamLog()

    def make_stream(device=None, priority=0, **kw):
        return _Stream(log, device, priority)

    @contextmanager
    def stream(s):
        if s is None:
            yield
            return
        with s:
            yield

    replaced = {
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "is_initialized": lambda: True,
        "Stream": make_stream,
        "Event": lambda *a, **kw: _Event(log, *a, **kw),
        "current_stream": lambda device=None: log.current,
        "default_stream": lambda device=None: log.default,
        "stream": stream,
        "synchronize": lambda device=None: None,
        "get_device_capability": lambda device=None: tuple(compute_capability),
        # the CUDA generator's state is a 16-byte CPU tensor (seed, offset); pipelining forks
        # the generators around a schedule's first step (torch.random.fork_rng): no GPU, no
        # generator, so a state that restores nothing
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
    }
    accelerator, get_name = accelerator_query()
    with patched(torch.cuda, **replaced), \
            patched(torch.accelerator, current_stream=lambda device=None: log.current), \
            patched(accelerator, **{get_name: lambda: torch.device("cuda")}):
        yield log
