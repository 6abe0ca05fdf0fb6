"""Output layouts where PyTorch's fake (meta / decomposition) kernels differ from the real ones.

A fake kernel that gives an output other strides than the real kernel changes what follows: a
`reshape` of a non-contiguous gradient copies (clone + _unsafe_view) where the real step takes a
view, and the copy is memory the real step never allocates. The CUDA kernels allocate grad_input
from X the same way as the CPU ones (layer_norm.cu: `empty_like(X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)`;
group_norm.cpp is shared), to be confirmed on a GPU by tests/test_real_gpu.py.
"""

from __future__ import annotations

import torch

from ...torch_compat import (elementwise_output_strides, pointwise_meta_decompositions,
                             suggest_memory_format)
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


def _in_suggested_format(x_index: int):
    """out[0] as the real CPU kernel allocates it: `empty_like(X, X.suggest_memory_format())`,
    contiguous (or channels-last) whatever X's strides, where the meta kernel keeps X's strides."""
    def handler(ctx, func, args, out):
        first = out[0]
        fmt = suggest_memory_format(args[x_index])
        if first is None or first.is_contiguous(memory_format=fmt):
            return out
        # a fresh output: its storage is shared with nothing yet, so it can be replaced
        return (torch.empty_like(first, memory_format=fmt), *out[1:])
    return handler


for _op, _x, _name in ((aten.native_batch_norm.default, 0, "batch_norm_layout"),
                       (aten._native_batch_norm_legit.default, 0, "batch_norm_legit_layout"),
                       (aten._native_batch_norm_legit.no_stats, 0, "batch_norm_no_stats_layout"),
                       (aten._native_batch_norm_legit_no_training.default, 0,
                        "batch_norm_no_training_layout")):
    RULES.register(
        OUTPUT, _op, devices=("cpu",), name=_name,
        source="aten/src/ATen/native/Normalization.cpp (batch_norm_cpu / batch_norm_backward_cpu: "
               "empty_like(input, input.suggest_memory_format()))",
        test="tests/test_fuzz.py (BatchNorm1d over a transposed input), "
             "tests/test_engine.py::test_batch_norm_output_takes_the_real_kernels_layout",
    )(_in_suggested_format(_x))
# Found by the fuzz run: BatchNorm1d over x.transpose(1, 2) gave an output in X's permuted layout,
# so a later reshape took a view where the real step copies (clone + _unsafe_view).


_layout_of_grad_input = _in_suggested_format(1)


@RULES.register(OUTPUT, aten.native_batch_norm_backward.default, devices=("cpu", "cuda"),
                source="aten/src/ATen/native/Normalization.cpp (batch_norm_backward_cpu: "
                       "grad_input only if output_mask[0], in input.suggest_memory_format()); "
                       "cuda/Normalization.cu (batch_norm_backward_cuda: the same mask)",
                test="tests/test_engine.py::test_batch_norm_output_takes_the_real_kernels_layout")
def batch_norm_backward_outputs(ctx, func, args, out):
    """The real kernels make only the gradients asked for (output_mask): a BatchNorm whose input
    needs no gradient (the first layer) gets no grad_input; the meta kernel makes all three."""
    mask = args[9] if len(args) > 9 else (True, True, True)
    out = tuple(o if keep else None for o, keep in zip(out, mask))
    if ctx.device.type == "cpu":
        out = _layout_of_grad_input(ctx, func, args, out)
    return out


@RULES.register(
    OUTPUT, aten._log_softmax_backward_data.default,
    source="aten/src/ATen/native/SoftMax.cpp (TORCH_META_FUNC(_log_softmax_backward_data): "
           "grad_input in LEGACY_CONTIGUOUS_MEMORY_FORMAT)",
    test="tests/test_fake_kernels.py::test_ctc_loss_matches_the_real_kernel")
def log_softmax_backward_layout(ctx, func, args, out):
    """The real kernel's grad_input is contiguous; the decomposition's follows grad_output, which
    is transposed when the log-softmax output was (a CTC loss takes it as time-major)."""
    if out.is_contiguous():
        return out
    return torch.empty_like(out, memory_format=torch.contiguous_format)


# ---- half-precision elementwise ops with a broadcast operand -------------------------------------
# A pointwise op's fake kernel is its Python reference (_meta_registrations.py activate_meta),
# which for half and bfloat16 first converts every operand to the computation dtype
# (`elementwise_type_promotion_wrapper`); the conversion of an expanded operand (stride 0, the
# gradient of `out.sum()`) is dense and contiguous, and then decides the output's layout. The
# real kernel (TensorIterator, no conversion) lets a broadcast dimension defer to the next
# operand: `expanded_grad * y_channels_last` is channels-last on the CPU and contiguous in the
# trace, and a convolution's backward then copies a grad_output the real step does not.

def _broadcast_strides(t, sizes) -> tuple | None:
    """t's strides seen broadcast to `sizes` (0 on a broadcast dimension), or None when t
    does not broadcast to them."""
    offset = len(sizes) - t.dim()
    if offset < 0:
        return None
    out = [0] * len(sizes)
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        if n != 1 and n != sizes[offset + d]:
            return None
        out[offset + d] = st if n != 1 else 0
    return tuple(out)


def _expanded_half(t) -> bool:
    return (t.dtype in (torch.float16, torch.bfloat16)
            and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())))


def _tensor_iterator_layout(ctx, func, args, out):
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return out
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if len(tensors) < 2 or not any(_expanded_half(t) for t in tensors):
        return out
    sizes = tuple(out.shape)
    strides = [_broadcast_strides(t, sizes) for t in tensors]
    if any(st is None for st in strides):
        return out
    want = elementwise_output_strides(sizes, strides)
    if want == tuple(out.stride()):
        return out
    # a fresh output: its storage is shared with nothing yet, so it can be replaced
    return out.new_empty_strided(sizes, want)


# the real kernel of these is not one TensorIterator over all operands: `masked_fill` clones self
# (contiguous where self is expanded), then fills it in place
_NOT_TENSOR_ITERATOR = {aten.masked_fill.Scalar, aten.masked_fill.Tensor}

RULES.register(
    OUTPUT, *(op for op in pointwise_meta_decompositions() if op not in _NOT_TENSOR_ITERATOR),
    devices=("cpu",),
    name="half_elementwise_broadcast_layout",
    source="aten/src/ATen/TensorIterator.cpp (reorder_dimensions: a broadcast dimension defers "
           "to the next operand) against torch/_refs elementwise_type_promotion_wrapper",
    test="tests/test_kernel_workspace.py::test_half_broadcast_layouts_follow_tensor_iterator, "
         "test_fp16_channels_last_slow2d_matches_the_allocator",
)(_tensor_iterator_layout)
