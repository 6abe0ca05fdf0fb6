"""Which parts of the trace make up each training step, and what is alive when it starts.

A step is a list of segments (see capture.session for how step 2 reuses step 1's forward and
backward). Everything downstream works on a StepView and never needs to know how it was traced.
"""

from __future__ import annotations

from ..capture.records import BACKWARD, FORWARD, Segment, Trace
from .events import StepView, live_after

__all__ = ["StepView", "step_views"]


def _events(trace: Trace, segs) -> list:
    ev = trace.events
    return [ev[i] for s in segs for i in s.events]


def _ops(segs) -> tuple:
    return tuple(i for s in segs for i in s.ops)


def step_views(trace: Trace) -> dict[int, StepView]:
    """StepView of step 1 and, when traced, step 2 (the steady state)."""
    by_step: dict[int, list[Segment]] = {}
    for s in trace.segments:
        by_step.setdefault(s.step, []).append(s)
    initial = frozenset(s.id for s in trace.storages if s.created_by is None)
    if 0 in by_step:  # setup work before step 1: what it leaves alive is there when step 1 starts
        alive = set(initial)
        for _, sid, delta in _events(trace, by_step[0]):
            if delta > 0:
                alive.add(sid)
            else:
                alive.discard(sid)
        initial = frozenset(alive)

    if trace.step2 == "reused":
        s1 = [s for s in by_step[1]]
        s2_opt = [s for s in by_step[2] if s.label == "optimizer"]
        reset = [s for s in by_step[2] if s.label == "zero_grad"]
        fwd_bwd = [s for s in s1 if s.phase in (FORWARD, BACKWARD)]
        step1_segs = s1 + reset  # step 1 ends with the same gradient reset
        step2_segs = fwd_bwd + s2_opt + reset
    else:
        step1_segs = by_step.get(1, [])
        step2_segs = by_step.get(2, [])

    views = {1: StepView(1, _ops(step1_segs), tuple(_events(trace, step1_segs)), initial)}
    if step2_segs:
        start2 = frozenset(live_after(trace, views[1], all_devices=True))
        views[2] = StepView(2, _ops(step2_segs), tuple(_events(trace, step2_segs)), start2)
    return views
