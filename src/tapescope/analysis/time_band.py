"""The error band a predicted step time carries: the spread of the time model's error on the
published calibration runs of the same kind (devices/time_bands.py, measured by
benchmarks/published_runs.py), or the statement that it has none.

A kind is what changes which mechanisms price a step: one GPU or several (collectives, streams,
FSDP's hooks), and eager or compiled (one kernel per aten op, or inductor's fused kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..devices.time_bands import CALIBRATION_ERRORS

__all__ = ["TimeBand", "time_kind", "band_for", "profile_band"]


@dataclass(frozen=True)
class TimeBand:
    """Predicted / published - 1 of the step time over the calibration rows of `kind`."""

    kind: str
    rows: tuple = ()               # (row name, time error) of each calibration row of the kind

    @property
    def n(self) -> int:
        return len(self.rows)

    @property
    def low(self) -> float | None:
        return min(e for _, e in self.rows) if self.rows else None

    @property
    def high(self) -> float | None:
        return max(e for _, e in self.rows) if self.rows else None

    def text(self) -> str:
        if not self.rows:
            return (f"unknown, no published run of this kind ({self.kind}) is in the "
                    "calibration set")
        return (f"published runs like this one ({self.kind}): {self.low:+.0%} to "
                f"{self.high:+.0%}, n={self.n}")

    def rate_text(self) -> str:
        """The same band for a throughput (tokens/s, samples/s): a time error e is a rate error
        1 / (1 + e) - 1, so the ends swap."""
        if not self.rows:
            return self.text()
        return (f"published runs like this one ({self.kind}): {1 / (1 + self.high) - 1:+.0%} "
                f"to {1 / (1 + self.low) - 1:+.0%}, n={self.n}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "n": self.n, "low": self.low, "high": self.high,
                "rows": dict(self.rows), "text": self.text(), "rate_text": self.rate_text()}


def time_kind(distributed: bool, compiled: bool, calibrated: bool = False) -> str:
    """The kind of a step time; priced from a calibration file (a user's own GPU) is a kind of its
    own: no published run was priced that way, so its error is unknown."""
    return (f"{'distributed' if distributed else 'single GPU'}, {'compiled' if compiled else 'eager'}"
            + (", calibrated from a file" if calibrated else ""))


def band_for(kind: str) -> TimeBand:
    return TimeBand(kind, tuple(sorted(CALIBRATION_ERRORS.get(kind, {}).items())))


def profile_band(p, calibrated: bool = False) -> TimeBand:
    """The band of a Profile's step time, by its kind."""
    mesh = getattr(p.distributed, "mesh", None)
    distributed = p.distributed is not None and getattr(mesh, "world_size", 2) > 1
    return band_for(time_kind(distributed, p.compiled is not None, calibrated))
