"""The branches a real tensor takes where PyTorch's C++ code asks "is this a tensor subclass?".

Some C++ kernels and backward formulas pick an out-of-place op for tensor subclasses ("composite
compliance") and an in-place one for plain tensors. A FakeTensor is a subclass, so a fake trace
would run ops that the real step does not, and hold an extra output-sized tensor. FakeTensorMode
offers no hook for this; tapescope runs the plain-tensor branch at one of two places:

- Above the kernel, in a TorchFunctionMode (`RealTensorBranches`): `aten::linear` (Linear.cpp).
  When it neither calls addmm on a 2-d input nor flattens a contiguous input into one addmm, it
  computes `matmul(input, weight.t())` and adds the bias with `add_` for a plain tensor, `add`
  for a subclass. A TorchFunctionMode does not see inside a Python function that dispatches
  through it (torch pops the mode while the body runs); torch.nn.functional's only internal
  callers of linear are MultiheadAttention's, whose in-projection gets a transposed input when
  batch_first=True, so the mode runs private copies of those functions, made from their own code
  with a namespace in which `linear` (and `scaled_dot_product_attention`) are ours; torch's
  module is not touched.
- At dispatch, knowing which kernel runs: SDPA's math path adds the mask in place
  (`plain_tensor_forward_op`); index_backward accumulates in place (`plain_tensor_backward_op`).

Also here: which ops a tensor literal dispatches, by the function that makes it (`LITERAL_OPS`).
tests/test_engine.py checks each case's op sequence against real tensors under the profiler.
"""

from __future__ import annotations

import os
import types as pytypes

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, has_torch_function

__all__ = ["RealTensorBranches", "LITERAL_OPS", "plain_tensor_forward_op", "plain_tensor_backward_op"]

_LINEAR = torch._C._nn.linear

# How a real run dispatches the ops that make a tensor literal (aten::lift_fresh under fake
# tensors), by the function that makes it, as the profiler shows them.
LITERAL_OPS = {
    torch.tensor: ("empty", "lift_fresh", "detach_"),
    torch.as_tensor: ("empty", "lift_fresh"),
    torch.Tensor.__setitem__: ("lift_fresh",),  # x[i] = 3: the scalar, lifted
}
_SDPA = torch._C._nn.scaled_dot_product_attention


def _flatten_3d_forced() -> bool:
    return os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"  # read the way Linear.cpp reads it


def _linear_adds_in_place(input, weight, bias) -> bool:
    """Linear.cpp (torch 2.6+): True where a plain-tensor linear ends in `output.add_(bias)`."""
    if bias is None or input.is_mkldnn or input.dim() in (0, 2) or weight.dim() == 0:
        return False  # no bias; mkldnn_linear; an error; addmm
    if torch.autograd.forward_ad._current_level >= 0:
        return False  # forward AD is on: the bias may carry a tangent (then it is `add` too)
    if input.device.type != "xla":
        if input.is_contiguous() and (input.dim() == 3 or (
                input.layout == torch.strided and weight.layout == torch.strided
                and bias.dim() == 1)):
            return False  # _flatten_nd_linear: one addmm
        if _flatten_3d_forced() and input.dim() == 3:
            return False
    return True


class RealTensorBranches(TorchFunctionMode):
    """The mode; `in_sdpa` counts the scaled_dot_product_attention calls running (see
    `plain_tensor_forward_op`)."""

    def __init__(self):
        super().__init__()
        self._mha = None  # the private multi_head_attention_forward, made on first use
        self.in_sdpa = 0
        self.literal_maker = None  # torch.tensor, torch.as_tensor or Tensor.__setitem__, running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LINEAR:
            return linear(*args, **kwargs)
        if func is _SDPA:
            return self.sdpa(*args, **kwargs)
        if func in LITERAL_OPS:
            outer, self.literal_maker = self.literal_maker, func
            try:
                return func(*args, **kwargs)
            finally:
                self.literal_maker = outer
        if func is F.multi_head_attention_forward and not has_torch_function(
                [a for a in args if isinstance(a, torch.Tensor)]):
            if self._mha is None:
                self._mha = _with_real_linear(F.multi_head_attention_forward, self.sdpa)
            if self._mha is not None:
                return self._mha(*args, **kwargs)
        return func(*args, **kwargs)

    def sdpa(self, *args, **kwargs):
        self.in_sdpa += 1
        try:
            return _SDPA(*args, **kwargs)
        finally:
            self.in_sdpa -= 1


def linear(input, weight, bias=None):
    """aten::linear as Linear.cpp runs it for plain tensors."""
    if _linear_adds_in_place(input, weight, bias):
        return torch.matmul(input, weight.t()).add_(bias)
    return _LINEAR(input, weight, bias)


_LINEAR_CALLERS = ("multi_head_attention_forward", "_in_projection_packed", "_in_projection")


def _with_real_linear(fn, sdpa):
    """A copy of torch.nn.functional's `fn` whose module namespace is a private copy in which
    `linear`, `scaled_dot_product_attention` and their callers are ours (None if torch's code is
    not laid out as expected)."""
    namespace = dict(vars(F))
    namespace["linear"] = linear
    namespace["scaled_dot_product_attention"] = sdpa
    for name in _LINEAR_CALLERS:
        f = namespace.get(name)
        if not isinstance(f, pytypes.FunctionType):
            return None
        copy = pytypes.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__,
                                    f.__closure__)
        copy.__kwdefaults__ = f.__kwdefaults__
        namespace[name] = copy
    return namespace[fn.__name__]


# ---- inside C++ composites ------------------------------------------------------------------------
# Branches inside a C++ kernel that no TorchFunctionMode reaches are rewritten at dispatch, knowing
# which kernel is running.

_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor


def plain_tensor_forward_op(mode: RealTensorBranches, func, args, kwargs):
    """(func, args, kwargs) as a forward composite runs them for plain tensors.

    _scaled_dot_product_attention_math (attention.cpp) adds the mask to the scores with
    `attn.add_(mask)` for plain tensors, `attn.add(mask)` (one more scores-sized tensor) for
    subclasses; it is the only `add` the math path runs (the fused backends run none).
    """
    if func is _ADD and mode.in_sdpa and not kwargs and len(args) == 2 \
            and isinstance(args[1], torch.Tensor) \
            and torch.broadcast_shapes(args[0].shape, args[1].shape) == args[0].shape:
        return _ADD_, args, kwargs
    return func, args, kwargs


# ---- backward formulas ---------------------------------------------------------------------------
# FunctionsManual.cpp has the same kind of branch in backward formulas, run by C++ autograd nodes
# where no TorchFunctionMode can reach. They are rewritten at dispatch, knowing the node that runs.

_INDEX_PUT = torch.ops.aten.index_put.default
_INDEX_PUT_IMPL = torch.ops.aten._index_put_impl_.default


def plain_tensor_backward_op(node, func, args, kwargs):
    """(func, args, kwargs) as a backward formula runs them for plain tensors.

    index_backward (IndexBackward0, the gradient of `x[idx]`): for plain tensors
    `at::_index_put_impl_(zeros_like_self, indices, grad, true, true)` accumulates into the zeros
    the formula just made; for subclasses `zeros_like_self.index_put(indices, grad, true)`, a
    second self-sized tensor.
    """
    if func is _INDEX_PUT and node is not None and type(node).__name__ == "IndexBackward0":
        self, indices, values, *rest = args
        accumulate = rest[0] if rest else kwargs.get("accumulate", False)
        if accumulate:
            return _INDEX_PUT_IMPL, (self, indices, values, True, True), {}
    return func, args, kwargs
