"""CPU upsampling's generic kernel: the index and weight tensors it computes before its loop.

aten/src/ATen/native/cpu/UpSampleKernel.cpp, `upsample_generic_Nd_kernel_impl`: for each
interpolated dimension, `F::compute_indices_weights` makes `interp_size` pairs of tensors of the
output's length along it, an int64 source index and a weight of the input's dtype (nearest: one
pair, its weight `at::ones`, "for consistency, but not used"; linear: two; cubic: four). All are
alive while the TensorIterator loop runs and freed when the kernel returns: scratch inside the op
that a fake kernel does not allocate. The channels-last kernel, which 2-D upsampling runs on
small outputs or channels-last inputs (contiguous.py), and 3-D upsampling runs on channels-last
inputs of more than 3 channels, makes none of them.
"""

from __future__ import annotations

import torch

from .contiguous import upsample_2d_channels_last
from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten
_TEST = "tests/test_detection.py::test_generic_upsampling_allocates_its_indices_and_weights"

# op -> (interp_size, dimensions interpolated)
_GENERIC = {
    aten.upsample_nearest1d.default: (1, 1), aten._upsample_nearest_exact1d.default: (1, 1),
    aten.upsample_nearest2d.default: (1, 2), aten._upsample_nearest_exact2d.default: (1, 2),
    aten.upsample_nearest3d.default: (1, 3), aten._upsample_nearest_exact3d.default: (1, 3),
    aten.upsample_linear1d.default: (2, 1), aten.upsample_bilinear2d.default: (2, 2),
    aten.upsample_trilinear3d.default: (2, 3), aten.upsample_bicubic2d.default: (4, 2),
}


@RULES.register(WORKSPACE, *_GENERIC, devices={"cpu"},
                source="aten/src/ATen/native/cpu/UpSampleKernel.cpp (upsample_generic_Nd_kernel_"
                       "impl: compute_indices_weights, interp_size x (int64 index, weight) of "
                       "each output dimension's length)", test=_TEST)
def generic_upsampling_indices_and_weights(ctx, func, args, kwargs, out):
    """interp_size x (8 + itemsize) bytes per output element along each interpolated dimension,
    where the generic kernel runs."""
    x = args[0]
    if not isinstance(out, torch.Tensor) or x.dtype is torch.uint8 or not out.numel():
        return None  # uint8 images have their own AVX kernels
    interp, dims = _GENERIC[func]
    if dims == 2 and func is not aten.upsample_bicubic2d.default \
            and upsample_2d_channels_last(ctx, func, x, out):
        return None
    if dims == 3 and x.is_contiguous(memory_format=torch.channels_last_3d) and x.shape[1] > 3:
        return None  # _use_vectorized_kernel_cond_3d
    return [interp * length * n for length in out.shape[-dims:] for n in (8, x.dtype.itemsize)]
