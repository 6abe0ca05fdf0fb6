"""One training step, written once and run both on fake tensors (capture) and for real (validation).

The step: forward, loss, backward, optimizer.step(), optimizer.zero_grad(set_to_none=True). The
model output is dropped as soon as the loss is computed, so it lives on only if autograd saved it
(the convention of a loop that writes `loss = loss_fn(model(x), y)`). The loss itself lives as
that loop's `loss` variable does: through backward, optimizer.step() and zero_grad(), until the
step ends. It is a 0-d tensor, but not always a small one: a reduced `mse_loss` keeps an
input-sized storage under it (capture/fidelity/losses.py), alive where the optimizer may peak.

With gradient accumulation over N micro-batches the step runs forward, `loss / N` and backward N
times, the gradients adding up, then one optimizer step, as a training loop writes it:

    for micro_batch in range(N):
        loss = loss_fn(model(x), y) / N     # the previous micro-batch's loss dies here
        loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    # the last micro-batch's loss dies when the step ends

Each micro-batch takes the same inputs (a data loader's next batch has the same shapes).
`micro_batch_done(i, n)` is asked after micro-batch i of n: the capture answers True once it has
proven that the next micro-batches repeat this one op for op (capture/session.py), and the loop
stops there; a real run never stops early.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from ..errors import TapescopeError
from ..losses import choose_default_loss, default_loss
from .records import BACKWARD, FORWARD, OPTIMIZER, ZERO_GRAD

__all__ = ["default_loss", "forward_and_loss", "train_step", "zero_grad"]


def forward_and_loss(model, args, kwargs, loss_fn, loss_context=nullcontext,
                     on_default_loss: Callable[[str], None] = lambda what: None) -> torch.Tensor:
    """The model's output and its loss; `on_default_loss(what)` hears which loss default_loss
    chose when no `loss_fn` is given (the report names it)."""
    if loss_fn is not None:
        _check_loss_call(loss_fn, len(args))
    out = model(*args, **kwargs)
    with loss_context():
        if loss_fn is not None:
            loss = loss_fn(out, *args)
        else:
            loss, what = choose_default_loss(out)
            on_default_loss(what)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TapescopeError(f"the loss must be a one-element tensor, got {type(loss).__name__} "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss


def _check_loss_call(loss_fn, n_inputs: int) -> None:
    """The loss is called as loss_fn(output, *inputs): say so, before the step runs, to a
    function that cannot take that many arguments (its own TypeError would name no convention)."""
    import inspect

    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or a C callable: no signature to check
        return
    try:
        sig.bind(*range(1 + n_inputs))
    except TypeError:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise TapescopeError(
            f"the loss {name}{sig} cannot be called as {name}(output, *inputs): tapescope passes "
            f"the model's output and its {n_inputs} input{'s' * (n_inputs != 1)}, "
            f"{1 + n_inputs} argument{'s' * (n_inputs != 0)} in all; give it the parameters "
            f"(output, *inputs)") from None


def train_step(model, args, kwargs, loss_fn, optimizer, *, step: int = 1,
               phase: Callable = lambda step, name: nullcontext(),
               backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
               forward_context: Callable = nullcontext, loss_context: Callable = nullcontext,
               accumulate: int = 1, end: bool = True,
               on_default_loss: Callable[[str], None] = lambda what: None,
               micro_batch_done: Callable[[int, int], bool] = lambda i, n: False,
               train_context: Callable = lambda args, kwargs: nullcontext(),
               ) -> torch.Tensor | None:
    """Forward and backward of each of `accumulate` micro-batches, the optimizer step, then
    zero_grad; `phase(step, name)` brackets each part (FORWARD, BACKWARD, OPTIMIZER, ZERO_GRAD).
    `train_context(args, kwargs)` is open around each micro-batch's forward and backward.

    end=False stops after optimizer.step() and returns the loss, still alive: the caller ends the
    step (zero_grad, then drops the loss inside its ZERO_GRAD phase), as tapescope's capture does
    when it decides how to trace step 2 (capture/session.py)."""
    loss = None
    for i in range(1, accumulate + 1):
        with train_context(args, kwargs):
            with phase(step, FORWARD), forward_context():
                # rebinding `loss` frees the previous micro-batch's, as a loop's assignment does
                loss = forward_and_loss(model, args, kwargs, loss_fn, loss_context,
                                        on_default_loss)
                if accumulate > 1:
                    with loss_context():
                        loss = loss / accumulate
            with phase(step, BACKWARD):
                backward(loss)
        if i < accumulate and micro_batch_done(i, accumulate):
            break  # micro-batches i+1..N repeat micro-batch i: the trace counts it N-i+1 times
    if optimizer is not None:
        with phase(step, OPTIMIZER):
            optimizer.step()
    if not end:
        return loss
    with phase(step, ZERO_GRAD):
        zero_grad(model, optimizer)
        del loss  # the end of the step: the loss dies inside the phase, so a trace records it
    return None


def zero_grad(model, optimizer) -> None:
    """optimizer.zero_grad(set_to_none=True); without an optimizer, each parameter's grad = None."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    elif callable(getattr(model, "parameters", None)):  # a compiled function's step has none
        for p in model.parameters():
            p.grad = None
