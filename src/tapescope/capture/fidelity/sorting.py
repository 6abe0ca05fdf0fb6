"""CPU sort and unique: the index buffer sort fills its indices from, and unique's sorted copy.

aten/src/ATen/native/cpu/SortingKernel.cpp, `_fill_indices`: before sorting, the kernel writes
0..n-1 into the indices output by copying from `at::arange(n)` (int64, n = the sorted dimension's
length), freed right after: one more n x 8 bytes inside `sort` beyond its two outputs.

aten/src/ATen/native/Unique.cpp, `unique_cpu_sorted_template` (`torch.unique` on the CPU; it
always sorts): `self.contiguous()`, then `input.flatten().sort()`: the sorted values and their
indices (and the sort's own index buffer), alive until the kernel returns; only then are the
outputs sized (`output.resize_`, the inverse and counts where asked) and, with counts, the
`unique_index` of unique_count + 1 int64. A fake `_unique2` allocates its outputs only.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = []

aten = torch.ops.aten
_TEST = "tests/test_detection.py::test_sort_and_unique_allocate_as_their_cpu_kernels"


def _dim_length(x, dim) -> int:
    return x.shape[dim % x.dim()] if x.dim() else 1


@RULES.register(WORKSPACE, aten.sort.default, aten.sort.stable, devices={"cpu"},
                source="aten/src/ATen/native/cpu/SortingKernel.cpp (sort_kernel -> "
                       "_fill_indices: at::arange(dim_size) copied into the indices)", test=_TEST)
def sort_fills_its_indices_from_an_arange(ctx, func, args, kwargs, out):
    """n x 8 bytes (n: the length sorted along), after the outputs; none for a 0-d input."""
    x = args[0]
    if x.dim() == 0:
        return None
    if func is aten.sort.stable:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
    else:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
    return [_dim_length(x, dim) * 8]


@RULES.register(WORKSPACE, aten._unique2.default, devices={"cpu"},
                source="aten/src/ATen/native/Unique.cpp (unique_cpu_sorted_template: "
                       "self.contiguous(), input_flattened.sort(), then the outputs resized, "
                       "unique_index of unique_count + 1 with return_counts)", test=_TEST)
def unique_sorts_a_copy_before_its_outputs(ctx, func, args, kwargs, out):
    """The contiguous input (if a copy), the sort's values and indices and its index buffer,
    then the outputs: all freed when the kernel returns."""
    x = args[0]
    n = x.numel()
    if not n:
        return None
    counts = kwargs.get("return_counts", args[3] if len(args) > 3 else False)
    steps = []
    if not x.is_contiguous():
        steps.append(Alloc("input", n * x.dtype.itemsize))
    steps += [Alloc("sorted", n * x.dtype.itemsize), Alloc("indices", n * 8),
              Alloc("arange", n * 8), Free("arange"), Output(0), Output(1), Output(2)]
    if counts:
        steps.append(Alloc("unique_index", (out[0].shape[0] + 1) * 8))
    return steps
