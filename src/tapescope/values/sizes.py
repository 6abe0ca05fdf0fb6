"""What data-dependent sizes are assumed to be (`Sizes`): the option capture/data_values.py
reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import TapescopeError

__all__ = ["Sizes", "ROUTINGS"]

ROUTINGS = ("balanced", "worst")


@dataclass(frozen=True)
class Sizes:
    """What data-dependent sizes are assumed to be.

    routing: "balanced" (default), "worst", or one share per expert (e.g. (4, 1, 1, 1): expert 0
        gets four times the tokens of each other expert).
    mask: the fraction of elements a boolean mask keeps where no routing decided it (None: such
        a mask stops the trace with a message asking for it).
    counts: the sizes the step's data-dependent ops have, per source line ("boxes.py:54"), in the
        order the step reaches that line (a number, or a list: [840, 833, 260] for three calls).
        Each call of a data-dependent op there (nonzero, an NMS, a boolean-mask index, unique)
        takes the next one; a size the values decide must equal it; past the list, `mask`
        applies. What a real step had (validate/data_sizes.py records it) makes the trace that
        step's, so the only assumption left is the one stated.
    """

    routing: str | tuple = "balanced"
    mask: float | None = None
    counts: tuple = ()   # ((source line, (count, ...)), ...): frozen, hashable

    @classmethod
    def create(cls, sizes) -> "Sizes":
        """From a Sizes, None, "balanced" / "worst", a sequence of shares or a dict of fields."""
        if sizes is None:
            return cls()
        if isinstance(sizes, str):
            sizes = cls(routing=sizes)
        elif isinstance(sizes, dict):
            unknown = set(sizes) - {"routing", "mask", "counts"}
            if unknown:
                raise TapescopeError(f"sizes has no field {', '.join(sorted(unknown))}; use "
                                     "routing= (balanced, worst or shares), mask= (a fraction) "
                                     "and counts= ({source line: sizes})")
            sizes = cls(**sizes)
        elif isinstance(sizes, (list, tuple)):
            sizes = cls(routing=tuple(sizes))
        elif not isinstance(sizes, Sizes):
            raise TapescopeError(f"sizes must be 'balanced', 'worst', shares per expert or a dict, "
                                 f"got {type(sizes).__name__}")
        routing = sizes.routing
        if isinstance(routing, (list, tuple)):
            try:
                routing = tuple(float(s) for s in routing)
            except (TypeError, ValueError):
                raise TapescopeError(f"routing shares must be numbers, got {sizes.routing}") from None
            if not routing or not all(0 <= s < math.inf for s in routing) \
                    or not 0 < sum(routing) < math.inf:
                raise TapescopeError(f"routing shares must be finite numbers >= 0, not all 0, "
                                     f"got {sizes.routing}")
        elif routing not in ROUTINGS:
            raise TapescopeError(f"routing must be one of {', '.join(ROUTINGS)} or shares per "
                                 f"expert, got {routing!r}")
        mask = sizes.mask
        try:
            fraction = None if mask is None else float(mask)
        except (TypeError, ValueError):
            fraction = math.nan
        if fraction is not None and not 0.0 <= fraction <= 1.0:  # nan included
            raise TapescopeError(f"mask must be a fraction between 0 and 1, got {mask!r}")
        return cls(routing, fraction, _counts(sizes.counts))

    def unused(self, assumptions) -> list[str]:
        """What was asked for and assumed nothing (`assumptions`: the trace's): a routing for a
        step with no router, a mask fraction for a step with no mask."""
        kinds = {a.kind for a in assumptions}
        out = []
        if self.routing != "balanced" and "routing" not in kinds:
            out.append(f"the routing {self.describe_routing()} (--routing) assumed nothing: no "
                       "router of this step (topk, argmax or max over expert scores) decides a "
                       "size")
        if self.mask is not None and "mask" not in kinds:
            out.append(f"the mask fraction {self.mask:g} (--mask-fraction) assumed nothing: no "
                       "boolean mask of this step decides a size")
        reached = {a.where for a in assumptions if a.kind == "counts"}
        out += [f"the counts for {line} assumed nothing: no data-dependent op of this step is "
                f"at that line" for line, _ in self.counts if line not in reached]
        return out

    def counts_at(self) -> dict:
        """source line -> its counts, in call order."""
        return {line: list(values) for line, values in self.counts}

    def describe_routing(self) -> str:
        if isinstance(self.routing, tuple):
            return "shares " + ":".join(f"{s:g}" for s in self.routing)
        return self.routing


def _counts(counts) -> tuple:
    """counts= as ((line, (int, ...)), ...): from a dict {line: int or [int, ...]} or that tuple."""
    items = counts.items() if isinstance(counts, dict) else counts
    out = []
    try:
        for line, values in items:
            values = (values,) if isinstance(values, int) else tuple(values)
            if not isinstance(line, str) or ":" not in line \
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                               for v in values):
                raise ValueError
            out.append((line, values))
    except (TypeError, ValueError):
        raise TapescopeError(f"counts must map source lines ('boxes.py:54') to sizes >= 0 (a "
                             f"number or a list in call order), got {counts!r}") from None
    return tuple(sorted(out))
