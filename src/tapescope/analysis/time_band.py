"""The error band a predicted step time carries, and how it is made.

The method (stated before any held-out row was compared with it; docs/validation.md says what
was looked at):
1. Each second of the step is attributed to the mechanism that priced it (`mechanism_of`: a
   GEMM of a size class, attention on a curve or a flat figure, a memory-bound kernel, a
   convolution; the collectives compute waited for; the GPU waiting for the host) and, on a
   step of several GPUs, the compute-bound seconds to their lockstep clock too.
2. Each mechanism's range of time error (devices/uncertainty.py: measured against published
   measurements it was not fitted on, or a stated prior) is weighted by its share of the step
   and the weighted ends are added: every mechanism off the same way at once, a first-order,
   conservative sum (a slower GEMM delays the step by its share of it).
3. Where published runs of the step's kind calibrate the model (devices/time_bands.py, measured
   by benchmarks/published_runs.py), their spread of errors (and zero) is added to it: what the
   mechanisms' ranges miss on whole runs. A kind with no calibration row gets the mechanisms'
   band alone, marked as such.

A kind is what changes which mechanisms price a step: one GPU or several (collectives, streams,
FSDP's hooks), and eager or compiled (one kernel per aten op, or inductor's fused kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..devices.efficiency import attention_provenance
from ..devices.time_bands import CALIBRATION_ERRORS
from ..devices.uncertainty import (ATTENTION_CURVE, ATTENTION_FLAT, ATTENTION_INTERPOLATED,
                                   COLLECTIVES, CONVOLUTION, GEMM_LARGE, GEMM_OTHER, HOST,
                                   LARGE_GEMM_DIM, LOCKSTEP_CLOCK, MECHANISMS, MEMORY_BOUND)

__all__ = ["TimeBand", "time_kind", "band_for", "profile_band", "mechanism_of"]

# the mechanisms whose seconds run at the GPU's sustained clock (compute-bound)
_COMPUTE_BOUND = (GEMM_LARGE, GEMM_OTHER, ATTENTION_CURVE, ATTENTION_INTERPOLATED, ATTENTION_FLAT,
                  CONVOLUTION)


def mechanism_of(kernel, arch: str | None = None) -> str:
    """The mechanism that prices a Kernel (analysis.kernel_cost) on a GPU architecture."""
    cls = kernel.op_class
    if cls == "matmul":
        if kernel.gemm is not None and kernel.flops:
            batch, m, n = kernel.gemm
            k = kernel.flops // (2 * max(batch * m * n, 1))
            if min(m, n, k) >= LARGE_GEMM_DIM:
                return GEMM_LARGE
        return GEMM_OTHER
    if cls == "attention":
        return {"curve": ATTENTION_CURVE, "interpolated": ATTENTION_INTERPOLATED}.get(
            attention_provenance(kernel.name, arch, kernel.attention), ATTENTION_FLAT)
    if cls == "convolution":
        return CONVOLUTION
    return MEMORY_BOUND


@dataclass(frozen=True)
class TimeBand:
    """The range of predicted / true - 1 of a step time: its calibration rows' spread (rows)
    and its mechanisms' weighted ranges (mechanisms: (name, share of the step, low, high))."""

    kind: str
    rows: tuple = ()               # (row name, time error) of each calibration row of the kind
    mechanisms: tuple = ()         # (mechanism, share of the step's seconds, low, high)

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def from_mechanisms(self) -> tuple[float, float]:
        return (sum(s * lo for _, s, lo, _ in self.mechanisms),
                sum(s * hi for _, s, _, hi in self.mechanisms))

    @property
    def priors(self) -> tuple:
        """The mechanisms of this step whose range is a prior, not a measurement."""
        return tuple(name for name, share, _, _ in self.mechanisms
                     if share and MECHANISMS[name].prior)

    @property
    def low(self) -> float | None:
        if not self.rows and not self.mechanisms:
            return None
        return min([0.0, *(e for _, e in self.rows)]) + self.from_mechanisms[0]

    @property
    def high(self) -> float | None:
        if not self.rows and not self.mechanisms:
            return None
        return max([0.0, *(e for _, e in self.rows)]) + self.from_mechanisms[1]

    def _why(self) -> str:
        if self.rows:
            lo = min(e for _, e in self.rows)
            hi = max(e for _, e in self.rows)
            return (f"published runs like this one ({self.kind}): {lo:+.0%} to {hi:+.0%}, "
                    f"n={self.n}, widened by its mechanisms' uncertainty")
        why = (f"from its mechanisms' uncertainty alone: no published run of this kind "
               f"({self.kind}) is in the calibration set")
        if self.kind.endswith("calibrated from a file"):
            # the ranges are the uncalibrated model's: wider than a kernel priced from its own
            # measurement can be off
            why += "; the ranges are those of kernels priced without a measurement"
        return why

    def text(self) -> str:
        if self.low is None:
            return (f"unknown, no published run of this kind ({self.kind}) is in the "
                    "calibration set")
        return f"{self.low:+.0%} to {self.high:+.0%} ({self._why()})"

    def rate_text(self) -> str:
        """The same band for a throughput (tokens/s, samples/s): a time error e is a rate error
        1 / (1 + e) - 1, so the ends swap."""
        if self.low is None:
            return self.text()
        return f"{1 / (1 + self.high) - 1:+.0%} to {1 / (1 + self.low) - 1:+.0%} ({self._why()})"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "n": self.n, "low": self.low, "high": self.high,
                "rows": dict(self.rows),
                "mechanisms": {name: {"share": s, "low": lo, "high": hi}
                               for name, s, lo, hi in self.mechanisms},
                "priors": list(self.priors), "text": self.text(), "rate_text": self.rate_text()}


