"""The step as runs of one phase: where the forward, backward and optimizer bands of a chart lie."""

from __future__ import annotations

__all__ = ["phase_runs"]


def phase_runs(ops) -> list[list]:
    """[phase, first op index, last op index + 1] for each run of consecutive ops in one phase."""
    runs: list[list] = []
    for op in ops:
        if runs and runs[-1][0] == op.phase:
            runs[-1][2] = op.index + 1
        else:
            runs.append([op.phase, op.index, op.index + 1])
    return runs
