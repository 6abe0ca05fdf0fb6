"""Fake kernels for ops whose own fake kernel refuses inputs the real kernel of the device runs.

Where torch has no fake kernel at all for an op the real step runs (the CTC loss, whose output
size is the longest target: data), a KERNEL rule is that kernel.

`torch._grouped_mm` is the experts path transformers takes by default for Mixtral, Qwen-MoE,
DeepSeek-style models. Its meta kernel (torch/_meta_registrations.py, `_meta_grouped_mm_common`)
follows the CUDA fast path and refuses fp32; the real CPU kernel and the CUDA fallback
(aten/src/ATen/native/GroupedMMUtils.h) run fp32, fp16 and bf16. A KERNEL rule is a Meta kernel
that checks what the real kernel checks and returns the output the real kernel allocates.

Why the capture's Tape runs these kernels itself instead of registering them with torch.library:
a fake tensor runs an aten op's Meta kernel, and the dispatcher's registrations are process-wide
(torch.library.register_fake refuses aten ops, which have a Meta kernel already). A Meta kernel
registered through a `torch.library.Library("aten", "IMPL")` and destroyed when the capture ends
would be the clean scoped form, but with torch 2.14.1 it is not scoped: after `_destroy()` the
dispatcher's table shows torch's kernel again and plain meta tensors get it, yet FakeTensorMode
keeps reaching the destroyed kernel (the user's own fake-tensor code would then accept fp32 where
torch refuses it). So a KERNEL rule lives in the capture's RuleSet and the Tape runs it in place of
FakeTensorMode's kernel, the way FakeTensorMode runs a custom op's registered fake kernel (under
the mode); nothing outside the capture changes, and FakeTensorMode's process-wide dispatch cache
never sees the op (tests/test_fake_kernels.py checks both).
"""

from __future__ import annotations

import torch

from ...torch_compat import DynamicOutputShapeException
from .registry import FUNCTION, KERNEL, RULES, WORKSPACE

__all__ = ["grouped_mm_output"]

aten = torch.ops.aten


# ---- torch._grouped_mm ------------------------------------------------------------------------

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _strides_transposed(name: str, mat: torch.Tensor) -> None:
    """check_valid_strides_and_return_transposed: row- or column-major in the last two dims, the
    leading stride a multiple of 16 bytes (the data-pointer alignment is not checked on CPU)."""
    st, sz, end = mat.stride(), mat.shape, mat.dim() - 1
    alignment = 16 // mat.element_size()
    if st[end - 1] == 1 and st[end] >= max(1, sz[end - 1]):
        torch._check(st[end] % alignment == 0, lambda: "strides should be multiple of 16 bytes")
    elif st[end] == 1 and st[end - 1] >= max(1, sz[end]):
        torch._check(st[end - 1] % alignment == 0, lambda: "strides should be multiple of 16 bytes")
    else:
        torch._check(False, lambda: f"Invalid strides/sizes, got {list(st)} for strides and "
                                    f"{list(sz)} for sizes")