def time_kind(distributed: bool, compiled: bool, calibrated: bool = False) -> str:
    """The kind of a step time; priced from a calibration file (a user's own GPU) is a kind of its
    own: no published run was priced that way, so no calibration row widens it."""
    return (f"{'distributed' if distributed else 'single GPU'}, {'compiled' if compiled else 'eager'}"
            + (", calibrated from a file" if calibrated else ""))


def band_for(kind: str, seconds: dict | None = None, step_seconds: float = 0.0,
             distributed: bool = False, leave_out: str | None = None) -> TimeBand:
    """The band of a step of `kind` whose seconds were priced by each mechanism as in `seconds`
    (StepTime.mechanisms) out of `step_seconds`; `leave_out`: a calibration row not to use
    (a calibration row's own band)."""
    rows = tuple(sorted((name, e) for name, e in CALIBRATION_ERRORS.get(kind, {}).items()
                        if name != leave_out))
    mechanisms = []
    if seconds and step_seconds > 0:
        shares = {name: s / step_seconds for name, s in seconds.items() if s > 0}
        if distributed:
            shares[LOCKSTEP_CLOCK] = sum(shares.get(m, 0.0) for m in _COMPUTE_BOUND)
        mechanisms = [(name, share, MECHANISMS[name].low, MECHANISMS[name].high)
                      for name, share in sorted(shares.items()) if share > 0]
    return TimeBand(kind, rows, tuple(mechanisms))


def profile_band(p, calibrated: bool = False, step_time=None) -> TimeBand:
    """The band of a Profile's step time (`step_time`, else p.time), by its kind and the seconds
    each of its mechanisms priced."""
    mesh = getattr(p.distributed, "mesh", None)
    distributed = p.distributed is not None and getattr(mesh, "world_size", 2) > 1
    t = step_time if step_time is not None else p.time
    kind = time_kind(distributed, p.compiled is not None, calibrated)
    if t is None:
        return band_for(kind)
    return band_for(kind, t.mechanisms, t.seconds, distributed)

