"""`aten::linear` as Linear.cpp runs it for plain tensors, also inside nn.MultiheadAttention."""

from __future__ import annotations

import os
import types as pytypes

import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from ...torch_compat import forward_ad_level, linear_builtin, sdpa_builtin
from ...errors import passes_user_calls
from .registry import FUNCTION, RULES

__all__ = ["linear_adds_in_place"]


def _flatten_3d_forced() -> bool:
    return os.environ.get("TORCH_LINEAR_FLATTEN_3D") == "1"  # read the way Linear.cpp reads it


def linear_adds_in_place(input, weight, bias) -> bool:
    """Linear.cpp (torch 2.6+): True where a plain-tensor linear ends in `output.add_(bias)`."""
    if bias is None or input.is_mkldnn or input.dim() in (0, 2) or weight.dim() == 0:
        return False  # no bias; mkldnn_linear; an error; addmm
    if forward_ad_level() >= 0:
        return False  # forward AD is on: the bias may carry a tangent (then it is `add` too)
    if input.device.type != "xla":
        if input.is_contiguous() and (input.dim() == 3 or (
                input.layout == torch.strided and weight.layout == torch.strided
                and bias.dim() == 1)):
            return False  # _flatten_nd_linear: one addmm
        if _flatten_3d_forced() and input.dim() == 3:
            return False
    return True


@passes_user_calls
def _linear(input, weight, bias=None):
    if linear_adds_in_place(input, weight, bias):
        return torch.matmul(input, weight.t()).add_(bias)
    return linear_builtin(input, weight, bias)


@RULES.register(FUNCTION, linear_builtin, source="aten/src/ATen/native/Linear.cpp (linear)",
                test="tests/test_engine.py::test_linear_takes_the_plain_tensor_branch")
def linear_bias_added_in_place(ctx, func, args, kwargs):
    """When linear neither calls addmm on a 2-d input nor flattens a contiguous input into one
    addmm, it computes matmul(input, weight.t()) and adds the bias with `add_` for a plain tensor,
    `add` (one more output-sized tensor) for a subclass."""
    return _linear(*args, **kwargs)


_LINEAR_CALLERS = ("multi_head_attention_forward", "_in_projection_packed", "_in_projection")


@RULES.register(FUNCTION, F.multi_head_attention_forward,
                source="torch/nn/functional.py (multi_head_attention_forward) + Linear.cpp",
                test="tests/test_engine.py::test_multihead_attention_takes_the_plain_tensor_branch")
def multihead_attention_plain_linear(ctx, func, args, kwargs):
    """A TorchFunctionMode does not see inside a Python function that dispatches through it, and
    MultiheadAttention's in-projection gets a transposed (non-contiguous) input when
    batch_first=True, so its linear takes the in-place bias branch above. We run a private copy of
    torch.nn.functional's MHA functions whose namespace binds `linear` and
    `scaled_dot_product_attention` to the rules; torch's module is not touched."""
    if has_torch_function([a for a in args if isinstance(a, torch.Tensor)]):
        return func(*args, **kwargs)  # another subclass (DTensor ...) handles it
    mha = ctx.cache.get(func)
    if mha is None:
        mha = ctx.cache[func] = _with_rules(func, ctx) or func
    return mha(*args, **kwargs)


def _with_rules(fn, ctx):
    """A copy of torch.nn.functional's `fn` whose module namespace is a private copy in which
    `linear`, `scaled_dot_product_attention` and their callers apply the capture's rules (None if
    torch's code is not laid out as expected)."""
    namespace = dict(vars(F))
    namespace["linear"] = lambda *a, **k: ctx.call(linear_builtin, a, k)
    namespace["scaled_dot_product_attention"] = lambda *a, **k: ctx.call(sdpa_builtin, a, k)
    for name in _LINEAR_CALLERS:
        f = namespace.get(name)
        if not isinstance(f, pytypes.FunctionType):
            return None
        copy = pytypes.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__,
                                    f.__closure__)
        copy.__kwdefaults__ = f.__kwdefaults__
        namespace[name] = copy
    return namespace[fn.__name__]
