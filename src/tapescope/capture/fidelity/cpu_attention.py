"""The CPU flash-attention kernels' per-thread buffers (aten/src/ATen/native/cpu/
FlashAttentionKernel.cpp).

`cpu_flash_attention` splits the queries into blocks of `q_split` rows (256 from 768 queries on,
64 from 192, else 32) and the keys into blocks of 512, and allocates, after the output and the
logsumexp, one accumulator buffer per thread: q_split x kv_split scores, two q_split row
statistics and a q_split x head_size output block, in the accumulation type (float for bf16 and
fp16); reduced types add a q_split x kv_split buffer per thread in their own type. The backward
allocates, after grad_q/k/v, q_split x kv_split scores and their gradient per thread (and their
reduced copies), then a q_split row sum (`dsum`) in each thread's chunk; the profiler (the truth
the tests use) sees the calling thread's, which is the one counted here: the other threads'
(q_split floats each) are not. The backward also makes `grad_out.contiguous()`.

In bf16 and fp16 the backward's GEMMs run on oneDNN (cpublas::gemm), each allocating scratch inside
the call that is not modelled (reported as an estimate). fp16 on a CPU with AMX-FP16 can take a
packed path (`cpublas::need_pack`) with its own reordered
key and value buffers: not modelled (reported as an estimate).
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE, Alloc, Free

__all__ = ["flash_attention_buffers", "flash_attention_backward_buffers"]

aten = torch.ops.aten
_REDUCED = (torch.bfloat16, torch.float16)
_SOURCE = "aten/src/ATen/native/cpu/FlashAttentionKernel.cpp (cpu_flash_attention{,_backward})"
_TEST = "tests/test_kernel_workspace.py::test_cpu_flash_attention_buffers"


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """flash_attention{,_backward}_kernel_impl's block sizes, clipped to the sequences."""
    q_split = 256 if q_len >= 768 else (64 if q_len >= 192 else 32)
    return min(q_split, q_len), min(512, kv_len)


def _symbolic(ctx, *sizes) -> bool:
    """The block sizes are piecewise in the sequence lengths, which a symbolic profile's
    polynomial formulas cannot hold (and a Python branch would guard the sequence to one side
    of each threshold): on a symbolic trace the buffers are left out, and the report says so."""
    if all(isinstance(s, int) for s in sizes):
        return False
    ctx.note("CPU flash attention", "its per-thread buffers (piecewise in the sequence length) "
             "are not in the symbolic formulas; a concrete profile counts them")
    return True


def _transposed_is_contiguous(t) -> bool | None:
    """`t.transpose(1, 2).is_contiguous()` from t's sizes and strides, as c10 computes it
    (c10/core/Contiguity.h, `_compute_contiguous`: no element is contiguous; else, from the last
    dim, every dim of size != 1 has the product of the sizes after it as its stride), without
    the transpose: an op on a fake tensor inside a rule goes through FakeTensorMode (~140 us,
    once per attention layer). None for symbolic sizes, whose comparisons would add guards."""
    shape, strides = list(t.shape), list(t.stride())
    if any(type(x) is not int for x in (*shape, *strides)):
        return None
    shape[1], shape[2], strides[1], strides[2] = shape[2], shape[1], strides[2], strides[1]
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _accum_bytes(dtype: torch.dtype) -> int:
    return 4 if dtype in _REDUCED else dtype.itemsize


def _note_fp16_pack(ctx, dtype) -> None:
    if dtype == torch.float16:
        ctx.note("CPU flash attention", "fp16 may take the AMX packed path, whose reordered "
                 "key/value buffers are not counted (an estimate)")


@RULES.register(WORKSPACE, aten._scaled_dot_product_flash_attention_for_cpu.default,
                devices={"cpu"}, source=_SOURCE, test=_TEST)
def flash_attention_buffers(ctx, func, args, kwargs, out):
    """Per-thread scores, row statistics and output block (cpu_flash_attention `buf`)."""
    q, k = args[0], args[1]
    q_len, head, kv_len = q.shape[2], q.shape[3], k.shape[2]
    if _symbolic(ctx, q_len, kv_len, head):
        return None
    q_split, kv_split = _splits(q_len, kv_len)
    threads = ctx.cpu.threads
    per_thread = q_split * kv_split + 2 * q_split + q_split * head
    steps = [Alloc("buf", threads * per_thread * _accum_bytes(q.dtype))]
    if q.dtype in _REDUCED:
        steps.append(Alloc("buf_reduced", threads * q_split * kv_split * q.dtype.itemsize))
    _note_fp16_pack(ctx, q.dtype)
    return steps


@RULES.register(WORKSPACE, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                devices={"cpu"}, source=_SOURCE, test=_TEST)
def flash_attention_backward_buffers(ctx, func, args, kwargs, out):
    """grad_out made contiguous, per-thread scores and their gradients, the row sum."""
    grad_out, q, k = args[0], args[1], args[2]
    # the kernel sees (batch, seq, heads, head) views: contiguous() copies unless grad_out's
    # transpose(1, 2) is contiguous
    steps = []
    contiguous = _transposed_is_contiguous(grad_out)
    if contiguous is None:  # symbolic sizes: torch's answer, with the guards it adds
        contiguous = grad_out.transpose(1, 2).is_contiguous()
    if not contiguous:
        steps.append(Alloc("grad_out", grad_out.numel() * grad_out.dtype.itemsize))
    q_len, kv_len = q.shape[2], k.shape[2]
    if _symbolic(ctx, q_len, kv_len):
        return steps or None
    q_split, kv_split = _splits(q_len, kv_len)
    threads = ctx.cpu.threads
    accum = _accum_bytes(q.dtype)
    steps.append(Alloc("buf", threads * 2 * q_split * kv_split * accum))
    if q.dtype in _REDUCED:
        steps.append(Alloc("buf_reduced", threads * 2 * q_split * kv_split * q.dtype.itemsize))
    steps += [Alloc("dsum", q_split * accum), Free("dsum")]
    if q.dtype in _REDUCED:
        ctx.note("CPU flash attention", "the reduced-precision backward's GEMMs run on oneDNN, "
                 "whose scratch inside each call (tens of KB) is not counted (an estimate)")
    return steps
