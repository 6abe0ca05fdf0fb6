"""CPU `bmm`/`baddbmm`: oneDNN's batched matmul for bf16 on AVX-512, else the per-matrix copies
of the split path.

LinearAlgebra.cpp `bmm_out_or_baddbmm_` tries oneDNN first (`use_mkldnn_matmul`): a bf16 product
of more than 16^3 multiply-adds in all (Matmul.cpp `checksize`: b * m * k * n) on a CPU with
oneDNN bf16 (AVX-512 here) runs `mkldnn_matmul`, which copies contiguous an operand that is
neither contiguous nor its last two dimensions transposed over a dense batch (mat1, then mat2),
then runs brg_matmul with the batch as its outer dimension; its scratchpad
(devices/onednn_matmul.py) lives inside the call. Otherwise a product of fewer than 400
multiply-adds per matrix runs a plain loop; MKL's batched GEMM (fp32/fp64 only) reads both
operands when each matrix is row- or column-major with a leading dimension that fits
(`batch_items_contiguous_or_transposed`) and the result is contiguous; any other batch (a
stride-0 operand: the expanded gradient of `out.sum()`; any bf16 batch oneDNN does not take) is
split into one `addmm_impl_cpu_` per matrix, whose BLAS operand copies (matmul.py) are made and
freed matrix by matrix: one matrix's copies at a time.
"""

from __future__ import annotations

import torch

from ...devices import onednn_matmul
from .matmul import blas_operand_copies
from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten

_MIN_ONEDNN_WORK = 16 * 16 * 16   # Matmul.cpp checksize: b * m * k * n at most this stays in ATen


def _items_readable(t) -> bool:
    """batch_items_contiguous_or_transposed."""
    sizes, strides = t.shape, t.stride()
    return ((strides[2] == 1 and (sizes[1] == 1 or strides[1] >= sizes[2]))
            or (strides[1] == 1 and (sizes[2] == 1 or strides[2] >= sizes[1])))


def _onednn_readable(t: torch.Tensor) -> bool:
    """mkldnn_matmul's `is_mkldnn_optimized_format` for a 3-D operand: contiguous, or its last
    two dimensions transposed over a dense batch."""
    _, rows, cols = t.shape
    return t.is_contiguous() or t.stride() == (rows * cols, 1, rows)


def _runs_onednn(ctx, b1, b2, out) -> bool:
    """use_mkldnn_matmul for a bf16 batch: oneDNN has bf16 (AVX-512) and the work is big enough."""
    B, M, K = b1.shape
    return (b1.dtype == b2.dtype == out.dtype == torch.bfloat16 and ctx.cpu is not None
            and ctx.cpu.isa == "avx512" and b1.numel() > 0 and b2.numel() > 0
            and B * M * K * b2.shape[2] > _MIN_ONEDNN_WORK)


def _operands(func, args):
    return (args[0], args[1]) if func is aten.bmm.default else (args[1], args[2])


@RULES.register(WORKSPACE, aten.bmm.default, aten.baddbmm.default, devices={"cpu"},
                source="aten/src/ATen/native/mkldnn/Matmul.cpp (mkldnn_matmul: operands not "
                       "contiguous nor last-two-transposed copied contiguous; checksize) + oneDNN "
                       "brgemm_matmul_utils.cpp (compute_blocking_heuristic_avx512 with the "
                       "batch, init_scratchpad)",
                test="tests/test_kernel_workspace.py::"
                     "test_bf16_bmm_scratchpad_matches_the_allocator")
def bf16_bmm_onednn_copies_and_scratchpad(ctx, func, args, kwargs, out):
    """mkldnn_matmul's operand copies, then brg_matmul's scratchpad for the whole batch."""
    b1, b2 = _operands(func, args)
    if not _runs_onednn(ctx, b1, b2, out):
        return None
    B, M, K = b1.shape
    N = b2.shape[2]
    copies = [t.numel() * t.dtype.itemsize for t in (b1, b2) if not _onednn_readable(t)]
    # a copied or contiguous mat1 is plain ("abc"); the transposed view is read as "acb"
    transposed = _onednn_readable(b1) and not b1.is_contiguous()
    scratch = onednn_matmul.bf16_matmul_scratchpad(M, K, N, transposed, ctx.cpu.threads, batch=B)
    if scratch is None:
        ctx.note("oneDNN matmul scratch", f"a batched bfloat16 {B}x{M}x{K} @ {K}x{N} product's "
                 "brgemm blocking is not modelled: its scratchpad is not counted (an estimate)")
    elif scratch:
        copies.append(scratch)
    return copies or None


@RULES.register(WORKSPACE, aten.bmm.default, devices={"cpu"},
                source="aten/src/ATen/native/LinearAlgebra.cpp (bmm_out_or_baddbmm_: the split "
                       "path's addmm_impl_cpu_ per matrix)",
                test="tests/test_linalg_memory.py::"
                     "test_batched_factorization_backward_matches_the_allocator, "
                     "tests/test_kernel_workspace.py::"
                     "test_bf16_bmm_scratchpad_matches_the_allocator")
def bmm_split_path_copies(ctx, func, args, kwargs, out):
    b1, b2 = args[0], args[1]
    if (b1.dtype not in (torch.float32, torch.float64, torch.bfloat16) or out.numel() == 0
            or b1.shape[2] == 0 or _runs_onednn(ctx, b1, b2, out)):
        return None
    if b1.shape[2] * b1.shape[1] * b2.shape[2] < 400:
        return None  # baddbmm_cpu_kernel reads any strides
    if b1.dtype != torch.bfloat16 and _items_readable(b1) and _items_readable(b2) \
            and out.is_contiguous():
        return None  # MKL's batched GEMM (not for bf16/fp16)
    return blas_operand_copies(out[0], b1[0], b2[0]) or None
