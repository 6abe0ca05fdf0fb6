"""CPU kernels that read their operands through `.contiguous(format)`: the copy an operand in
another layout costs.

Many CPU kernels index raw memory, so they first take `t.contiguous(format)` of what they read
(and of the output they write, copied back at the end). A tensor already in that format comes
back as is; any other is copied into a fresh buffer of its numel, alive until the kernel returns.
The common case is the expanded (stride-0) gradient `out.sum()` hands the backward of the last
layer: a softmax, a GELU, an upsampling or a padding at the model's end costs one more
output-sized buffer at the start of backward, often where the step peaks. A fake kernel reads any
strides and copies nothing.

Each kernel is one row of `_KERNELS`: the format it switches on and the operands it copies
(pooling kernels, which also copy indices and outputs, are pooling.py; `mm`'s BLAS operands are
matmul.py; LayerNorm's `expect_contiguous` is norms.py). GELU's backward copies through oneDNN
instead: `gelu_backward_copies_through_onednn` below.
"""

from __future__ import annotations

import torch

from ...torch_compat import suggest_memory_format
from .registry import RULES, WORKSPACE

__all__ = ["format_copies", "upsample_2d_channels_last"]

aten = torch.ops.aten
_TEST = "tests/test_kernel_workspace.py::test_kernels_copy_an_expanded_gradient"


def format_copies(fmt: torch.memory_format, *tensors) -> list[int]:
    """Bytes of `t.contiguous(fmt)` for each tensor not already in that format."""
    return [t.numel() * t.dtype.itemsize for t in tensors
            if isinstance(t, torch.Tensor) and t.numel() and not t.is_contiguous(memory_format=fmt)]


# How a kernel picks the format it copies into:
_CONTIGUOUS = "contiguous"       # always the default format
_SUGGESTED = "suggested"         # switch (t.suggest_memory_format()) of operand 0
_IF_CL = "channels-last if so"   # if (t.is_contiguous(ChannelsLast[3d])) of operand 0, else default


def _format(switch: str, t: torch.Tensor) -> torch.memory_format:
    if switch == _SUGGESTED:
        return suggest_memory_format(t)
    if switch == _IF_CL and t.dim() in (4, 5):
        cl = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        if t.is_contiguous(memory_format=cl):
            return cl
    return torch.contiguous_format


_UPSAMPLE = "cpu/UpSampleKernel.cpp ({}_kernel_impl: is_contiguous(ChannelsLast) picks the " \
            "kernel; cpu_upsample_{}: grad_output_.contiguous(format))"
_PADDING = "cpu/PaddingKernel.cpp ({}_kernel_impl: switch (grad_output.suggest_memory_format()); " \
           "cpu_padding_backward: grad_output_.contiguous(format))"

# op -> (source under aten/src/ATen/native/, format switch, operand indices copied)
_KERNELS = {
    aten._softmax.default: ("SoftMax.cpp (softmax_cpu_out: input.contiguous())", _CONTIGUOUS, (0,)),
    aten._log_softmax.default: ("SoftMax.cpp (log_softmax_cpu_out: input.contiguous())",
                                _CONTIGUOUS, (0,)),
    aten._softmax_backward_data.default: (
        "SoftMax.cpp (softmax_backward_cpu_out: grad.contiguous(), output.contiguous())",
        _CONTIGUOUS, (0, 1)),
    aten._log_softmax_backward_data.default: (
        "SoftMax.cpp (log_softmax_backward_cpu_out: grad.contiguous(), output.contiguous())",
        _CONTIGUOUS, (0, 1)),
    aten.native_group_norm_backward.default: (
        "group_norm.cpp (native_group_norm_backward: dY.contiguous(X.suggest_memory_format()), "
        "X.contiguous(...))", "X", (0, 1)),
    aten.embedding_dense_backward.default: (
        "Embedding.cpp (embedding_dense_backward_cpu: grad_.contiguous().view(...), "
        "indices.contiguous())", _CONTIGUOUS, (0, 1)),
    aten.im2col.default: ("Im2Col.cpp (im2col_out_cpu_template: input_.contiguous())",
                          _CONTIGUOUS, (0,)),
    aten.col2im.default: ("Col2Im.cpp (col2im_out_cpu_template: input_.contiguous())",
                          _CONTIGUOUS, (0,)),
    aten.pixel_shuffle.default: (
        "PixelShuffle.cpp (pixel_shuffle_cpu: self.contiguous(self.suggest_memory_format()))",
        _SUGGESTED, (0,)),
    aten.pixel_unshuffle.default: (
        "PixelShuffle.cpp (pixel_unshuffle_cpu: self.contiguous(self.suggest_memory_format()))",
        _SUGGESTED, (0,)),
    aten.channel_shuffle.default: (
        "ChanelShuffle.cpp (channel_shuffle_cpu: self.contiguous(self.suggest_memory_format()))",
        _SUGGESTED, (0,)),
    aten.native_channel_shuffle.default: (
        "ChanelShuffle.cpp (channel_shuffle_cpu: self.contiguous(self.suggest_memory_format()))",
        _SUGGESTED, (0,)),
    aten.upsample_bicubic2d_backward.default: (
        "UpSampleBicubic2d.cpp (upsample_bicubic2d_backward_out_frame: grad_output_.contiguous())",
        _CONTIGUOUS, (0,)),
    **{getattr(aten, f"{name}_backward").default: (
        _UPSAMPLE.format(f"{name}_backward", kind + "_backward"), _IF_CL, (0,))
       for name, kind in (("upsample_nearest1d", "nearest"), ("upsample_nearest2d", "nearest"),
                          ("upsample_nearest3d", "nearest"),
                          ("_upsample_nearest_exact1d", "nearest"),
                          ("_upsample_nearest_exact2d", "nearest"),
                          ("_upsample_nearest_exact3d", "nearest"),
                          ("upsample_linear1d", "linear"), ("upsample_bilinear2d", "linear"),
                          ("upsample_trilinear3d", "linear"))},
    **{getattr(aten, f"{kind}_pad{d}d_backward").default: (
        _PADDING.format(f"{kind}_pad{d}d_backward"), _SUGGESTED if d > 1 else _CONTIGUOUS, (0,))
       for kind in ("reflection", "replication") for d in (1, 2, 3)},
}


