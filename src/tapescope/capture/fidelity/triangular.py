"""CPU kernels on batches of matrices that copy a batch whose matrices are not laid out one
after another: triu/tril and solve_triangular.

A stride-0 batch (the expanded gradient `out.sum()` hands the backward) or a batch narrowed out
of larger matrices (QR's and LU's backward slice their factors) is common in the backward of the
factorizations; the fake kernels read any strides and copy nothing.
- `triu` / `tril` (TriangularOps.cpp `compute_triu_tril`, TriangularOpsUtils.h
  `checkTrilTriuBatchContiguous`): a tensor of three or more dimensions whose batch strides are
  not each the product of the sizes after them is read through `contiguous()`, a copy (an
  in-place call lets stride-0 and 3-D batches through, and writes through a second buffer).
- `linalg_solve_triangular` (BatchLinearAlgebra.cpp `linalg_solve_triangular_out`): LAPACK's trsm
  reads A only "F-ready" (each matrix column- or row-major, the batch packed); otherwise A,
  broadcast over the batch, is cloned column-major. B is copied into the fresh result in any case.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = ["packed", "batch_packed"]

aten = torch.ops.aten
_TEST = "tests/test_linalg_memory.py::test_batched_factorization_backward_matches_the_allocator"


def packed(shape, strides) -> bool:
    """`is_contiguous()` of a tensor with these sizes and strides (size-1 dimensions free)."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def batch_packed(t, allow_zero_stride: bool = False) -> bool:
    """checkTrilTriuBatchContiguous: does triu/tril read `t` as it is?"""
    if t.is_contiguous():
        return True
    dims = t.dim()
    if allow_zero_stride and dims <= 3:
        return True
    expected = t.shape[-1] * t.shape[-2]
    for i in range(dims - 3, -1, -1):
        if allow_zero_stride and i == 0 and (t.stride(i) == 0 or t.shape[i] == 1):
            continue
        if t.stride(i) != expected:
            return False
        expected *= t.shape[i]
    return True


@RULES.register(WORKSPACE, aten.triu.default, aten.tril.default, aten.triu_.default,
                aten.tril_.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/TriangularOps.cpp (compute_triu_tril), "
                       "TriangularOpsUtils.h (checkTrilTriuBatchContiguous)")
def triangle_of_a_scattered_batch(ctx, func, args, kwargs, out):
    t = args[0]
    in_place = func in (aten.triu_.default, aten.tril_.default)
    if t.numel() == 0 or batch_packed(t, in_place):
        return None
    nbytes = t.numel() * t.dtype.itemsize
    return [nbytes, nbytes] if in_place else [nbytes]  # in place: the copy and a result buffer


@RULES.register(WORKSPACE, aten.linalg_solve_triangular.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp "
                       "(linalg_solve_triangular_out: A cloned F-contiguous unless F-ready)")
def solve_triangular_clones_a(ctx, func, args, kwargs, out):
    a, b = args[0], args[1]
    if a.is_complex() or b.numel() == 0:
        return None  # a conjugated A has its own rule in the source; not modelled
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    shape = batch + tuple(a.shape[-2:])
    # A expanded over the broadcast batch: the new leading dimensions have stride 0
    strides = (0,) * (len(shape) - a.dim()) + tuple(
        0 if a.shape[i] == 1 and shape[len(shape) - a.dim() + i] != 1 else a.stride(i)
        for i in range(a.dim()))
    transposed = shape[:-2] + (shape[-1], shape[-2])
    t_strides = strides[:-2] + (strides[-1], strides[-2])
    if packed(shape, strides) or packed(transposed, t_strides):
        return None
    n = 1
    for s in shape:
        n *= s
    return [n * a.dtype.itemsize]
