"""CPU `bmm`: the per-matrix contiguous copies of its split path.

LinearAlgebra.cpp `bmm_out_or_baddbmm_`: a product of fewer than 400 multiply-adds per matrix
runs a plain loop; otherwise MKL's batched GEMM reads both operands when each matrix is row- or
column-major with a leading dimension that fits (`batch_items_contiguous_or_transposed`) and the
result is contiguous; any other batch (a stride-0 operand: the expanded gradient of `out.sum()`)
is split into one `addmm_impl_cpu_` per matrix, whose BLAS operand copies (matmul.py) are made
and freed matrix by matrix: one matrix's copies at a time. bf16/fp16 take oneDNN's matmul
instead: not modelled here.
"""

from __future__ import annotations

import torch

from .matmul import blas_operand_copies
from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten


def _items_readable(t) -> bool:
    """batch_items_contiguous_or_transposed."""
    sizes, strides = t.shape, t.stride()
    return ((strides[2] == 1 and (sizes[1] == 1 or strides[1] >= sizes[2]))
            or (strides[1] == 1 and (sizes[2] == 1 or strides[2] >= sizes[1])))


@RULES.register(WORKSPACE, aten.bmm.default, devices={"cpu"},
                source="aten/src/ATen/native/LinearAlgebra.cpp (bmm_out_or_baddbmm_: the split "
                       "path's addmm_impl_cpu_ per matrix)",
                test="tests/test_linalg_memory.py::"
                     "test_batched_factorization_backward_matches_the_allocator")
def bmm_split_path_copies(ctx, func, args, kwargs, out):
    b1, b2 = args[0], args[1]
    if b1.dtype not in (torch.float32, torch.float64) or out.numel() == 0 or b1.shape[2] == 0:
        return None
    if b1.shape[2] * b1.shape[1] * b2.shape[2] < 400:
        return None  # baddbmm_cpu_kernel reads any strides
    if _items_readable(b1) and _items_readable(b2) and out.is_contiguous():
        return None  # MKL's batched GEMM
    return blas_operand_copies(out[0], b1[0], b2[0]) or None
