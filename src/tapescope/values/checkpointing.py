"""A checkpointing plan as data: `UnitPolicy`, a module (its fqn) and a mode.

- "full": the module's forward is checkpointed whole: only its inputs are kept.
- "selective": the outputs of the ops in `save_ops` are kept, everything else is recomputed.

capture/checkpointing.py applies a plan to a model with torch's own APIs; checkpointing/policy.py
writes it as Python a user pastes into a training script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TapescopeError
from ..torch_compat import OpOverload

__all__ = ["UnitPolicy", "MODES", "FULL", "SELECTIVE", "resolve_op"]

FULL, SELECTIVE = "full", "selective"
MODES = (FULL, SELECTIVE)


@dataclass(frozen=True)
class UnitPolicy:
    """Checkpoint module `module` (an fqn) in `mode`; `save_ops` are the aten ops whose outputs a
    selective policy keeps ("aten.mm.default", ...)."""

    module: str
    mode: str = FULL
    save_ops: tuple = ()

    def to_dict(self) -> dict:
        d = {"module": self.module, "mode": self.mode}
        if self.mode == SELECTIVE:
            d["save_ops"] = list(self.save_ops)
        return d

    @classmethod
    def of(cls, x) -> "UnitPolicy":
        """A UnitPolicy from itself, an fqn (full), an (fqn, mode[, save_ops]) tuple or a dict."""
        bad = TapescopeError(f"cannot read a checkpointing policy from {_short(x)}: give a "
                             "module name, (name, 'full' | 'selective'[, ops]), "
                             "{'module': name, 'mode': ..., 'save_ops': [...]} or a UnitPolicy")
        if isinstance(x, UnitPolicy):
            p = x
        elif isinstance(x, str):
            p = cls(x)
        elif isinstance(x, dict):
            if "module" not in x or set(x) - {"module", "mode", "save_ops"}:
                raise bad
            p = cls(x["module"], x.get("mode", FULL), x.get("save_ops", ()))
        elif isinstance(x, (tuple, list)) and 1 <= len(x) <= 3:
            mode = x[1] if len(x) > 1 else FULL
            p = cls(x[0], mode, x[2] if len(x) > 2 else ())
        else:
            raise bad
        # the plan may come from a file: every field of the type it must have
        if not isinstance(p.module, str) or not isinstance(p.mode, str) or \
                not isinstance(p.save_ops, (tuple, list)) or \
                not all(isinstance(o, str) for o in p.save_ops):
            raise bad
        p = cls(p.module, p.mode, tuple(p.save_ops))
        if p.mode not in MODES:
            raise TapescopeError(f"checkpointing mode must be one of {MODES}, got {p.mode!r} "
                                 f"for module {p.module!r}")
        if p.mode == SELECTIVE and not p.save_ops:
            raise TapescopeError(f"a selective policy for {p.module!r} names no op to save")
        for name in p.save_ops:
            resolve_op(name)
        return p


def _short(x) -> str:
    import reprlib

    return reprlib.repr(x)  # bounded in depth and length: the plan may be any JSON


def resolve_op(name: str):
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    parts = name.split(".")
    obj = torch.ops
    try:
        for part in parts:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        obj = None
    if not isinstance(obj, OpOverload):
        raise TapescopeError(f"{name!r} is not an aten op overload (write e.g. 'aten.mm.default')")
    return obj

