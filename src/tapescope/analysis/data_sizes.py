"""What the step assumed about sizes that depend on tensor values, and the peak as their formula.

Capture (capture/data_values.py) records each data-dependent size under a name with the value an
assumption gave it, and the assumptions it used. Here: which of those sizes the trace pinned to
their value (a Python loop over them, an `int()`), and the peak as a formula of the others,
taken from the symbolic profile's piece that is the peak at the assumed values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ..capture.records import Trace

__all__ = ["DataSizeReport", "data_size_report"]


@dataclass
class DataSizeReport:
    assumptions: list                      # capture.data_values.Assumption (.decided: it mattered)
    # capture.data_values.DataSize, as the trace has them (`assumptions`: indices into the above)
    sizes: list = field(default_factory=list)
    peak: sympy.Expr | None = None         # steady-state peak near the assumption, in the names
    first_step_peak: sympy.Expr | None = None

    def to_dict(self) -> dict:
        return {"assumptions": [a.__dict__ for a in self.assumptions],
                "sizes": [{**s.__dict__, "assumptions": [self.assumptions[i].__dict__
                                                         for i in s.assumptions]}
                          for s in self.sizes],
                "peak_bytes": None if self.peak is None else str(self.peak),
                "first_step_peak_bytes": None if self.first_step_peak is None
                else str(self.first_step_peak)}


def data_size_report(trace: Trace, sp) -> DataSizeReport | None:
    """None when the step made no assumption (no router, no data-dependent size)."""
    if not trace.data_sizes and not trace.assumptions:
        return None
    report = DataSizeReport(list(trace.assumptions), list(trace.data_sizes))
    if sp is not None and trace.data_sizes:
        report.peak = _local_formula(sp, sp.pieces, trace)
        report.first_step_peak = _local_formula(sp, sp.first_pieces, trace)
    return report


def _local_formula(sp, pieces, trace: Trace):
    """The piece that is the peak at the trace's sizes, with the named input dimensions set to
    their sizes: a formula of the data-dependent sizes alone."""
    if not pieces:
        return None
    vals = sp.point(sp.hints)
    from .symbolic import _best

    _, piece = _best(pieces, vals)
    dims = {s: sp.hints[n] for n, s in zip(sp.names, sp.symbols) if n not in trace.unbacked.values()}
    return sympy.expand(sp.expr(piece.bytes).xreplace(dims))
