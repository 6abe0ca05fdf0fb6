"""The loss of the step, by name: what `--loss` (and `profile(loss_fn="...")`) accepts.

    sum             the sum of the model's floating-point outputs
    mean            the mean of the model's floating-point outputs (summed over outputs)
    cross-entropy   cross-entropy of the model's logits (the output, its `.logits` or its first
                    tensor; classes on the last dimension) against an integer input of the logits'
                    leading shape (the targets of a language model), else against class 0
    FILE.py:FN      your own function, called as FN(output, *inputs) -> scalar
    MODULE:FN       the same, from an importable module

A loss is a function `loss(output, *inputs) -> scalar tensor`, run inside the step on the same
(fake) tensors a real loop would use. Without one, the step uses the model's own loss: a zoo model's
(a language model's cross-entropy, a classifier's), else a scalar output, else an output's scalar
`.loss`, else the sum of the floating-point outputs (`default_loss`).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["LOSSES", "resolve_loss", "logits_of", "default_loss", "choose_default_loss",
           "describe_loss", "floating_outputs", "grad_tensors", "sum_of"]


def grad_tensors(values) -> list:
    """The floating-point tensors that require grad among `values` (not looked into)."""
    import torch

    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.requires_grad]


def floating_outputs(output) -> list:
    """The floating-point tensors that require grad among a model's outputs (every leaf of its
    tuples, lists and dicts; a Hugging Face ModelOutput's values); possibly none."""
    from .torch_compat import tree_leaves

    leaves = grad_tensors(tree_leaves(output))
    if not leaves and isinstance(output, dict):  # Hugging Face ModelOutput values
        leaves = grad_tensors(output.values())
    return leaves


def sum_of(tensors):
    """The sum of each tensor's sum, added up in order: the sum-of-outputs loss."""
    loss = tensors[0].sum()
    for t in tensors[1:]:
        loss = loss + t.sum()
    return loss


def _floating_outputs(output) -> list:
    leaves = floating_outputs(output)
    if not leaves:
        from .errors import TapescopeError

        raise TapescopeError("the model's output has no floating-point tensor that requires grad, "
                             "so the loss has nothing to backpropagate")
    return leaves


def default_loss(output):
    """The loss when none is given: a scalar output; else an output's scalar `loss` field (Hugging
    Face models given labels); else the sum of all floating-point outputs that require grad."""
    return choose_default_loss(output)[0]


def choose_default_loss(output):
    """default_loss's loss and, for the report, which of its three choices it made."""
    import torch

    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output, "the model's scalar output"
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad:
        return loss, "the model's .loss"
    leaves = floating_outputs(output)
    if not leaves:
        from .errors import TapescopeError

        raise TapescopeError(
            "the model's output has no floating-point tensor that requires grad, so there is nothing "
            "to backpropagate; pass loss_fn=... (CLI: use a zoo model or a build function that "
            "returns a model producing a loss)")
    return sum_of(leaves), ("sum of the model's outputs (the default for a model without a loss: "
                           "give --loss for the one you train with)")


def describe_loss(loss_fn) -> str:
    """How the report names a given loss: its --loss name, tapescope's own loss by its docstring's
    first line (a zoo classifier's), else the function's qualified name."""
    for name, fn in LOSSES.items():
        if fn is loss_fn:
            return name
    module = getattr(loss_fn, "__module__", "") or ""
    doc = (getattr(loss_fn, "__doc__", None) or "").strip()
    if module.startswith("tapescope.") and doc:
        first = doc.split(".")[0].split("(")[0].strip()
        return first[0].lower() + first[1:]
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    return f"{module.rsplit('.', 1)[-1]}:{name}" if module else name


def sum_loss(output, *inputs):
    """The sum of every floating-point output."""
    return sum_of(_floating_outputs(output))


def mean_loss(output, *inputs):
    """The mean of each floating-point output, added up."""
    leaves = _floating_outputs(output)
    loss = leaves[0].mean()
    for t in leaves[1:]:
        loss = loss + t.mean()
    return loss


def logits_of(output):
    """The logits among a model's outputs: the tensor itself, `.logits` / ["logits"], else the
    first floating-point tensor."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return _floating_outputs(output)[0]


def cross_entropy_loss(output, *inputs):
    """Cross-entropy of the logits (classes on the last dimension) against an integer input of
    the logits' leading shape (a language model's targets), else against class 0 everywhere."""
    import torch
    import torch.nn.functional as F

    from .errors import TapescopeError
    from .torch_compat import tree_leaves

    logits = logits_of(output)
    if logits.dim() == 0:
        raise TapescopeError("--loss cross-entropy needs the model's logits, and the model returned "
                             "a scalar (it computes its own loss: leave --loss out)")
    lead = tuple(logits.shape[:-1]) if logits.dim() > 1 else ()
    target = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)
                   and not t.is_floating_point() and t.dtype != torch.bool
                   and tuple(t.shape) == lead), None)
    if target is None:
        target = torch.zeros(lead, dtype=torch.long, device=logits.device)
    if logits.dim() > 2:
        logits, target = logits.flatten(0, -2), target.flatten()
    return F.cross_entropy(logits, target)


LOSSES: dict[str, Callable] = {"sum": sum_loss, "mean": mean_loss,
                               "cross-entropy": cross_entropy_loss}
_ALIASES = {"ce": "cross-entropy", "cross_entropy": "cross-entropy", "crossentropy": "cross-entropy"}


def resolve_loss(loss) -> Callable | None:
    """None (the model's own loss), a callable, a name from LOSSES, or FILE.py:FN / MODULE:FN."""
    if loss is None or callable(loss):
        return loss
    from .errors import TapescopeError

    if not isinstance(loss, str):
        raise TapescopeError(f"loss must be a function or a name, got {type(loss).__name__}")
    name = _ALIASES.get(loss.strip().lower(), loss.strip().lower())
    if name in LOSSES:
        return LOSSES[name]
    if ":" in loss:
        from .loading import load_function

        return load_function(loss.strip(), "loss")
    raise TapescopeError(f"unknown loss {loss!r}; use {', '.join(LOSSES)}, or your own function "
                         "as path/to/file.py:fn or module:fn (called as fn(output, *inputs))")
