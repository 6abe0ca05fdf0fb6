"""`aten::linear` as Linear.cpp runs it for plain tensors, also inside nn.MultiheadAttention,
and under autocast as autocast's linear wrapper runs it (its weight-cast cache included)."""

from __future__ import annotations

import os
import types as pytypes
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from ...torch_compat import disable_autocast, forward_ad_level, is_autocast_available, \
    linear_builtin, patched, sdpa_builtin
from ...errors import passes_user_calls
from .registry import FUNCTION, RULES

__all__ = ["linear_adds_in_place", "autocast_casts_cleared_with_torchs"]


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


def _autocast_dtype(device_type: str):
    """The dtype autocast's linear wrapper casts to on this device, None where autocast is off
    (linear is on every device's lower-precision list: autocast_mode.cpp)."""
    if not is_autocast_available(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _cached_cast(casts: dict, t, dtype, device_type: str):
    """autocast_mode.cpp's `cached_cast`, which no Python binding exposes: a floating tensor of
    the autocast device (not fp64) is cast; an fp32 leaf that requires grad and is no view is
    cast once while `is_autocast_cache_enabled()`, and the cast kept until the outermost autocast
    exits (`clear_autocast_cache`, autocast_casts_cleared_with_torchs)."""
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64) \
            or t.device.type != device_type:
        return t
    if not (t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
            and torch.is_autocast_cache_enabled() and not torch.is_inference_mode_enabled()):
        return t.to(dtype)
    held = casts.get(id(t))
    if held is not None and held[0]() is t:
        return held[1]
    cast = casts[id(t)] = (weakref.ref(t), t.to(dtype))
    return cast[1]


@RULES.register(FUNCTION, linear_builtin, source="aten/src/ATen/native/Linear.cpp (linear); "
                "aten/src/ATen/autocast_mode.cpp (cached_cast, the linear wrapper)",
                test="tests/test_engine.py::test_linear_takes_the_plain_tensor_branch")
def linear_bias_added_in_place(ctx, func, args, kwargs):
    """When linear neither calls addmm on a 2-d input nor flattens a contiguous input into one
    addmm, it computes matmul(input, weight.t()) and adds the bias with `add_` for a plain tensor,
    `add` (one more output-sized tensor) for a subclass.

    Under autocast that branch is taken by the linear autocast runs after casting its arguments;
    run in Python here, autocast would see only `matmul` and cast `weight.t()` (a view: never
    cached) and not the bias. So for that branch the wrapper's work is done first, as it does it:
    the arguments cast right to left (bias, weight, input) through the weight-cast cache, then
    linear with autocast off (the wrapper's ExcludeDispatchKeyGuard), which decides the branch
    again on the cast arguments. Every other linear goes to torch's wrapper and its cache."""
    input, weight, bias = (list(args) + [None] * 3)[:3]
    input, weight, bias = (kwargs.get("input", input), kwargs.get("weight", weight),
                           kwargs.get("bias", bias))
    dtype = _autocast_dtype(input.device.type)
    if dtype is None:
        return _linear(*args, **kwargs)
    if not linear_adds_in_place(input, weight, bias):
        return linear_builtin(*args, **kwargs)  # autocast's own wrapper and cache, in C++
    casts = ctx.cache.setdefault(_cached_cast, {})
    device_type = input.device.type
    bias = _cached_cast(casts, bias, dtype, device_type)
    weight = _cached_cast(casts, weight, dtype, device_type)
    input = _cached_cast(casts, input, dtype, device_type)
    with disable_autocast():
        return _linear(input, weight, bias)


@contextmanager
def autocast_casts_cleared_with_torchs(ctx):
    """The casts above live as long as torch's own cache: autocast's __exit__ clears that with
    `torch.clear_autocast_cache()` when the outermost autocast ends (as does a user's call)."""
    clear = torch.clear_autocast_cache

    def clear_both():
        ctx.cache.pop(_cached_cast, None)
        clear()

    with patched(torch, clear_autocast_cache=clear_both):
        yield
    ctx.cache.pop(_cached_cast, None)


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
