"""Optimizers by name, with the implementation torch would choose on the traced device.

torch picks foreach kernels when every parameter is a plain tensor on a foreach-capable device
(`torch.optim.optimizer._default_to_fused_or_foreach`). Our parameters are FakeTensors, which that
check rejects, so a fake CUDA step would silently fall back to the per-parameter loop. We pass the
choice torch makes for real tensors on the traced device instead.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import TapescopeError
from ..torch_compat import foreach_devices, optimizer_step_hooked
from ..values.optimizers import OPTIMIZERS

__all__ = ["OPTIMIZERS", "make_optimizer", "default_foreach", "steps_outside_function_rules"]

# torch.optim's own optimizers (the ones an option names) whose step() and zero_grad() no
# FUNCTION rule (capture/fidelity/) acts in. Of the rules' functions their code calls only
# torch.tensor (a step counter: a literal whose ops are torch.tensor's whether or not its maker was
# seen, fidelity/literals.py) and Tensor.mul_ / div by a Python number (wrapped_numbers.py: no
# number is saved where grad is off, as step() has it unless `differentiable`). The capture's
# FunctionRulesMode costs ~0.85 us a torch call even when no rule acts, and an AdamW step makes
# ~19 such calls a parameter (attribute reads included): ~5,500 a GPT-2 profile, ~10 ms.
# tests/test_optimizers_rules.py proves it per class and implementation: the reached functions,
# and the same trace with and without the mode.
_RULE_FREE_STEPS = frozenset(OPTIMIZERS.values())


def default_foreach(device: torch.device) -> bool:
    """What torch's optimizers default to for plain tensors on `device` (fused is never a default)."""
    return device.type in foreach_devices()


def make_optimizer(spec, params: list, device: torch.device) -> torch.optim.Optimizer | None:
    """`spec`: None, a name ("sgd", "adam", "adamw"), an Optimizer class, or a factory params -> optimizer.

    What torch's optimizer refuses (no parameters, a bad option) is refused with its message."""
    try:
        return _make_optimizer(spec, params, device)
    except TapescopeError:
        raise
    except (ValueError, TypeError, RuntimeError) as e:
        hint = (" The model has no parameters that require grad: profile it with optimizer=None "
                "(--optimizer none)." if not params else "")
        raise TapescopeError(f"the optimizer refused the model's parameters: "
                             f"{type(e).__name__}: {e}.{hint}") from None


def _make_optimizer(spec, params: list, device: torch.device) -> torch.optim.Optimizer | None:
    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return None
    if isinstance(spec, str):
        cls = OPTIMIZERS.get(spec.lower())
        if cls is None:
            raise TapescopeError(
                f"unknown optimizer {spec!r}; use one of {', '.join(OPTIMIZERS)}, none, "
                "an Optimizer class or a function params -> optimizer")
        return cls(params, foreach=default_foreach(device))
    if isinstance(spec, type) and issubclass(spec, torch.optim.Optimizer):
        if "foreach" in inspect.signature(spec).parameters:
            return spec(params, foreach=default_foreach(device))
        return spec(params)
    if callable(spec):
        opt = spec(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TapescopeError(f"the optimizer factory returned {type(opt).__name__}, not a torch Optimizer")
        return opt
    raise TapescopeError(f"cannot make an optimizer from {spec!r}")


def steps_outside_function_rules(optimizer) -> bool:
    """May `optimizer.step()` and `zero_grad()` run without the capture's FunctionRulesMode? Yes
    for torch's own step (the class itself, not a subclass: that may override it), not
    differentiable (grad stays off inside) and without hooks (the user's code)."""
    return (type(optimizer) in _RULE_FREE_STEPS
            and not optimizer.defaults.get("differentiable", False)
            and not optimizer_step_hooked(optimizer))
