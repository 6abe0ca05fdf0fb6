"""Which parts of the trace make up each training step, and what is alive when it starts.

A step is a list of segments (see capture.session for how step 2 reuses step 1's forward and
backward, and capture/first_step.py for a pipelined step's). Everything downstream works on a
StepView and never needs to know how it was traced.
"""

from __future__ import annotations

from ..capture.records import FIRST_STEP_ONLY, OPTIMIZER, ZERO_GRAD, Segment, Trace
from .events import StepView, live_after

__all__ = ["StepView", "step_segments", "step_views"]


def _events(trace: Trace, segs) -> list:
    ev = trace.events
    return [ev[i] for s in segs for i in s.events]


def _ops(segs) -> tuple:
    return tuple(i for s in segs for i in s.ops)


def step_segments(trace: Trace) -> dict[int, list[Segment]]:
    """The segments of each step, in the order they run: step 0 (setup) if any, step 1 and,
    when there is one, step 2. A reused step 2 (`Trace.step2 == "reused"`) is step 1's segments
    less its optimizer step and what only the first step runs, then its own optimizer step
    and the gradient reset that ends both steps (step 1 ended without one)."""
    by_step: dict[int, list[Segment]] = {}
    for s in trace.segments:
        by_step.setdefault(s.step, []).append(s)
    if trace.step2 == "reused":
        s1, s2 = by_step.get(1, []), by_step.get(2, [])
        reset = [s for s in s2 if s.label == ZERO_GRAD]
        repeated = [s for s in s1 if s.phase != OPTIMIZER and s.label != FIRST_STEP_ONLY]
        by_step[1] = s1 + reset
        by_step[2] = repeated + [s for s in s2 if s.label == OPTIMIZER] + reset
    return by_step


def step_views(trace: Trace) -> dict[int, StepView]:
    """StepView of step 1 and, when traced, step 2 (the steady state)."""
    by_step = step_segments(trace)
    initial = frozenset(s.id for s in trace.storages if s.created_by is None)
    if 0 in by_step:  # setup work before step 1: what it leaves alive is there when step 1 starts
        alive = set(initial)
        for _, sid, delta in _events(trace, by_step[0]):
            if delta > 0:
                alive.add(sid)
            else:
                alive.discard(sid)
        initial = frozenset(alive)

    step1_segs, step2_segs = by_step.get(1, []), by_step.get(2, [])
    views = {1: StepView(1, _ops(step1_segs), tuple(_events(trace, step1_segs)), initial)}
    if step2_segs:
        start2 = frozenset(live_after(trace, views[1], all_devices=True))
        views[2] = StepView(2, _ops(step2_segs), tuple(_events(trace, step2_segs)), start2)
    return views
