"""Softmax on CPU: the contiguous copy the kernel reads.

`softmax_cpu_out` and `log_softmax_cpu_out` (aten/src/ATen/native/SoftMax.cpp) start with
`auto input_ = input.contiguous();`: a softmax over channels-last logits (a segmentation head's
per-pixel class scores) or over a transposed matrix copies its input, in the input's dtype,
after the structured kernel has allocated the (contiguous) result, and frees the copy when it
returns. A fake kernel makes no copy.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = ["softmax_reads_a_contiguous_input"]

aten = torch.ops.aten


@RULES.register(WORKSPACE, aten._softmax.default, aten._log_softmax.default, devices={"cpu"},
                source="aten/src/ATen/native/SoftMax.cpp (softmax_cpu_out, log_softmax_cpu_out: "
                       "input.contiguous())",
                test="tests/test_kernel_workspace.py::test_softmax_copies_a_non_contiguous_input")
def softmax_reads_a_contiguous_input(ctx, func, args, kwargs, out):
    """A non-contiguous input is copied (contiguous format) beside the result."""
    x = args[0]
    if x.is_contiguous():
        return None
    return x.numel() * x.dtype.itemsize
