"""What to recompute, as data, and how torch's own APIs apply it.

A checkpointing plan is a list of `UnitPolicy`: a module (its fqn) and a mode.

- "full": the module's forward is checkpointed whole (torch.distributed's `checkpoint_wrapper`,
  non-reentrant `torch.utils.checkpoint`): only its inputs are kept, everything it saved for
  backward is recomputed when its backward starts.
- "selective": the same wrapper with a selective-checkpointing context
  (`create_selective_checkpoint_contexts`): the outputs of the ops in `save_ops` (the matmuls and
  attention kernels of the module) are kept, everything else (pointwise ops, norms, activations,
  softmax) is recomputed from them.

`apply_policies` wraps the modules of a model in place, the way `apply_activation_checkpointing`
does; `policy_code` writes the same as Python a user pastes into a training script.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import TapescopeError

__all__ = ["UnitPolicy", "MODES", "FULL", "SELECTIVE", "apply_policies", "policy_code",
           "resolve_op"]

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
        if isinstance(x, UnitPolicy):
            p = x
        elif isinstance(x, str):
            p = cls(x)
        elif isinstance(x, dict):
            p = cls(x["module"], x.get("mode", FULL), tuple(x.get("save_ops", ())))
        elif isinstance(x, (tuple, list)) and 1 <= len(x) <= 3:
            mode = x[1] if len(x) > 1 else FULL
            p = cls(x[0], mode, tuple(x[2]) if len(x) > 2 else ())
        else:
            raise TapescopeError(f"cannot read a checkpointing policy from {x!r}: give a module "
                                 "name, (name, 'full' | 'selective') or a UnitPolicy")
        if p.mode not in MODES:
            raise TapescopeError(f"checkpointing mode must be one of {MODES}, got {p.mode!r} "
                                 f"for module {p.module!r}")
        if p.mode == SELECTIVE and not p.save_ops:
            raise TapescopeError(f"a selective policy for {p.module!r} names no op to save")
        for name in p.save_ops:
            resolve_op(name)
        return p


def resolve_op(name: str):
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    parts = name.split(".")
    obj = torch.ops
    try:
        for part in parts:
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        obj = None
    if not isinstance(obj, torch._ops.OpOverload):
        raise TapescopeError(f"{name!r} is not an aten op overload (write e.g. 'aten.mm.default')")
    return obj


def _checkpoint_wrapper():
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl, checkpoint_wrapper)
    except ImportError:  # pragma: no cover - torch built without torch.distributed
        raise TapescopeError("applying a checkpointing plan needs torch.distributed's "
                             "checkpoint_wrapper, which this torch build lacks") from None
    return checkpoint_wrapper, CheckpointImpl


def wrap(module: nn.Module, policy: UnitPolicy) -> nn.Module:
    """`module` in torch's checkpoint_wrapper, as `policy` says."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    checkpoint_wrapper, impl = _checkpoint_wrapper()
    kwargs = {}
    if policy.mode == SELECTIVE:
        ops = [resolve_op(n) for n in policy.save_ops]
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, ops)
    return checkpoint_wrapper(module, checkpoint_impl=impl.NO_REENTRANT, **kwargs)


def apply_policies(model: nn.Module, policies, on_wrap=None) -> nn.Module:
    """Wrap the modules `policies` name, in place; returns `model`. `on_wrap(wrapper, module,
    fqn)` is told of each wrapper made (capture names it like the module it wraps)."""
    policies = [UnitPolicy.of(p) for p in policies]
    seen = set()
    for p in policies:
        if p.module in seen:
            raise TapescopeError(f"module {p.module!r} is named twice in the checkpointing plan")
        seen.add(p.module)
        for q in seen:
            if q != p.module and (p.module.startswith(q + ".") or q.startswith(p.module + ".")):
                raise TapescopeError(f"checkpointing {q!r} and {p.module!r}: one contains the "
                                     "other; name disjoint modules")
    # find every module first: a plan that does not fit the model leaves it as it was
    targets = []
    for p in policies:
        if not p.module:
            raise TapescopeError("the root module cannot be checkpointed by a plan; name its "
                                 "children")
        parent_name, _, child = p.module.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            module = parent.get_submodule(child)
        except AttributeError:
            raise TapescopeError(f"the model has no module {p.module!r} to checkpoint; the model "
                                 "was left as it was (apply a plan to the model it was made for)"
                                 ) from None
        wrapped = _checkpointed_on_path(model, p.module)
        if wrapped is not None:
            raise TapescopeError(
                f"module {p.module!r} is already checkpointed ({wrapped or 'the root'} is a "
                "checkpoint_wrapper): was the plan applied already? Apply a plan once, to the "
                "model as built; the model was left as it was")
        targets.append((p, parent, child, module))
    for p, parent, child, module in targets:
        wrapper = wrap(module, p)
        setattr(parent, child, wrapper)
        if on_wrap is not None:
            on_wrap(wrapper, module, p.module)
    return model


