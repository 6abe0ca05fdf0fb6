"""Why a step does not fit a memory budget, read off its own categories at the peak.

The peak splits in two. The model's state - parameters, buffers, gradients, optimizer state (a
distributed step's sharded and unsharded parameters) - is the same for any batch and any
checkpointing plan; only sharding it (FSDP), a smaller dtype or an optimizer with less state
change it. The rest - saved activations, temporaries, inputs, kernel workspace - grows with the
batch and is what checkpointing and autocast act on. `Shortfall` says which part is too large;
report/advice.py turns it into the commands to try next.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..capture.records import (BUFFER, GRADIENT, OPTIMIZER_STATE, PARAMETER, SHARDED_PARAMETER,
                               UNSHARDED_PARAMETER)

__all__ = ["MODEL_STATE", "Shortfall", "shortfall"]

MODEL_STATE = (PARAMETER, SHARDED_PARAMETER, UNSHARDED_PARAMETER, BUFFER, GRADIENT,
               OPTIMIZER_STATE)


@dataclass(frozen=True)
class Shortfall:
    """A peak over a budget, by category (`at_peak`: category -> bytes at the peak)."""

    budget: int
    at_peak: dict

    @property
    def peak(self) -> int:
        return sum(self.at_peak.values())

    @property
    def state(self) -> list[tuple[str, int]]:
        """The model state's categories at the peak, largest first."""
        return sorted(((c, b) for c, b in self.at_peak.items() if c in MODEL_STATE and b > 0),
                      key=lambda cb: -cb[1])

    @property
    def state_bytes(self) -> int:
        return sum(b for _, b in self.state)

    @property
    def activations(self) -> list[tuple[str, int]]:
        """Every other category at the peak, largest first."""
        return sorted(((c, b) for c, b in self.at_peak.items() if c not in MODEL_STATE and b > 0),
                      key=lambda cb: -cb[1])

    @property
    def state_exceeds(self) -> bool:
        """The model state alone is over the budget: no batch or checkpointing plan fits."""
        return self.state_bytes > self.budget

    def exceeding(self) -> list[tuple[str, int]]:
        """The fewest categories, largest first, that are over the budget on their own: of the
        model state where it is over alone, else of the whole peak."""
        pool = self.state if self.state_exceeds else sorted(
            ((c, b) for c, b in self.at_peak.items() if b > 0), key=lambda cb: -cb[1])
        out, total = [], 0
        for c, b in pool:
            out.append((c, b))
            total += b
            if total > self.budget:
                break
        return out

    def shards_needed(self, limit: int = 4096) -> int | None:
        """The least power of two N with the model state / N plus the rest of this peak within
        the budget: where to start looking for FSDP's degree. An estimate from one device's
        peak: FSDP also shards the optimizer's temporaries (fewer may do) and adds all-gather
        buffers and unsharded parameters (more may be needed); `fit --gpus N` profiles it.
        None if the rest alone is over the budget."""
        rest = self.peak - self.state_bytes
        n = 1
        while n <= limit:
            if self.state_bytes / n + rest <= self.budget:
                return n
            n *= 2
        return None


def shortfall(at_peak: dict, budget: int) -> Shortfall | None:
    """The Shortfall of a peak over `budget`; None if it fits."""
    s = Shortfall(int(budget), {c: int(b) for c, b in at_peak.items()})
    return s if s.peak > s.budget else None