def grouped_mm_output(mat_a, mat_b, offs, out_dtype) -> torch.Tensor:
    """create_grouped_gemm_output_tensor (not ROCm): the last dimension's stride is padded to 16
    bytes, for TMA transfers on CUDA, and the CPU kernel allocates the same way."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2:
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)] if b2 else [mat_a.size(0), mat_b.size(-1)]
        if not b2:
            torch._check(offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
    elif b2:
        torch._check(offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        torch._check(mat_a.size(0) == mat_b.size(0), lambda: "batched dimension has to match")
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    if torch.version.hip:
        return mat_a.new_empty(size, dtype=out_dtype)
    alignment = 16 // out_dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=out_dtype, device=mat_a.device)


@RULES.register(KERNEL, aten._grouped_mm.default, devices=("cpu", "cuda"),
                source="aten/src/ATen/native/GroupedMMUtils.h (_grouped_mm_validate_inputs, "
                       "create_grouped_gemm_output_tensor), LinearAlgebra.cpp (_grouped_mm)",
                test="tests/test_fake_kernels.py::test_grouped_mm_matches_the_real_kernel")
def grouped_mm_any_float(ctx, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The real kernel takes fp32, bf16 and fp16 (the fallback loops over groups with mm_out)."""
    for name, m in (("mat_a", mat_a), ("mat_b", mat_b)):
        torch._check(m.dtype in _GROUPED_MM_DTYPES, lambda: f"Expected {name} to be Float32, "
                     f"BFloat16 or Float16 matrix, got {m.dtype}")
        torch._check(m.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")
    # the fallback's mm_out needs one dtype for both (mm: "expected m1 and m2 to have the same dtype")
    torch._check(mat_a.dtype == mat_b.dtype, lambda: "expected mat_a and mat_b to have the same "
                 f"dtype, but got: {mat_a.dtype} != {mat_b.dtype}")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a2 and b2):
        torch._check(mat_a.size(-1) == mat_b.size(-2),
                     lambda: "contraction dimension of mat_a and mat_b must match")
    _strides_transposed("mat_a", mat_a)
    _strides_transposed("mat_b", mat_b)
    torch._check((offs is not None) == (a2 or b2), lambda: "Have to provide offsets if there is "
                 "a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    out_dtype = out_dtype or mat_a.dtype
    torch._check(out_dtype == mat_a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    return grouped_mm_output(mat_a, mat_b, offs, out_dtype)


# ---- CTC loss -----------------------------------------------------------------------------------

def _lengths(ctx, lengths, what: str) -> list:
    """Target lengths as ints: given as a list, or the values of a tensor the capture knows (an
    input given as a real tensor, or computed from one: capture/data_values.py)."""
    if isinstance(lengths, (list, tuple)):
        return [int(x) for x in lengths]
    known = ctx.values.read(lengths) if ctx.values is not None else None
    if known is None:
        raise DynamicOutputShapeException(aten._ctc_loss.Tensor)
    return [int(x) for x in (known if isinstance(known, list) else [known])]


@RULES.register(KERNEL, aten._ctc_loss.Tensor, aten._ctc_loss.default, devices=("cpu", "cuda"),
                source="aten/src/ATen/native/LossCTC.cpp (ctc_loss_tensor, "
                       "ctc_loss_cpu_template: log_alpha is batch x T x (2 max target length + 1))",
                test="tests/test_fake_kernels.py::test_ctc_loss_matches_the_real_kernel")
def ctc_loss_with_tensor_lengths(ctx, log_probs, targets, input_lengths, target_lengths,
                                 blank=0, zero_infinity=False):
    """Its output size is the longest target, which FakeTensorMode refuses to compute (the op is
    tagged dynamic-output-shape, even with the lengths as a list). The target lengths' values come from the data the
    user gave (labels as a real tensor); without them the trace stops with a message."""
    longest = max(_lengths(ctx, target_lengths, "target lengths"), default=0)
    batch = log_probs.size(1)
    return (log_probs.new_empty((batch,)),
            log_probs.new_empty((batch, log_probs.size(0), 2 * longest + 1)))


@RULES.register(KERNEL, aten._ctc_loss_backward.Tensor, aten._ctc_loss_backward.default,
                devices=("cpu", "cuda"),
                source="aten/src/ATen/native/LossCTC.cpp (ctc_loss_backward_cpu_template: "
                       "grad = full_like(log_probs, -inf, LEGACY_CONTIGUOUS_MEMORY_FORMAT))",
                test="tests/test_fake_kernels.py::test_ctc_loss_matches_the_real_kernel")
def ctc_loss_backward(ctx, grad, log_probs, *args, **kwargs):
    """The gradient has log_probs' shape, contiguous (torch has no fake kernel for it)."""
    return torch.empty_like(log_probs, memory_format=torch.contiguous_format)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@RULES.register(FUNCTION, torch.ctc_loss, torch.nn.functional.ctc_loss, devices=("cpu",),
                source="aten/src/ATen/native/LossCTC.cpp (ctc_loss with Tensor lengths: the fast "
                       "path for plain tensors reads them into IntArrayRefs; ctc_loss_impl)",
                test="tests/test_fake_kernels.py::test_ctc_loss_matches_the_real_kernel")
def ctc_loss_reads_the_lengths(ctx, func, args, kwargs):
    """For plain tensors `ctc_loss` reads tensor lengths on the host (a copy to int64 where they
    are not) and runs ctc_loss_impl on lists: `_ctc_loss` with lists, then for the mean a
    divisor `at::tensor(target_lengths)` (one `empty`, filled without dispatch), clamped to 1. A
    subclass takes the composite path (`_ctc_loss.Tensor`, the lengths' own clamp). The
    IntArrayRef overload itself cannot run on fake tensors (at::tensor writes into memory), so
    the rule runs ctc_loss_impl's ops."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction",
             "zero_infinity")
    b = dict(zip(names, args), **kwargs)
    values = ctx.values
    lengths = [b.get(n) for n in ("input_lengths", "target_lengths")]
    if values is None or not all(isinstance(t, torch.Tensor) and values.value(t) is not None
                                 for t in lengths):
        return func(*args, **kwargs)
    for t in lengths:
        if t.dtype != torch.int64:
            t.to(torch.int64)  # the host copy the real kernel reads (freed at once)
    il, tl = (_lengths(ctx, t, name) for t, name in zip(lengths, ("input", "target")))
    log_probs, targets = b["log_probs"], b["targets"]
    blank, zero_infinity = b.get("blank", 0), b.get("zero_infinity", False)
    reduction = b.get("reduction", "mean")
    reduction = _REDUCTIONS[reduction] if isinstance(reduction, str) else reduction
    batched = log_probs.dim() == 3
    if not batched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
    res = aten._ctc_loss.default(log_probs, targets, il, tl, blank, zero_infinity)[0]
    if zero_infinity:
        res = torch.where(res == float("inf"), res.new_zeros(()), res)
    if reduction == 1:
        divisor = torch.empty(len(tl), dtype=res.dtype, device=res.device).clamp_min(1)
        return (res / divisor).mean()
    if reduction == 2:
        return res.sum()
    return res if batched else res.squeeze(0)


@RULES.register(WORKSPACE, aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor,
                devices=("cpu",),
                source="aten/src/ATen/native/LossCTC.cpp (ctc_loss_backward_cpu_template: "
                       "log_beta = at::empty_like(log_alpha))",
                test="tests/test_fake_kernels.py::test_ctc_loss_matches_the_real_kernel")
def ctc_loss_backward_log_beta(ctx, func, args, kwargs, out):
    """The backward computes the beta recursion into a log_alpha-sized buffer it frees."""
    log_alpha = args[6] if len(args) > 6 else kwargs["log_alpha"]
    return log_alpha.numel() * log_alpha.element_size()
