"""Reductions on CPU: the copy a sum or mean makes of its input when the result has another dtype.

ATen's CPU `sum` reduces in the result's dtype: `make_reduction_from_out_ty` (ReduceOps.cpp) passes
the result dtype as the input dtype, and `make_reduction` then runs the reduction over
`self.to(in_dtype)`, an input-sized copy (the special case that reads half inputs directly into
a float sum is for CUDA only). So `mask.sum()` of a bool tensor makes an int64 copy of the mask,
and `x.sum(dtype=torch.float)` of bf16 a float copy. CPU `mean` is `sum_out(...).div_(n)` in a
float result for half and bfloat16 ("for accuracy reasons", mean_out in ReduceOps.cpp): it makes a
float result (`result.to(kFloat)`, result-sized) and sums a float copy of the input. A fake kernel
makes neither copy.

The mean's `div_(n)` wraps n in a 0-d int64 tensor (8 bytes) and casts it to the sum's dtype: those
are modelled here too (elsewhere the scalar temporaries of Python numbers are not,
docs/validation.md).
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE, Alloc, Free

__all__ = ["reduction_scratch"]

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def reduction_scratch(numel, dtype: torch.dtype, out_numel, out_dtype: torch.dtype,
                      mean: bool) -> list:
    """The steps of a CPU sum (mean=False) or mean of `numel` elements of `dtype` into a result of
    `out_numel` elements of `out_dtype`, once the result exists (ReduceOps.cpp, sum_out /
    mean_out)."""
    steps = []
    sum_dtype = out_dtype
    if mean and out_dtype in _HALF:
        sum_dtype = torch.float32
        steps.append(Alloc("float result", out_numel * 4))  # result_mut.to(kFloat)
    if dtype != sum_dtype:  # make_reduction: self.to(in_dtype)
        steps += [Alloc("input copy", numel * sum_dtype.itemsize), Free("input copy")]
    if mean:  # .div_(dim_prod): the int64 wraps as a 0-d tensor, cast to the sum's dtype
        steps += [Alloc("divisor", 8), Alloc("divisor cast", sum_dtype.itemsize),
                  Free("divisor cast"), Free("divisor")]
    return steps


@RULES.register(WORKSPACE, aten.sum.default, aten.sum.dim_IntList, devices={"cpu"},
                source="aten/src/ATen/native/ReduceOps.cpp (sum_out: make_reduction_from_out_ty, "
                       "make_reduction's self.to(in_dtype))",
                test="tests/test_kernel_workspace.py::test_reduction_copies_its_input")
def sum_casts_its_input(ctx, func, args, kwargs, out):
    """A sum into another dtype (bool or int32 into int64, bf16 into float) copies its input."""
    x = args[0]
    return reduction_scratch(x.numel(), x.dtype, out.numel(), out.dtype, mean=False) or None


@RULES.register(WORKSPACE, aten.mean.default, aten.mean.dim, devices={"cpu"},
                source="aten/src/ATen/native/ReduceOps.cpp (mean_out: cast_fp32 -> sum -> div -> "
                       "cast for half types)",
                test="tests/test_kernel_workspace.py::test_reduction_copies_its_input")
def mean_sums_in_float(ctx, func, args, kwargs, out):
    """A half or bfloat16 mean sums a float copy of its input into a float result; every mean
    divides by a wrapped int64."""
    x = args[0]
    return reduction_scratch(x.numel(), x.dtype, out.numel(), out.dtype, mean=True)
