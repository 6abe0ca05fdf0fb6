"""A Python number multiplied into or dividing a tensor that requires grad: the 0-dim tensor that
autograd keeps until the backward.

`x * 0.5`, `x / 8`, `x.mul_(scale)`: Python's argument parser turns the number into a 0-dim CPU
tensor, a "wrapped number" (`wrapped_scalar_tensor`: float64 for a float, int64 for an int, bool,
complex128), allocated outside the dispatcher before the op (`scalar_tensor_static`), and calls
`mul.Tensor` / `div.Tensor` with it. When `x` requires grad, MulBackward0 / DivBackward0 save
`other` - that wrapped number - for the gradient of `x` (tools/autograd/derivatives.yaml:
`self: mul_tensor_backward(grad, other, ...)`, `self: div_tensor_self_backward(grad, other, ...)`).
SavedVariable calls no saved-tensor hook for a wrapped number ("Avoid wrapped numbers from being
leaked to the user", torch/csrc/autograd/saved_variable.cpp), so it is held by the node itself until
the node runs in the backward (release_variables) or the graph is dropped: 8 bytes per such op
on the CPU allocator, alive across the forward (a model with 25 of them peaks 200 B above its
tensors). A dispatch mode sees the number as a Python float, never the tensor.

This rule records those bytes where a real step has them: allocated before the op, kept with the
op's autograd node (capture/hooks.py: `keep_with_node`), freed when that node runs. Only the saved
ones: a wrapped number not saved dies when the op returns (8-16 bytes inside one op, the
Python-scalar temporaries docs/validation.md describes, not modelled). The number is a CPU tensor
even where the tensor is on CUDA (a fake CUDA step's MulBackward0 saves a CPU float64 `other`):
host memory the CUDA allocator never serves, so a CUDA trace has nothing to record here.
"""

from __future__ import annotations

import torch

from .registry import FUNCTION, RULES

__all__ = []

# the itemsize of the 0-dim tensor a Python number becomes (c10/core/ScalarType of
# wrapped_scalar_tensor: double, long, bool, complex<double>)
_WRAPPED_BYTES = {float: 8, int: 8, bool: 1, complex: 16}
_CPU = torch.device("cpu")

T = torch.Tensor
_SAVING = (torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
           T.mul, T.multiply, T.div, T.divide, T.true_divide,
           T.mul_, T.multiply_, T.div_, T.divide_, T.true_divide_)


@RULES.register(FUNCTION, *_SAVING, devices={"cpu"},
                source="torch/csrc/utils/python_arg_parser.cpp (wrapped_scalar_tensor), "
                       "tools/autograd/derivatives.yaml (mul.Tensor, div.Tensor: other saved), "
                       "torch/csrc/autograd/saved_variable.cpp (no hooks for wrapped numbers)",
                test="tests/test_memory_truth.py::test_python_numbers_saved_for_backward")
def number_saved_for_backward(ctx, func, args, kwargs):
    """mul/div of a tensor that requires grad by a Python number: the wrapped number lives with
    the op's autograd node."""
    nbytes = _saved_number_bytes(args, kwargs)
    if not nbytes:
        return func(*args, **kwargs)
    # parsed before the op runs, into a CPU tensor whatever the device of the tensor it
    # multiplies (scalar_to_tensor's default device): CPU memory, served on no stream
    held = ctx.bytes_outside_ops(nbytes, _CPU)
    out = func(*args, **kwargs)
    node = _node_saving(out)
    if node is not None:
        ctx.keep_with_node(node, held)
    return out


@RULES.register(FUNCTION, T.__rdiv__, devices={"cpu"},
                source="torch/_tensor.py (__rdiv__: self.reciprocal() * other)",
                test="tests/test_memory_truth.py::test_python_numbers_saved_for_backward")
def number_divided_by_tensor(ctx, func, args, kwargs):
    """`2 / x` is `x.reciprocal() * 2`: the mul saves the wrapped 2."""
    self, other = args
    if not isinstance(self, torch.Tensor) or type(other) not in _WRAPPED_BYTES:
        return func(*args, **kwargs)
    return number_saved_for_backward(ctx, T.mul, (self.reciprocal(), other), {})


def _saved_number_bytes(args, kwargs) -> int:
    if len(args) != 2 or kwargs.get("rounding_mode") is not None or kwargs.get("out") is not None:
        return 0
    self, other = args
    nbytes = _WRAPPED_BYTES.get(type(other))
    if nbytes is None or not isinstance(self, torch.Tensor):
        return 0
    if not (self.requires_grad and torch.is_grad_enabled()):
        return 0
    return nbytes


def _node_saving(out):
    """The autograd node that holds the saved number: the op's own, or for an in-place op on a
    view, the base's CopySlices, which runs it (and releases what it saved)."""
    if not isinstance(out, torch.Tensor) or out.grad_fn is None:
        return None
    if out._is_view():
        base_fn = out._base.grad_fn
        if base_fn is not None and base_fn.name().endswith("CopySlices"):
            return base_fn
    return out.grad_fn