def _checkpointed_on_path(model: nn.Module, fqn: str) -> str | None:
    """The fqn of a checkpoint_wrapper that is `fqn` or contains it (None: none is): wrapping
    inside one nests checkpointing silently."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:  # pragma: no cover - no torch.distributed: no wrapper can be there
        return None
    path, module = [], model
    for part in [""] + fqn.split("."):
        if part:
            module = module.get_submodule(part)
            path.append(part)
        if isinstance(module, ActivationWrapper):
            return ".".join(path)
    return None


def _ranges(names: list[str]) -> list[str]:
    """Python expressions for a list of fqns, runs of `prefix.N` written as comprehensions."""
    out, i = [], 0
    while i < len(names):
        prefix, _, last = names[i].rpartition(".")
        if last.isdigit():
            j, n = i, int(last)
            while j + 1 < len(names) and names[j + 1] == f"{prefix}.{n + (j + 1 - i)}":
                j += 1
            if j - i >= 2:
                # the prefix as a quoted literal: a module name is data, never code
                out.append(f"*({prefix + '.'!r} + str(i) for i in range({n}, {n + j - i + 1}))")
                i = j + 1
                continue
        out.append(repr(names[i]))
        i += 1
    return out


def policy_code(policies, comment: str = "") -> str:
    """Python that applies `policies` to a model with torch's own APIs (paste it into a
    training script and call `apply_checkpointing(model)` before creating the optimizer)."""
    policies = [UnitPolicy.of(p) for p in policies]
    full = [p.module for p in policies if p.mode == FULL]
    selective = [p for p in policies if p.mode == SELECTIVE]
    save = sorted({op for p in selective for op in p.save_ops})
    lines = ["import functools", "",
             "import torch",
             "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
             "    CheckpointImpl, checkpoint_wrapper)",
             "from torch.utils.checkpoint import create_selective_checkpoint_contexts", ""]
    if comment:
        import textwrap

        lines += ["# " + line for line in textwrap.wrap(comment, 96)]
    lines.append("FULL = [" + ", ".join(_ranges(full)) + "]")
    lines.append("SELECTIVE = [" + ", ".join(_ranges([p.module for p in selective])) + "]")
    if any(tuple(sorted(p.save_ops)) != tuple(save) for p in selective):
        lines.append("SAVE = {" + ", ".join(
            f"{p.module!r}: [{', '.join('torch.ops.' + o for o in p.save_ops)}]"
            for p in selective) + "}")
        save_of = "SAVE[name]"
    else:
        lines.append("SAVE = [" + ", ".join("torch.ops." + o for o in save) + "]")
        save_of = "SAVE"
    lines += [
        "",
        "",
        "def apply_checkpointing(model):",
        '    """Checkpoint FULL whole and SELECTIVE keeping only the outputs of the SAVE ops."""',
        "    for name in FULL + SELECTIVE:",
        "        parent_name, _, child = name.rpartition('.')",
        "        parent = model.get_submodule(parent_name)",
        "        kwargs = {}",
        "        if name in SELECTIVE:",
        "            kwargs['context_fn'] = functools.partial(create_selective_checkpoint_contexts,",
        f"                                                     {save_of})",
        "        setattr(parent, child, checkpoint_wrapper(",
        "            parent.get_submodule(child), checkpoint_impl=CheckpointImpl.NO_REENTRANT,",
        "            **kwargs))",
        "    return model",
    ]
    return "\n".join(lines) + "\n"
