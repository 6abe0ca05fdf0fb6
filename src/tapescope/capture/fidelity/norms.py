"""LayerNorm on CPU (aten/src/ATen/native/layer_norm.cpp, cpu/layer_norm_kernel.cpp): the copies
and per-thread buffers the real kernels make.

`layer_norm_cpu` and `layer_norm_backward_cpu` run on `expect_contiguous()` operands: a permuted
activation (ConvNeXt's channels-last LayerNorm, a transposed sequence) is copied first. The
backward accumulates dgamma and dbeta in a buffer of two rows of N accumulators per thread
(`at::get_num_threads()`), reduced at the end. The fake kernels make neither.
"""

from __future__ import annotations

from math import prod

import torch

from ...torch_compat import suggest_memory_format
from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = []

aten = torch.ops.aten
_TEST = "tests/test_kernel_workspace.py::test_layer_norm_matches_the_allocator"


def _copies(*tensors) -> list:
    return [t.numel() * t.dtype.itemsize for t in tensors
            if t is not None and not t.is_contiguous()]


@RULES.register(WORKSPACE, aten.native_layer_norm.default, devices={"cpu", "cuda"},
                source="aten/src/ATen/native/layer_norm.cpp (layer_norm_cpu: "
                       "input/weight/bias.expect_contiguous()); cuda/layer_norm_kernel.cu "
                       "(layer_norm_cuda: the same)", test=_TEST)
def layer_norm_contiguous_copies(ctx, func, args, kwargs, out):
    x, _, weight, bias = args[:4]
    return _copies(x, weight, bias) or None


