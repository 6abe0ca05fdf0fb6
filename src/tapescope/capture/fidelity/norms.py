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
from .registry import RULES, WORKSPACE, Alloc, Free

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
