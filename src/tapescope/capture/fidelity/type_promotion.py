"""CPU binary ops on operands of different dtypes: the copies TensorIterator makes in the common
dtype.

A binary op's TensorIterator (`build_borrowing_binary_op`: promote_inputs_to_common_dtype,
cast_common_dtype_to_outputs) computes in the operands' common dtype. On the CPU
(TensorIterator.cpp, `compute_types`, `common_device == kCPU`) it does so on copies: every input
of another dtype is copied into the common dtype (`op.tensor().to(common_dtype_)`), and an output
given in another dtype (an in-place op's `self`) gets a temporary in the common dtype
(`empty_like(..., LEGACY_CONTIGUOUS_MEMORY_FORMAT)`), copied back when the op ends. CUDA kernels
cast as they load instead, with no copy. The fake kernel makes none of them.

torchao's rowwise float8 GEMM without fast accumulation scales its bf16 output in place by an
fp32 matrix (`output *= a_inverse_scale * b_inverse_scale`): two fp32 copies of the output's
size, which are the op's peak.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = ["promotion_copies"]

aten = torch.ops.aten

_IN_PLACE = {aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor}


def promotion_copies(func, self, other) -> list[int]:
    """Bytes of the common-dtype copies TensorIterator makes for `self <op> other` on the CPU."""
    if not (isinstance(self, torch.Tensor) and isinstance(other, torch.Tensor)):
        return []  # a Python number is a wrapped scalar: read as it is
    common = torch.result_type(self, other)
    copies = []
    if func in _IN_PLACE and self.dtype != common:
        copies.append(self.numel() * common.itemsize)  # the output's temporary
    for t in (self, other):
        if t.dtype != common:
            copies.append(t.numel() * common.itemsize)  # the input's copy
    return copies


@RULES.register(WORKSPACE, aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
                aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor, aten.div_.Tensor,
                devices={"cpu"},
                source="aten/src/ATen/TensorIterator.cpp (compute_types: on CPU, inputs copied "
                       "to the common dtype, outputs of another dtype given temporaries)",
                test="tests/test_float8.py::test_float8_linear_peak_matches_a_real_cpu_run")
def binary_op_common_dtype_copies(ctx, func, args, kwargs, out):
    """Mixed-dtype operands of a CPU binary op are copied into their common dtype."""
    if len(args) < 2:
        return None
    return promotion_copies(func, args[0], args[1]) or None
