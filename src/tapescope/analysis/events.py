"""The one walk over a step's allocations and frees.

A step's events are `(op index, storage id, +1 | -1)` in order (capture/records.py). Every memory
figure (the timeline, the peak, what is alive at a moment, the symbolic peak's pieces, the CUDA
allocator's replay) is a fold over the same sequence: the traced device's storages only, each
storage allocated once while it lives. `device_events` is that sequence; the folds live with
their analyses.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.records import Trace

__all__ = ["StepView", "device_events", "initially_live", "live_after"]


@dataclass(frozen=True)
class StepView:
    """One step's share of the trace (analysis/steps.py cuts it): the sequence this walk reads."""

    step: int
    ops: tuple        # trace op indices, in execution order
    events: tuple     # (trace op index, storage id, +1/-1), in order
    initial: frozenset  # storage ids alive when the step starts


def initially_live(trace: Trace, view: StepView, all_devices: bool = False) -> set:
    """Storage ids alive when the step starts (on the traced device unless `all_devices`)."""
    if all_devices:
        return set(view.initial)
    storages, device = trace.storages, trace.device
    return {sid for sid in view.initial if storages[sid].device == device}


def device_events(trace: Trace, view: StepView, all_devices: bool = False):
    """Yield (event number, position of its op in the step, storage id, +1 | -1) for each event
    that changes what is alive: a storage's allocation while it is not alive, its free while it is.
    The position of a free is that of the last op recorded before it."""
    storages, device = trace.storages, trace.device
    local = {t: k for k, t in enumerate(view.ops)}
    live = initially_live(trace, view, all_devices)
    pos = 0
    for e, (op_index, sid, delta) in enumerate(view.events):
        pos = local.get(op_index, pos)
        if not all_devices and storages[sid].device != device:
            continue
        if delta > 0:
            if sid in live:
                continue
            live.add(sid)
        else:
            if sid not in live:
                continue
            live.discard(sid)
        yield e, pos, sid, delta


def live_after(trace: Trace, view: StepView, event: int | None = None,
               all_devices: bool = False) -> set:
    """Storage ids alive right after event number `event` (None: at the end of the step; -1: at
    its start)."""
    live = initially_live(trace, view, all_devices)
    for e, _, sid, delta in device_events(trace, view, all_devices):
        if event is not None and e > event:
            break
        if delta > 0:
            live.add(sid)
        else:
            live.discard(sid)
    return live
