"""Scratch CUDA kernels allocate inside themselves, from their sources. No GPU has measured these
yet (tests/test_kernel_workspace.py checks them against formulas derived by hand from the same
sources; tests/test_real_gpu.py is where a GPU session confirms them).

- Flash attention backward (aten/src/ATen/native/transformers/cuda/attention_backward.cu
  `_flash_attention_backward`, flash_attn/flash_api.cpp `mha_bwd`): contiguous copies of the
  output gradient and the output, `softmax_d` (b x h x round128(s_q) floats), the fp32 dQ
  accumulator `dq_accum` (b x round128(s_q) x h x head_size_rounded floats; with deterministic
  algorithms one per split, nsplits = ceil(SMs / (b x h)), zero-filled), and for grouped-query
  attention dK and dV expanded to all query heads before they are summed.
- Memory-efficient attention backward (`_efficient_attention_backward`): `delta` (b x h x s_q
  floats) from the source; the CUTLASS kernel's gradient accumulators (`Kernel::workspace_size`)
  depend on the kernel instance it picks and are a heuristic (noted).
- LayerNorm backward (cuda/layer_norm_kernel.cu): for M > 64Ki rows of N < 16 x SMs columns,
  per-block partial dgamma and dbeta (`dgamma_blocks`) before `.sum(0)`; `expect_contiguous`
  copies of non-contiguous operands as on CPU.
- cuDNN convolutions and cuDNN attention take their workspace size from cuDNN at run time (the
  algorithm, or the cudnn-frontend execution plan, it picks): not modelled, and the report says so.
- The cuBLAS / cuBLASLt workspace is per handle and stream, not per op: analysis/gpu_memory.py
  models it (one allocation at the first matmul of a stream).
- Fused optimizers (`_fused_adam_`, `_fused_adamw_`: FusedAdamKernel.cu and
  FusedAdamWKernel.cu run multi_tensor_apply over the existing tensors) allocate nothing.
  `_fused_rms_norm_backward` shares LayerNorm's CUDA kernels (the `rms_norm` instance), so it
  may keep the same per-block dgamma for very tall inputs: not verified against its source
  yet, not counted.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE, Alloc

__all__ = ["flash_backward_scratch_bytes"]

aten = torch.ops.aten
_ATTN = "aten/src/ATen/native/transformers/cuda/attention_backward.cu"
_TEST = "tests/test_kernel_workspace.py::test_cuda_kernel_scratch_follows_the_sources"
_GPU_NOTE = "CUDA kernel scratch"


def _round(x, m):
    return (x + m - 1) // m * m


def flash_backward_scratch_bytes(batch, heads, heads_k, seq_q, seq_k, head_dim, itemsize,
                                 deterministic=False, sms=0) -> dict:
    """mha_bwd's scratch for q (batch, seq_q, heads, head_dim), k/v (batch, seq_k, heads_k, .)."""
    head_size = _round(head_dim, 8)
    head_rounded = _round(head_size, 32 if head_size <= 128 else 64)
    seq_q_rounded = _round(seq_q, 128)
    accum = batch * seq_q_rounded * heads * head_rounded * 4
    if deterministic:
        accum *= max(1, -(-sms // (batch * heads)))
    out = {"softmax_d": batch * heads * seq_q_rounded * 4, "dq_accum": accum}
    if heads_k != heads:
        out["dk_expanded"] = out["dv_expanded"] = batch * seq_k * heads * head_size * itemsize
    return out


def _contiguous_copy(t, order=None) -> int:
    """Bytes of `t.contiguous()` (of `t.permute(order)`) where that copies. Computed from the
    sizes and strides: a rule must not run ops on the fake tensors it is shown."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    if order is not None:
        shape, strides = tuple(shape[i] for i in order), tuple(strides[i] for i in order)
    expected = 1
    for size, stride in reversed(list(zip(shape, strides))):
        if size != 1 and stride != expected:
            return t.numel() * t.dtype.itemsize
        expected *= size
    return 0


_BSHD = (0, 2, 1, 3)  # SDPA's (b, h, s, d) read as flash's (b, s, h, d): transpose(1, 2)


def _flash_backward(ctx, grad_out, q, k, v, out, bshd: bool) -> list:
    """q, k, v, out, grad_out in (b, s, h, d) when `bshd`, else SDPA's (b, h, s, d)."""
    order = None if bshd else _BSHD
    qs, ks = tuple(q.shape), tuple(k.shape)
    if order:
        qs, ks = tuple(qs[i] for i in order), tuple(ks[i] for i in order)
    b, s_q, h, d = qs
    s_k, h_k = ks[1], ks[2]
    sms = ctx.gpu.sms if ctx.gpu is not None else 0
    scratch = flash_backward_scratch_bytes(
        b, h, h_k, s_q, s_k, d, q.dtype.itemsize,
        deterministic=torch.are_deterministic_algorithms_enabled(), sms=sms)
    steps = [Alloc("contiguous grad_out", _contiguous_copy(grad_out, order)),
             Alloc("contiguous out", _contiguous_copy(out, order))]
    return steps + [Alloc(name, n) for name, n in scratch.items()]


@RULES.register(WORKSPACE, aten._scaled_dot_product_flash_attention_backward.default,
                devices={"cuda"}, source=f"{_ATTN} (_scaled_dot_product_flash_attention_"
                "backward_cuda, _flash_attention_backward) + flash_attn/flash_api.cpp (mha_bwd)",
                test=_TEST)
def sdpa_flash_backward_scratch(ctx, func, args, kwargs, out):
    grad_out, q, k, v, o = args[:5]
    return _flash_backward(ctx, grad_out, q, k, v, o, bshd=False)


@RULES.register(WORKSPACE, aten._flash_attention_backward.default, devices={"cuda"},
                source=f"{_ATTN} (_flash_attention_backward) + flash_attn/flash_api.cpp "
                       "(mha_bwd)", test=_TEST)
def flash_backward_scratch(ctx, func, args, kwargs, out):
    grad_out, q, k, v, o = args[:5]
    return _flash_backward(ctx, grad_out, q, k, v, o, bshd=True)


@RULES.register(WORKSPACE, aten._scaled_dot_product_efficient_attention_backward.default,
                aten._efficient_attention_backward.default, devices={"cuda"},
                source=f"{_ATTN} (_efficient_attention_backward: delta; "
                       "mem_eff_attention/kernel_backward.h workspace_size)", test=_TEST)
def efficient_attention_backward_scratch(ctx, func, args, kwargs, out):
    q = args[1]
    # SDPA's variant takes (b, h, s, d); the raw op (b, s, h, d)
    sdpa = func is aten._scaled_dot_product_efficient_attention_backward.default
    b, h, s_q = (q.shape[0], q.shape[1], q.shape[2]) if sdpa else \
        (q.shape[0], q.shape[2], q.shape[1])
    ctx.note(_GPU_NOTE, "memory-efficient attention backward: the CUTLASS kernel's gradient "
                        "accumulators depend on the kernel instance it picks; only `delta` is "
                        "counted (from the source, not measured)")
    return [Alloc("delta", b * h * s_q * 4)]


@RULES.register(WORKSPACE, aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_cudnn_attention_backward.default, devices={"cuda"},
                source="aten/src/ATen/native/cudnn/MHA.cpp (the cudnn-frontend graph's "
                       "get_workspace_size(), known at run time)", test=_TEST)
def cudnn_attention_workspace_not_modelled(ctx, func, args, kwargs, out):
    ctx.note(_GPU_NOTE, "cuDNN attention: its workspace is the execution plan's, chosen by "
                        "cuDNN at run time; not counted")
    return None


@RULES.register(WORKSPACE, aten.convolution.default, aten.convolution_backward.default,
                devices={"cuda"}, source="aten/src/ATen/native/cudnn/Conv_v8.cpp (the engine "
                "cuDNN's heuristics or benchmark mode pick, and its workspace)", test=_TEST)
def cudnn_convolution_workspace_not_modelled(ctx, func, args, kwargs, out):
    ctx.note(_GPU_NOTE, "cuDNN convolution: its workspace depends on the algorithm cuDNN picks "
                        "at run time (up to the free memory with benchmark=True); not counted")
    return None


@RULES.register(WORKSPACE, aten.native_layer_norm_backward.default, devices={"cuda"},
                source="aten/src/ATen/native/cuda/layer_norm_kernel.cu (layer_norm_backward_cuda: "
                       "expect_contiguous; LaunchGammaBetaBackwardCUDAKernel: dgamma_blocks for "
                       "M > 64Ki and N / 32 < SMs / 2)", test=_TEST)
def layer_norm_backward_cuda_scratch(ctx, func, args, kwargs, out):
    grad_out, x, normalized_shape, _, _, weight, bias, mask = args[:8]
    n = 1
    for s in normalized_shape:
        n *= s
    m = x.numel() // n if n else 0
    steps = [Alloc("contiguous x", _contiguous_copy(x)),
             Alloc("contiguous dY", _contiguous_copy(grad_out))]
    sms = ctx.gpu.sms if ctx.gpu is not None else 0
    if (mask[1] or mask[2]) and weight is not None and m > 64 * 1024 and n // 32 < sms // 2:
        blocks_x = -(-n // 32)
        blocks_y = min((64 * 1024 // 2) // blocks_x, -(-m // 32))
        rows = blocks_y * n * weight.dtype.itemsize
        steps += [Alloc("dgamma_blocks", rows if mask[1] else 0),
                  Alloc("dbeta_blocks", rows if mask[2] else 0)]
    return steps
