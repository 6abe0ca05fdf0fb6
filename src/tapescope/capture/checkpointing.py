"""Apply a checkpointing plan (values.checkpointing.UnitPolicy) to a model with torch's own APIs.

- "full": the module's forward is checkpointed whole (torch.distributed's `checkpoint_wrapper`,
  non-reentrant `torch.utils.checkpoint`): only its inputs are kept, everything it saved for
  backward is recomputed when its backward starts.
- "selective": the same wrapper with a selective-checkpointing context
  (`create_selective_checkpoint_contexts`): the outputs of the ops in `save_ops` (the matmuls and
  attention kernels of the module) are kept, everything else (pointwise ops, norms, activations,
  softmax) is recomputed from them.

`apply_policies` wraps the modules of a model in place, the way `apply_activation_checkpointing`
does; capture applies it to the traced copy, the planner to the user's model.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ..errors import TapescopeError
from ..values.checkpointing import SELECTIVE, UnitPolicy, resolve_op

__all__ = ["apply_policies", "wrap"]


def _checkpoint_wrapper():
    from ..torch_compat import checkpoint_wrapper_api

    try:
        checkpoint_wrapper, impl, _ = checkpoint_wrapper_api()
    except ImportError:  # pragma: no cover - torch built without torch.distributed
        raise TapescopeError("applying a checkpointing plan needs torch.distributed's "
                             "checkpoint_wrapper, which this torch build lacks") from None
    return checkpoint_wrapper, impl


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
    # one containing another: look up each module's ancestors (linear in the plan, not quadratic)
    for m in seen:
        parts = m.split(".")
        for k in range(1, len(parts)):
            q = ".".join(parts[:k])
            if q in seen:
                raise TapescopeError(f"checkpointing {q!r} and {m!r}: one contains the other; "
                                     "name disjoint modules")
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
    from ..torch_compat import checkpoint_wrapper_api

    try:
        ActivationWrapper = checkpoint_wrapper_api()[2]
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

