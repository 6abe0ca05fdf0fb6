"""Output layouts where PyTorch's fake (meta / decomposition) kernels differ from the real ones.

A fake kernel that gives an output other strides than the real kernel changes what follows: a
`reshape` of a non-contiguous gradient copies (clone + _unsafe_view) where the real step takes a
view, and the copy is memory the real step never allocates. The CUDA kernels allocate grad_input
from X the same way as the CPU ones (layer_norm.cu: `empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`;
group_norm.cpp is shared), to be confirmed on a GPU by tests/test_real_gpu.py.
"""

from __future__ import annotations

import torch

from .registry import OUTPUT, RULES

__all__ = []

aten = torch.ops.aten


def _contiguous_grad_input(x_index: int):
    def handler(ctx, func, args, out):
        grad_input = out[0]
        if grad_input is None or grad_input.is_contiguous() or not args[x_index].is_contiguous():
            return out
        # a fresh output: its storage is shared with nothing yet, so it can be replaced
        return (torch.empty_like(grad_input, memory_format=torch.contiguous_format), *out[1:])
    return handler


RULES.register(
    OUTPUT, aten.native_layer_norm_backward.default, name="layer_norm_backward_layout",
    source="aten/src/ATen/native/layer_norm.cpp (layer_norm_backward_cpu: X.expect_contiguous())",
    test="tests/test_engine.py::test_norm_backward_gives_grad_input_the_real_kernels_layout",
)(_contiguous_grad_input(1))
# The real kernels make grad_input contiguous; the decomposition follows grad_out's layout, which
# is permuted when the norm's output was (Swin's last norm, then permute).

RULES.register(
    OUTPUT, aten.native_group_norm_backward.default, name="group_norm_backward_layout",
    source="aten/src/ATen/native/group_norm.cpp (native_group_norm_backward: grad_input in X's layout)",
    test="tests/test_engine.py::test_norm_backward_gives_grad_input_the_real_kernels_layout",
)(_contiguous_grad_input(1))
# The real kernels make grad_input in X's layout; for a contiguous X the decomposition again
# follows grad_out.
