"""The branch a real tensor takes where a C++ composite asks "is this a tensor subclass?".

Some CompositeImplicitAutograd kernels pick an out-of-place op for tensor subclasses ("composite
compliance") and an in-place one for plain tensors. A FakeTensor is a subclass, so a fake trace
would run ops that the real step does not, and hold an extra output-sized tensor. A
TorchFunctionMode is the one place above the composite where we can run the real branch instead;
FakeTensorMode offers no hook for it.

Handled: `aten::linear` (Linear.cpp). When it neither calls addmm on a 2-d input nor flattens a
contiguous input into one addmm, it computes `matmul(input, weight.t())` and then adds the bias
with `add_` for a plain tensor, `add` for a subclass. nn.MultiheadAttention's in-projection of a
transposed (non-contiguous) input takes this path. tests/test_engine.py checks the op sequence
against real tensors run under the profiler, input layout by input layout.

Not reached: a linear called from inside a Python function that itself dispatched through this
mode (F.multi_head_attention_forward): torch pops the mode while the function's body runs, and the
body cannot be entered without dispatching again. nn.MultiheadAttention with batch_first=True and
batch > 1 therefore still traces `add` where a real run takes `add_` (one extra transient
output-sized tensor; docs/validation.md, vit_b_16).
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["RealTensorBranches"]

_LINEAR = torch._C._nn.linear


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
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LINEAR:
            input, weight, bias = _linear_args(*args, **kwargs)
            if _linear_adds_in_place(input, weight, bias):
                output = torch.matmul(input, weight.t())
                return output.add_(bias)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):
    return input, weight, bias
