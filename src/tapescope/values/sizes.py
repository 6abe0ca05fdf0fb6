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
    """

    routing: str | tuple = "balanced"
    mask: float | None = None

    @classmethod
    def create(cls, sizes) -> "Sizes":
        """From a Sizes, None, "balanced" / "worst", a sequence of shares or a dict of fields."""
        if sizes is None:
            return cls()
        if isinstance(sizes, str):
            sizes = cls(routing=sizes)
        elif isinstance(sizes, dict):
            unknown = set(sizes) - {"routing", "mask"}
            if unknown:
                raise TapescopeError(f"sizes has no field {', '.join(sorted(unknown))}; use "
                                     "routing= (balanced, worst or shares) and mask= (a fraction)")
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
        return cls(routing, fraction)

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
        return out

    def describe_routing(self) -> str:
        if isinstance(self.routing, tuple):
            return "shares " + ":".join(f"{s:g}" for s in self.routing)
        return self.routing