def _copies(ctx, func, args, kwargs, out):
    _, switch, reads = _KERNELS[func]
    # group norm decides by the input's format (operand 1), the others by operand 0's
    fmt = suggest_memory_format(args[1]) if switch == "X" else _format(switch, args[0])
    return format_copies(fmt, *(args[i] for i in reads)) or None


for _op, (_source, _, _) in _KERNELS.items():
    RULES.register(WORKSPACE, _op, devices={"cpu"}, name=f"{_op.__name__}_contiguous_copies",
                   source=f"aten/src/ATen/native/{_source}", test=_TEST)(_copies)


def _onednn_bf16(isa: str) -> bool:
    """mkldnn_bf16_device_check() on x86: ideep::has_bf16_type_support(), oneDNN's
    `mayiuse(avx512_core)` (or avx2_vnni_2, which this ISA model folds into avx2)."""
    return isa == "avx512"


@RULES.register(WORKSPACE, aten.gelu_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/Activation.cpp (gelu_backward_out_cpu: "
                       "use_mkldnn(self) for approximate='none' -> ideep::eltwise_backward, "
                       "whose diff_dst.reorder_if_differ_in(pd.diff_dst_desc()) copies a "
                       "gradient that is not in the dense layout of self)",
                test=_TEST)
def gelu_backward_copies_through_onednn(ctx, func, args, kwargs, out):
    """The exact GELU's backward runs in oneDNN where `use_mkldnn(self)` holds (oneDNN enabled,
    self contiguous with more than one element, float32, or bfloat16 where oneDNN has bf16); the
    primitive is made for self's dense layout, so any other gradient is reordered into it."""
    grad, x = args[0], args[1]
    approximate = args[2] if len(args) > 2 else kwargs.get("approximate", "none")
    if (approximate != "none" or not torch.backends.mkldnn.enabled or x.numel() <= 1
            or not x.is_contiguous() or grad.is_contiguous()):
        return None
    if x.dtype is torch.float32 or (x.dtype is torch.bfloat16 and _onednn_bf16(ctx.cpu.isa)):
        return [grad.numel() * grad.dtype.itemsize]
    return None


@RULES.register(WORKSPACE, aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default,
                aten.upsample_bilinear2d.default, devices={"cpu"},
                source="aten/src/ATen/native/cpu/UpSampleKernel.cpp "
                       "(_use_vectorized_kernel_cond_2d: input channels-last with C > 3, or "
                       "output H + W <= 128, picks cpu_upsample_{nearest,linear}_channels_last: "
                       "input_.contiguous(channels_last), output_.contiguous(channels_last), "
                       "copied back; upsample_bilinear2d_kernel_impl_float also when "
                       "at::get_num_threads() == 1 && C == 3)", test=_TEST)
def upsample_2d_runs_channels_last(ctx, func, args, kwargs, out):
    """A small 2-D upsampling output (H + W <= 128) runs the vectorized channels-last kernel
    whatever the layout: a contiguous input and output are both copied into channels-last.
    A bilinear one of a 3-channel image does so at any size on one thread (ATen's benchmarks
    found images faster that way): a detector's resize of its input images."""
    x = args[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 4 \
            or not upsample_2d_channels_last(ctx, func, x, out):
        return None
    return format_copies(torch.channels_last, x, out) or None


def upsample_2d_channels_last(ctx, func, x, out) -> bool:
    """Whether a 2-D upsampling runs the channels-last kernel (else the generic one:
    upsampling.py), as UpSampleKernel.cpp decides."""
    return ((x.is_contiguous(memory_format=torch.channels_last) and x.shape[1] > 3)
            or out.shape[-2] + out.shape[-1] <= 128
            or (func is aten.upsample_bilinear2d.default and ctx.cpu.threads == 1
                and x.shape[1] == 3 and x.dtype is not torch.uint8))
