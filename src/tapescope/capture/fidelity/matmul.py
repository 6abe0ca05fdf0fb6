"""CPU matrix products: the contiguous copies `addmm_impl_cpu_` makes of operands BLAS cannot read.

BLAS reads a matrix whose one stride is 1 and the other at least the leading dimension. ATen's CPU
mm/addmm (LinearAlgebra.cpp, addmm_impl_cpu_) picks, for the result and each operand, the plain or
the transposed reading, and where neither fits clones the tensor contiguous inside the kernel: an
expanded (stride-0) operand above all, which is what `out.sum()` hands the backward of a Linear
(the gradient of a sum is the expanded 1). The fake kernel reads any strides and copies nothing.
"""

from __future__ import annotations

import torch

from ...devices import onednn_matmul
from .registry import RULES, WORKSPACE

__all__ = ["blas_operand_copies"]

aten = torch.ops.aten


def _readable(strides, rows_stride_index: int, lead) -> bool:
    """BLAS can read it without a copy: unit stride along one dimension, the other stride at
    least the leading dimension (addmm_impl_cpu_'s checks on `m1` / `m2`)."""
    return strides[rows_stride_index] == 1 and strides[1 - rows_stride_index] >= max(1, lead)


def blas_operand_copies(result: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> list[int]:
    """Bytes of each contiguous copy addmm_impl_cpu_ makes for result = m1 @ m2, in the order it
    makes them (a Fortran-contiguous result copy, then m1, then m2)."""
    rs, rz = result.stride(), result.shape
    if result.numel() == 0 or m1.shape[1] == 0:
        return []  # returns before any copy
    copies = []
    if rs[0] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[0])):
        transpose_c = False
    elif rs[1] == 1 and (rz[0] == 1 or rs[0] >= max(1, rz[1])):
        transpose_c = True
        m1, m2 = m2, m1
    else:
        transpose_c = False
        copies.append(result.numel() * result.dtype.itemsize)  # c made Fortran contiguous
    m = rz[1 if transpose_c else 0]
    n = rz[0 if transpose_c else 1]
    k = m1.shape[0 if transpose_c else 1]
    rows = 1 if transpose_c else 0
    for operand, lead_plain, lead_transposed in ((m1, m, k), (m2, k, n)):
        st = operand.stride()
        if not (_readable(st, rows, lead_plain) or _readable(st, 1 - rows, lead_transposed)):
            copies.append(operand.numel() * operand.dtype.itemsize)  # clone(Contiguous)
    return copies


def _onednn_src(result: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor):
    """The problem oneDNN's matmul sees for result = m1 @ m2 (Matmul.cpp mkldnn_gemm after
    addmm_impl_cpu_'s choices): (M, K, N, src read column-major). ATen computes C^T = B^T A^T in
    column-major terms, so oneDNN's src is m1 for a row-major result and m2^T where the result is
    read column-major (a one-column result); an operand neither reading fits is copied
    contiguous first. oneDNN's src tag is "ba" where matmul_helper_t::transA says 'T' (a column-
    major src, or a src of one row)."""
    rs, rz = result.stride(), result.shape
    column_major = rs[0] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[0]))
    src = m2.t() if column_major else m1
    M, K = src.shape
    N = rz[0] if column_major else rz[1]
    st = src.stride()
    plain = st[1] == 1 and st[0] >= max(1, K)
    transposed = not plain and st[0] == 1 and st[1] >= max(1, M)
    return M, K, N, transposed or M == 1


@RULES.register(WORKSPACE, aten.mm.default, aten.addmm.default, devices={"cpu"},
                source="aten/src/ATen/native/LinearAlgebra.cpp (addmm_impl_cpu_: "
                       "m1.clone(at::MemoryFormat::Contiguous) where neither stride reading fits); "
                       "aten/src/ATen/native/mkldnn/Matmul.cpp (mkldnn_gemm) + oneDNN "
                       "brgemm_matmul_utils.cpp (init_scratchpad) for bf16 on AVX-512",
                test="tests/test_kernel_workspace.py::test_mm_copies_an_expanded_gradient, "
                     "tests/test_kernel_workspace.py::"
                     "test_bf16_matmul_scratchpad_matches_the_allocator")
def mm_copies_unreadable_operands(ctx, func, args, kwargs, out):
    """An expanded or otherwise strided operand is copied contiguous inside mm/addmm; a bf16
    product on AVX-512 runs oneDNN's brgemm matmul, whose scratchpad lives inside the call."""
    m1, m2 = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
    copies = blas_operand_copies(out, m1, m2)
    if (m1.dtype == torch.bfloat16 and out.dtype == torch.bfloat16 and ctx.cpu is not None
            and ctx.cpu.isa == "avx512" and out.numel() and m1.shape[1]):
        M, K, N, transposed = _onednn_src(out, m1, m2)
        scratch = onednn_matmul.bf16_matmul_scratchpad(M, K, N, transposed, ctx.cpu.threads)
        if scratch is None:
            ctx.note("oneDNN matmul scratch", f"a bfloat16 {M}x{K} @ {K}x{N} product's brgemm "
                     "blocking is not modelled: its scratchpad is not counted (an estimate)")
        elif scratch:
            copies.append(scratch)
    return copies or None
