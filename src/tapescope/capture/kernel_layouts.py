"""Output layouts where PyTorch's fake (meta / decomposition) kernels differ from the real ones.

A fake kernel that gives an output other strides than the real kernel changes what follows: a
`reshape` of a non-contiguous gradient copies (clone + _unsafe_view) where the real step takes a
view, and the copy is memory the real step never allocates. Checked against the real CPU kernels
(tests/test_engine.py, op sequences against the profiler); the CUDA kernels allocate grad_input
from X the same way (layer_norm.cu: `empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`;
group_norm.cpp is shared), to be confirmed on a GPU by tests/test_real_gpu.py.

- native_layer_norm_backward: the real kernels make grad_input contiguous (they compute on
  `X.expect_contiguous()`); the decomposition follows grad_out's layout, which is permuted when
  the norm's output was (Swin's last norm, then permute).
- native_group_norm_backward: the real kernels make grad_input in X's layout; for a contiguous X
  the decomposition again follows grad_out.
"""

from __future__ import annotations

import torch

__all__ = ["real_kernel_layout"]

aten = torch.ops.aten
_GRAD_INPUT_CONTIGUOUS = {aten.native_layer_norm_backward.default: 1,   # input is argument 1
                          aten.native_group_norm_backward.default: 1}


def real_kernel_layout(func, args, out):
    """`out` with the strides the real kernel gives its outputs (the same object if they agree).
    Call inside the fake mode, on a fresh output: its storage is not shared with anything yet."""
    x_index = _GRAD_INPUT_CONTIGUOUS.get(func)
    if x_index is None:
        return out
    grad_input = out[0]
    if grad_input is None or grad_input.is_contiguous() or not args[x_index].is_contiguous():
        return out
    return (torch.empty_like(grad_input, memory_format=torch.contiguous_format), *out[1:])