@RULES.register(WORKSPACE, aten.native_layer_norm_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/layer_norm.cpp (layer_norm_backward_cpu: "
                       "expect_contiguous) + cpu/layer_norm_kernel.cpp (the per-thread "
                       "dgamma/dbeta buffer, 2 x threads x N accumulators)", test=_TEST)
def layer_norm_backward_buffers(ctx, func, args, kwargs, out):
    grad_out, x, normalized_shape, _, _, weight, _, mask = args[:8]
    steps = [Alloc(f"copy{i}", n) for i, n in enumerate(_copies(grad_out, x, weight))]
    if weight is not None and (mask[1] or mask[2]):
        acc = 4 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype.itemsize
        n = prod(normalized_shape)
        steps += [Alloc("dgamma/dbeta buffer", 2 * ctx.cpu.threads * n * acc),
                  Free("dgamma/dbeta buffer")]
    return steps or None


@RULES.register(WORKSPACE, aten.native_group_norm_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/cpu/group_norm_kernel.cpp "
                       "(GroupNormBackwardKernelImplInternal: ds, db = at::empty({N, C}) in the "
                       "accumulation type, for the input and parameter gradients)",
                test="tests/test_kernel_workspace.py::test_kernels_copy_an_expanded_gradient")
def group_norm_backward_sums(ctx, func, args, kwargs, out):
    """The contiguous-format backward keeps two N x C sums (of dY * X and of dY) for dX, dgamma
    and dbeta. The channels-last kernel's buffers are not modelled (noted)."""
    x, n, c = args[1], args[5], args[6]
    if suggest_memory_format(x) is not torch.contiguous_format:
        ctx.note("group norm", "the channels-last GroupNorm backward's buffers are not counted")
        return None
    acc = 4 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype.itemsize
    return [2 * n * c * acc]


# ---- BatchNorm (aten/src/ATen/native/Normalization.cpp, cpu/batch_norm_kernel.cpp) ------------

_BN_TEST = "tests/test_kernel_workspace.py::test_batch_norm_matches_the_allocator"


def _bn_layout(x) -> str | None:
    """Which kernel batch_norm_kernel.cpp runs (batch_norm_choose_impl): "contiguous", or
    "channels_last" for a channels-last input and for an NC input (image size 1, "NC11 is also
    channels last"); None for any other layout (the TensorIterator path of Normalization.cpp)."""
    image = x.numel() // max(1, x.shape[0] * x.shape[1]) if x.dim() >= 2 else 1
    if x.is_contiguous():
        return "channels_last" if image == 1 else "contiguous"
    if x.dim() in (4, 5) and x.is_contiguous(
            memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d):
        return "channels_last"
    return None


def _bn_sizes(x, weight):
    """(channels, bytes of a per-channel statistic, bytes of an accumulator): statistics in the
    parameters' type (float for a bf16/fp16 input with float parameters, param_scalar_type),
    accumulators in float for bf16/fp16 (param_acc_t)."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    mixed = low and weight is not None and weight.dtype is torch.float32
    return x.shape[1], (4 if mixed else x.dtype.itemsize), (4 if low else x.dtype.itemsize)


@RULES.register(WORKSPACE, aten.native_batch_norm.default, devices={"cpu"},
                source="aten/src/ATen/native/Normalization.cpp "
                       "(batch_norm_cpu_update_stats_template: _mean, _var_sum = "
                       "at::empty({C})) + cpu/batch_norm_kernel.cpp "
                       "(batch_norm_cpu_collect_stats_channels_last_impl: buffer = "
                       "at::zeros({at::get_num_threads(), C}) when N > threads)", test=_BN_TEST)
def batch_norm_statistics(ctx, func, args, kwargs, out):
    """Training statistics of a contiguous (or channels-last) input: the mean and the sum of
    squares per channel beside the saved ones and, in the channels-last kernel (BatchNorm1d's
    N x C included), one row of C partial sums per thread when there are more rows than threads."""
    x, weight, training = args[0], args[1], args[5]
    if not training:
        return None
    layout = _bn_layout(x)
    if layout is None:
        ctx.note("batch norm", "BatchNorm of a non-contiguous input: its statistics' "
                               "temporaries are not counted")
        return None
    c, stat, acc = _bn_sizes(x, weight)
    steps = [2 * c * stat]  # _mean, _var_sum
    rows = x.numel() // max(1, c)
    if layout == "channels_last" and rows > ctx.cpu.threads:
        steps.append(ctx.cpu.threads * c * acc)
    return steps


@RULES.register(WORKSPACE, aten.native_batch_norm_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/Normalization.cpp "
                       "(batch_norm_backward_cpu_template: grad_input = empty_like(input, "
                       "LEGACY_CONTIGUOUS), allocated again for the contiguous path; the other "
                       "path's sum = at::sum(grad_out_, reduce_dims)) + cpu/batch_norm_kernel.cpp "
                       "(batch_norm_cpu_backward_channels_last_impl: buffer = "
                       "at::zeros({2, at::get_num_threads(), C}))", test=_BN_TEST)
def batch_norm_backward_buffers(ctx, func, args, kwargs, out):
    """The training backward. Where input and gradient are contiguous alike (the vectorised
    kernels), grad_input is allocated twice - the first one dies when the second is assigned -
    and the channels-last kernel then sums into two rows of C per thread; otherwise (an expanded
    gradient, say) the per-channel sum of the gradient is a temporary."""
    grad, x, weight, train, mask = args[0], args[1], args[2], args[7], args[9]
    if not train:
        return None
    c, _, acc = _bn_sizes(x, weight)
    layout = _bn_layout(x)
    if layout is None:
        ctx.note("batch norm", "BatchNorm of a non-contiguous input: its backward's "
                               "temporaries are not counted")
        return None
    same = (_bn_layout(grad) is not None
            and suggest_memory_format(grad) == suggest_memory_format(x))
    if not same:
        return [c * grad.dtype.itemsize]  # sum = at::sum(grad_out_, reduce_dims)
    steps = []
    if mask[0]:
        steps += [Alloc("grad_input (first)", x.numel() * x.dtype.itemsize),
                  Output(1), Output(2), Output(0), Free("grad_input (first)")]
    else:
        steps += [Output(1), Output(2)]
    if layout == "channels_last":
        steps += [Alloc("sum/dotp buffer", 2 * ctx.cpu.threads * c * acc),
                  Free("sum/dotp buffer")]
    return steps
