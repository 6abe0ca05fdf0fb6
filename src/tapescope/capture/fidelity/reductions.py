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

__all__ = ["reduction_scratch", "half_sum_accumulates_in_float", "half_sum_of_layout"]

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


def _reduced_groups(sizes, strides, dims) -> int:
    """How many separate runs the reduced dimensions (of size > 1) form in memory order: runs
    TensorIterator cannot coalesce into one dimension (each dim adjacent in memory to the
    previous reduced one joins its run)."""
    ndim = len(sizes)
    reduced = {d % ndim for d in dims} if dims else set(range(ndim))
    reduced = {d for d in reduced if sizes[d] > 1}
    runs, prev = 0, None
    for d in sorted(range(ndim), key=lambda d: strides[d]):
        if d not in reduced:
            continue
        if prev is None or strides[d] != strides[prev] * sizes[prev]:
            runs += 1
        prev = d
    return runs


def half_sum_accumulates_in_float(x, dims, out_numel: int, out_dtype: torch.dtype) -> list:
    """ReduceOps.cpp sum_out's `should_use_acc_buffer`: a CPU half / bfloat16 sum whose
    iterator's two innermost dimensions are both reduced - reduced dimensions that form two or
    more runs in memory (a bias gradient's sum over (0, 2, 3)) - sums a float copy of the input
    into a float result, then copies it into the output (checked against the allocator for every
    dimension subset of contiguous and permuted 2-D to 4-D tensors)."""
    if out_dtype != x.dtype:
        return []
    return half_sum_of_layout(tuple(x.shape), tuple(x.stride()), x.dtype, dims, out_numel)


def half_sum_of_layout(sizes, strides, dtype: torch.dtype, dims, out_numel: int) -> list:
    """half_sum_accumulates_in_float for a tensor known by its sizes and strides (a buffer a
    kernel makes inside itself), summed into a result of its own dtype."""
    if dtype not in _HALF or _reduced_groups(sizes, strides, dims) < 2:
        return []
    numel = 1
    for s in sizes:
        numel *= s
    return [Alloc("float result", out_numel * 4), Alloc("float input", numel * 4),
            Free("float input"), Free("float result")]


@RULES.register(WORKSPACE, aten.sum.default, aten.sum.dim_IntList, devices={"cpu"},
                source="aten/src/ATen/native/ReduceOps.cpp (sum_out: make_reduction_from_out_ty, "
                       "make_reduction's self.to(in_dtype))",
                test="tests/test_kernel_workspace.py::test_reduction_copies_its_input")
def sum_casts_its_input(ctx, func, args, kwargs, out):
    """A sum into another dtype (bool or int32 into int64, bf16 into float) copies its input."""
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    return (reduction_scratch(x.numel(), x.dtype, out.numel(), out.dtype, mean=False)
            or half_sum_accumulates_in_float(x, dims, out.numel(), out.dtype) or None)


@RULES.register(WORKSPACE, aten.mean.default, aten.mean.dim, devices={"cpu"},
                source="aten/src/ATen/native/ReduceOps.cpp (mean_out: cast_fp32 -> sum -> div -> "
                       "cast for half types)",
                test="tests/test_kernel_workspace.py::test_reduction_copies_its_input")
def mean_sums_in_float(ctx, func, args, kwargs, out):
    """A half or bfloat16 mean sums a float copy of its input into a float result; every mean
    divides by a wrapped int64."""
    x = args[0]
    return reduction_scratch(x.numel(), x.dtype, out.numel(), out.dtype, mean=True)
