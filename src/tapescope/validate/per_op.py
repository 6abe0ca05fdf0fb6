"""Memory inside each op: the real allocator against the trace, op by op.

A peak that agrees can hide two errors that cancel, and a peak that disagrees does not say where.
This lines up the real step's outermost ops (validate.real) with the profile's, by name and
order, and gives for each op the live bytes before it and the highest live bytes while it ran, as
the allocator saw them and as the trace predicts. The difference of the two "excesses" (highest
minus before) is scratch one side allocates inside the op and the other does not: what a
WORKSPACE rule (capture/fidelity) models, or is missing.

`benchmarks/kernel_memory.py` prints the ops that differ for a model.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..analysis.events import device_events, initially_live
from ..analysis.steps import step_views

__all__ = ["OpMemory", "compare_ops"]


@dataclass(frozen=True)
class OpMemory:
    position: int           # the op's position in the real step (phases forward..optimizer)
    phase: str
    name: str               # "aten.mm"
    measured_before: int    # live bytes when the op began, relative to the step's own counting
    measured_peak: int      # highest live bytes while it ran
    predicted_before: int
    predicted_peak: int

    @property
    def measured_excess(self) -> int:
        return self.measured_peak - self.measured_before

    @property
    def predicted_excess(self) -> int:
        return self.predicted_peak - self.predicted_before


def _predicted(profile, step: int):
    trace = profile.trace
    view = step_views(trace)[step]
    storages = trace.storages
    live = sum(storages[s].nbytes for s in initially_live(trace, view))
    levels: dict = {}  # position -> [before, highest]
    for _, pos, sid, delta in device_events(trace, view):
        entry = levels.setdefault(pos, [live, live])
        live += storages[sid].nbytes * delta
        entry[1] = max(entry[1], live)
    names = [f"{trace.ops[i].phase} {trace.ops[i].func.name().split('.')[0].replace('::', '.')}"
             for i in view.ops]
    return names, levels


def _measured(real, step: int):
    positions = [i for i, (s, phase, _) in enumerate(real.ops) if s == step and phase]
    local = {t: k for k, t in enumerate(positions)}
    names = [f"{real.ops[i][1]} {real.ops[i][2].replace('::', '.')}" for i in positions]
    levels: dict = {}
    for a in real.events:
        if a.step != step or a.top_op not in local:
            continue
        before = a.live - a.nbytes
        entry = levels.setdefault(local[a.top_op], [before, before])
        entry[1] = max(entry[1], a.live)
    return names, levels


def compare_ops(profile, real, step: int = 1) -> list[OpMemory]:
    """Each op both steps ran, in order (ops only one side ran are left out), with the live bytes
    before it and its highest live bytes on each side. `real` is a validate.real.RealStep of the
    same step; levels are relative to each side's own counting (compare excesses, or the change
    of the difference of the `before` levels from one op to the next)."""
    pnames, plevels = _predicted(profile, step)
    mnames, mlevels = _measured(real, step)
    out = []
    m_level = p_level = 0
    matcher = difflib.SequenceMatcher(a=mnames, b=pnames, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            m = mlevels.get(a + k)
            p = plevels.get(b + k)
            m_before, m_peak = m if m else (m_level, m_level)
            p_before, p_peak = p if p else (p_level, p_level)
            m_level, p_level = m_before, p_before
            phase, name = mnames[a + k].split(" ", 1)
            out.append(OpMemory(a + k, phase, name, m_before, m_peak, p_before, p_peak))
    return out
