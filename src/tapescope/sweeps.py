"""The physical peak of a compiled step for each `activation_memory_budget` (pytorch#197838).

functorch's min-cut partitioner takes a budget in [0, 1]: the share of the activations the forward
may save, the rest recomputed in the backward. What the budget does to the *physical* peak (the
allocator's, with inductor's buffer reuse and the optimizer around it) is not monotonic and not
what the budget names; each point here is a full compiled profile of the step at that budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import profile_workload
from .options import CompileOptions, Options, Workload

__all__ = ["BudgetPoint", "budget_sweep", "sweep_notes", "DEFAULT_BUDGETS"]

DEFAULT_BUDGETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class BudgetPoint:
    budget: float
    peak_bytes: int              # steady state (or first step when steps=1)
    first_step_peak_bytes: int
    saved_bytes: int             # activations the forward saves (partitioner's choice)
    recomputed_ops: int
    recompute_flops: int
    total_flops: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def budget_sweep(workload: Workload, options: Options, budgets=DEFAULT_BUDGETS,
                 progress=None) -> list[BudgetPoint]:
    """A compiled profile of the step for each budget (options.compile gives the other
    compile settings; default inductor)."""
    base = options.compile or CompileOptions()
    points = []
    for b in budgets:
        compile = CompileOptions(**{**base.to_dict(), "activation_memory_budget": float(b)})
        p = profile_workload(workload, options.but(compile=compile), progress)
        c = p.compiled
        points.append(BudgetPoint(float(b), p.peak_bytes, p.first_step_peak_bytes, c.saved_bytes,
                                  len(c.recomputed), c.recompute_flops, p.flops["total"]))
    return points


def sweep_notes(points: list[BudgetPoint]) -> list[str]:
    """What a reader of the table would otherwise find unexplained: budget 0 (functorch returns
    the forward's inputs as the only saved values, partitioners.py, without a min-cut), and a
    smaller budget with a higher peak than a larger one."""
    from .report.text import fmt_bytes

    notes = []
    if any(pt.budget == 0 for pt in points):
        notes.append("budget 0 saves only the forward's inputs (functorch skips its min-cut): the "
                     "backward recomputes the whole forward")
    ordered = sorted(points, key=lambda pt: pt.budget)
    for i, low in enumerate(ordered):
        higher = [pt for pt in ordered[i + 1:] if pt.peak_bytes < low.peak_bytes]
        if higher:
            best = min(higher, key=lambda pt: pt.peak_bytes)
            notes.append(
                f"budget {low.budget:g} peaks at {fmt_bytes(low.peak_bytes)}, above budget "
                f"{best.budget:g}'s {fmt_bytes(best.peak_bytes)} while saving "
                f"{fmt_bytes(low.saved_bytes)} against {fmt_bytes(best.saved_bytes)}: the budget "
                "bounds what the forward saves, not the step's peak (the recomputed tensors and "
                "the backward's own are alive together)")
    return notes
