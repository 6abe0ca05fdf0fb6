"""Per-module roll-ups: a value of each op summed over the op's module and all its ancestors.

One walk for every per-module figure (FLOPs, time, bytes): the console, the HTML report, the JSON
and the timing model all read module totals from here.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["ancestors", "module_rollup", "module_pattern"]


def ancestors(fqn: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a', ''] (the root last)."""
    if fqn == "":
        return [""]
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


def module_rollup(ops: Iterable, value: Callable, own: bool = False) -> dict:
    """Module fqn -> sum of `value(op)` over the module's ops and (unless `own`) its submodules'.
    Ops without a module, or whose value is None or 0, add nothing."""
    out: dict = {}
    for op in ops:
        if op.module is None:
            continue
        v = value(op)
        if not v:
            continue
        for m in ([op.module] if own else ancestors(op.module)):
            out[m] = out.get(m, 0) + v
    return out


def module_pattern(fqn: str) -> str:
    """'h.3.mlp.c_fc' -> 'h.*.mlp.c_fc': the instances of a repeated block share a pattern."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))
