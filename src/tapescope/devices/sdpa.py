"""Which kernel `F.scaled_dot_product_attention` runs on a given NVIDIA GPU, decided without one.

On CUDA, SDPA is a CompositeImplicitAutograd op: C++ picks a backend (`_fused_sdp_choice_cuda` ->
`select_sdp_backend`) by asking the device, then issues that backend's aten op. On fake CUDA tensors
with no GPU every device query fails, so a trace always records the math path. This module redoes
the choice in Python for a named compute capability (`choose_backend`) and then issues, with
ordinary torch ops, exactly what the composite issues for that backend (`call_backend`), so the
trace and the autograd graph (`ScaledDotProductFlashAttentionBackward0`, ...) are the real ones.

Sources, for torch 2.14.1+cu130 (git 5c4886908584029761b579af026dcfb627c84070), the build here:
- aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: pytorch/pytorch at
  001f694aef6f922b4fdf6d27d59162d27bf3df58, plus the cuDNN decode guard of pytorch PR #194927
  (`is_cudnn_attention_decode_disabled`, called in `check_cudnn_tensor_shapes`). Every constant
  below (sm ranges, cuDNN version cut-offs, head-dim limits, the priority switch) was checked
  against the installed libtorch_cuda.so by disassembling `select_sdp_backend`, `can_use_*`,
  `check_cudnn_tensor_shapes`, `check_dtypes_flash_attention` and
  `is_cudnn_attention_decode_disabled`.
- aten/src/ATen/native/transformers/sdp_utils_cpp.h: the installed header
  (torch/include/ATen/native/transformers/sdp_utils_cpp.h).
- aten/src/ATen/native/transformers/attention.cpp, `scaled_dot_product_attention`: the newest text
  found (with `pad_last_dim<slice>(t, alignment)`, `aligned_tensor` via `maybe_as_int`,
  `convert_boolean_attn_mask` as `where(mask, 0.0, scalar_tensor(-inf))`, the empty-input early
  return), plus the unbatched-input recursion (`sdp::normalize_unbatched_input`) seen in the
  installed libtorch_cpu.so. The math branch was compared op for op with the real composite on CPU.
- torch/nn/attention/__init__.py and torch/backends/cuda/__init__.py (installed): the enable flags
  and `torch._C._get_sdp_priority_order()`.

Checks are tables of rules (one per C++ filter); `choose_backend` reports every failing rule of every
backend it did not choose, where C++ stops at the first failing filter.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch

from ..errors import TapescopeError
from ..torch_compat import fa3_sdp_enabled, overrideable_sdp_enabled, sdp_priority_order

__all__ = [
    "BACKENDS",
    "SdpaMask",
    "SdpaRequest",
    "SdpaEnv",
    "NoSdpaBackendError",
    "choose_backend",
    "call_backend",
    "scaled_dot_product_attention",
]

BACKENDS: tuple[str, ...] = ("flash", "efficient", "cudnn", "math")

# torch._C._SDPBackend values (torch/nn/attention/__init__.py, SDPBackend).
_BACKEND_IDS: Mapping[int, str] = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
# at::Context's initial sdp_priority_order (what torch._C._get_sdp_priority_order() returns until
# someone changes it): flash, efficient, math, cudnn, overrideable.
_CONTEXT_DEFAULT_ORDER: tuple[str, ...] = ("flash", "efficient", "math", "cudnn", "overrideable")
# sdp_utils.cpp, priority_order: the order set once when check_prefer_cudnn_attention() holds.
_CUDNN_FIRST_ORDER: tuple[str, ...] = ("cudnn", "flash", "efficient", "math", "overrideable")

_HALF = frozenset({torch.float16, torch.bfloat16})


# ---------------------------------------------------------------------------------------------
# What is asked, and the runtime it is asked of
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SdpaMask:
    """An attn_mask, described: dtype and shape (stride None means contiguous)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool = False
    stride: tuple[int, ...] | None = None

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SdpaMask:
        return cls(t.dtype, tuple(t.shape), t.requires_grad, tuple(t.stride()))

    @property
    def last_dim_stride(self) -> int:
        return self.stride[-1] if self.stride else 1


@dataclass(frozen=True)
class SdpaRequest:
    """One SDPA call, described in the (B, H, L, E) layout SDPA takes.

    `requires_grad` means what C++ `input_requires_grad` means: some of q/k/v requires grad AND grad
    mode is on. `strides` (None: contiguous) and `storage_offsets` feed the stride-1 and pointer
    alignment filters; `from_tensors` fills everything from real or fake tensors.
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    attn_mask: SdpaMask | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    scale: float | None = None
    requires_grad: bool = False
    is_nested: bool = False
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    storage_offsets: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_tensors(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> SdpaRequest:
        qkv = (query, key, value)
        nested = any(t.is_nested for t in qkv)
        return cls(
            q_shape=tuple(query.shape) if not nested else _nested_shape(query),
            k_shape=tuple(key.shape) if not nested else _nested_shape(key),
            v_shape=tuple(value.shape) if not nested else _nested_shape(value),
            dtype=query.dtype,
            attn_mask=None if attn_mask is None else SdpaMask.from_tensor(attn_mask),
            dropout_p=float(dropout_p),
            is_causal=bool(is_causal),
            enable_gqa=bool(enable_gqa),
            scale=scale,
            requires_grad=any(t.requires_grad for t in qkv) and torch.is_grad_enabled(),
            is_nested=nested,
            strides=None if nested else tuple(tuple(t.stride()) for t in qkv),
            storage_offsets=(0, 0, 0) if nested else tuple(t.storage_offset() for t in qkv),
        )


def _nested_shape(t: torch.Tensor) -> tuple[int, ...]:
    # Ragged dims are reported at their maximum, which is what the nested filters look at. Only
    # strided-layout nested tensors reach these filters (has_for_nested_inputs); jagged ones take
    # the Python path in torch/nested/_internal/sdpa.py.
    if t.layout != torch.strided:
        raise ValueError(f"nested tensors of layout {t.layout} do not reach the C++ SDPA choice")
    sizes = t._nested_tensor_size()
    return (t.size(0), *(int(sizes[:, i].max()) for i in range(sizes.size(1))))


@dataclass(frozen=True)
class SdpaEnv:
    """The runtime facts besides the GPU that the choice depends on. `from_torch()` reads them.

    cudnn_version: cuDNN runtime version as cudnnGetVersion() encodes it (9.24.0 -> 92400), None when
        torch has no cuDNN; the target machine loads the same wheel's cuDNN as this one.
    priority: backend order; None means torch's default for the target GPU (see `_priority`).
    cudnn_deprioritized / cudnn_nested_enabled: env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 /
        TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 (c10::utils::check_env: only "1" is true).
    cuda_version: CUDA the wheel was built with (13.0 -> 13000); check_prefer_cudnn_attention has a
        narrower rule for CUDA < 13.
    mem_efficient_available: USE_MEM_EFF_ATTENTION, which Python cannot query; on in CUDA wheels.
    """

    cudnn_version: int | None = None
    deterministic: bool = False
    deterministic_warn_only: bool = False
    fa3_enabled: bool = False
    priority: tuple[str, ...] | None = None
    cudnn_deprioritized: bool = False
    cudnn_nested_enabled: bool = False
    cuda_version: int = 13000
    flash_available: bool = True
    mem_efficient_available: bool = True

    @classmethod
    def from_torch(cls) -> SdpaEnv:
        order = tuple(_BACKEND_IDS.get(int(i), str(i)) for i in sdp_priority_order())
        return cls(
            cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            fa3_enabled=fa3_sdp_enabled(),
            # An order someone set (sdpa_kernel(..., set_priority=True)) is kept as is.
            priority=None if order == _CONTEXT_DEFAULT_ORDER else order,
            cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") == "1",
            cudnn_nested_enabled=os.environ.get("TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED") == "1",
            cuda_version=_cuda_version_int(torch.version.cuda),
            flash_available=torch.backends.cuda.is_flash_attention_available(),
        )


def _cuda_version_int(v: str | None) -> int:
    if not v:
        return 0
    major, minor = (v.split(".") + ["0"])[:2]
    return int(major) * 1000 + int(minor) * 10


class NoSdpaBackendError(TapescopeError):
    """No backend may run (C++: "No available kernel. Aborting execution." / "Invalid backend")."""

    def __init__(self, message: str, reasons: Mapping[str, list[str]]):
        super().__init__(message)
        self.reasons = dict(reasons)


# ---------------------------------------------------------------------------------------------
# The context the rules read
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ctx:
    req: SdpaRequest
    cc: tuple[int, int]
    env: SdpaEnv
    enabled: frozenset[str]
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

    @property
    def q(self) -> tuple[int, ...]:
        return self.req.q_shape

    @property
    def k(self) -> tuple[int, ...]:
        return self.req.k_shape

    @property
    def v(self) -> tuple[int, ...]:
        return self.req.v_shape

    @property
    def sm(self) -> str:
        return f"sm{self.cc[0]}{self.cc[1]}"

    @property
    def dense(self) -> bool:  # has_only_dense_inputs
        return not self.req.is_nested


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _unsqueeze0(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # The shape and stride Tensor.unsqueeze(0) gives.
    return (1, *shape), ((shape[0] * stride[0]) if shape else 1, *stride)


def _normalize_unbatched(req: SdpaRequest) -> SdpaRequest:
    """sdp_utils_cpp.h, normalize_unbatched_input: 3-D strided q/k/v get a batch dim of 1 (and the
    mask leading 1s up to 4-D) before any fused filter runs."""
    shapes = (req.q_shape, req.k_shape, req.v_shape)
    if req.is_nested or any(len(s) != 3 for s in shapes):
        return req
    strides = req.strides or tuple(_contiguous_stride(s) for s in shapes)
    (q, qs), (k, ks), (v, vs) = (_unsqueeze0(s, st) for s, st in zip(shapes, strides))
    mask = req.attn_mask
    if mask is not None:
        m_shape, m_stride = mask.shape, mask.stride or _contiguous_stride(mask.shape)
        while len(m_shape) < 4:
            m_shape, m_stride = _unsqueeze0(m_shape, m_stride)
        mask = replace(mask, shape=m_shape, stride=m_stride)
    return replace(req, q_shape=q, k_shape=k, v_shape=v, attn_mask=mask, strides=(qs, ks, vs))


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _in_sm_range(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    # sdp_utils.cpp, check_sm_version<lower, upper>: inclusive on (major, minor).
    return lo <= cc <= hi


# ---------------------------------------------------------------------------------------------
# Rules. Each returns None when the filter passes, else why it failed.
# ---------------------------------------------------------------------------------------------

_Check = Callable[[_Ctx], "str | None"]


@dataclass(frozen=True)
class _Rule:
    cpp: str  # the C++ filter this mirrors
    check: _Check
    scope: str = "all"  # "all", "dense" (has_only_dense_inputs) or "nested" (has_for_nested_inputs)
    gate: bool = False  # later rules index q/k/v as 4-D or need the backend built: stop if this fails

    def applies(self, ctx: _Ctx) -> bool:
        return self.scope == "all" or (self.scope == "dense") == ctx.dense


def _runtime_enabled(backend: str, flag: str) -> _Check:
    # sdp_utils_cpp.h check_runtime_disabled_flash / _mem_efficient; sdp_utils.cpp _cudnn.
    def check(ctx: _Ctx) -> str | None:
        if backend not in ctx.enabled:
            return f"{backend} disabled at runtime (torch.backends.cuda.{flag}() is False)"
        return None

    return check


def _four_dims(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_tensor_shapes: all fused kernels need 4-D q, k, v.
    dims = (len(ctx.q), len(ctx.k), len(ctx.v))
    if dims != (4, 4, 4):
        return f"query, key and value must be 4-D, got {dims[0]}-D, {dims[1]}-D, {dims[2]}-D"
    return None


def _sm_range(lo: tuple[int, int], hi: tuple[int, int], what: str) -> _Check:
    # sdp_utils.cpp check_flash_attention_hardware_support [sm80, sm121],
    # check_mem_efficient_hardware_support [sm50, sm121], check_cudnn_hardware_support [sm80, sm121].
    def check(ctx: _Ctx) -> str | None:
        if not _in_sm_range(ctx.cc, lo, hi):
            return f"{what} needs sm{lo[0]}{lo[1]}..sm{hi[0]}{hi[1]}, target is {ctx.sm}"
        return None

    return check


def _dtype_in(allowed: Callable[[_Ctx], frozenset[torch.dtype]], what: str) -> _Check:
    # sdp_utils_cpp.h, check_tensor_dtype (q/k/v share one dtype in a request).
    def check(ctx: _Ctx) -> str | None:
        ok = allowed(ctx)
        if ctx.req.dtype not in ok:
            names = ", ".join(sorted(_dtype_name(d) for d in ok))
            return f"{what} needs dtype in {{{names}}} on {ctx.sm}, got {_dtype_name(ctx.req.dtype)}"
        return None

    return check


def _low_precision_dtypes(ctx: _Ctx) -> frozenset[torch.dtype]:
    # sdp_utils.cpp, check_dtypes_low_precision: fp16+bf16 from sm80, fp16 only below.
    return _HALF if ctx.cc[0] >= 8 else frozenset({torch.float16})


def _flash_dtypes(ctx: _Ctx) -> frozenset[torch.dtype]:
    # sdp_utils.cpp, check_dtypes_flash_attention: fp8 e4m3 too on sm90+ once FA3 is activated.
    if ctx.cc[0] >= 9 and ctx.env.fa3_enabled:
        return _HALF | {torch.float8_e4m3fn}
    return _low_precision_dtypes(ctx)


def _mem_efficient_dtypes(ctx: _Ctx) -> frozenset[torch.dtype]:
    # sdp_utils.cpp, can_use_mem_efficient_attention (CUDA): +bf16 from sm80.
    base = frozenset({torch.float16, torch.float32})
    return base | {torch.bfloat16} if ctx.cc[0] >= 8 else base


def _no_attn_mask(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_for_attn_mask.
    return "flash attention does not support an attn_mask" if ctx.req.attn_mask is not None else None


def _flash_head_dim(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_head_dim_size_flash<false>: same last dim, <= 256 (padding to 8 comes later).
    e = (ctx.q[-1], ctx.k[-1], ctx.v[-1])
    if len(set(e)) != 1:
        return f"flash attention needs equal q/k/v head dims, got {e}"
    if e[0] > 256:
        return f"head dim {e[0]} > 256"
    return None


def _flash_sm86_89_training(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: the flash
    # backward kernels for sm86..sm89 and sm120..sm121 lack head dims (192, 224], and (224, 256]
    # with dropout.
    affected = _in_sm_range(ctx.cc, (8, 6), (8, 9)) or _in_sm_range(ctx.cc, (12, 0), (12, 1))
    if not (ctx.req.requires_grad and affected):
        return None
    d, dropout = ctx.q[-1], ctx.req.dropout_p > 0.0
    if d <= 192 or (not dropout and d > 224):
        return None
    return (
        f"training with head dim {d}{' and dropout' if dropout else ''} on {ctx.sm}: flash needs "
        "head dim <= 192, or > 224 without dropout"
    )


def _flash_causal_square(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_flash_causal_non_square_seqlens: FA2 aligns causal bottom-right, so a
    # non-square causal mask is refused (dense only: skipped for nested q/k).
    if ctx.req.is_causal and not ctx.req.is_nested and ctx.q[-2] != ctx.k[-2]:
        return f"is_causal with seqlen_q {ctx.q[-2]} != seqlen_k {ctx.k[-2]}"
    return None


def _nonzero_seqlens(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_nonzero_sequence_lengths_dense.
    if ctx.q[-2] == 0 or ctx.k[-2] == 0:
        return "fused kernels need seq_len_q and seq_len_kv > 0"
    return None


def _last_dim_stride_1(ignore_singleton: bool) -> _Check:
    # sdp_utils_cpp.h, check_last_dim_stride_equals_1_dense<ignore_singleton_dim>; on GPU the
    # mask's last dim must have stride 1 too.
    def check(ctx: _Ctx) -> str | None:
        qkv_ok = all(s[-1] == 1 for s in ctx.strides)
        if ignore_singleton:
            qkv_ok = qkv_ok or ctx.q[-1] == 1
        mask = ctx.req.attn_mask
        mask_ok = mask is None or mask.last_dim_stride == 1
        if qkv_ok and mask_ok:
            return None
        got = tuple(s[-1] for s in ctx.strides)
        extra = f", attn_mask stride(-1) {mask.last_dim_stride}" if mask is not None else ""
        return f"last dim must have stride 1, got q/k/v stride(-1) {got}{extra}"

    return check


def _batch_and_heads(supports_gqa: bool, same_kv_heads: bool, supports_mqa: bool) -> _Check:
    # sdp_utils_cpp.h, check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads,
    # supports_mqa> and check_grouped_query_attention<requires_same_num_heads>.
    def check(ctx: _Ctx) -> str | None:
        (bq, hq), (bk, hk), (bv, hv) = ctx.q[:2], ctx.k[:2], ctx.v[:2]
        if not bq == bk == bv:
            return f"q/k/v batch sizes differ: {bq}, {bk}, {bv}"
        if ctx.req.enable_gqa and supports_gqa:
            if same_kv_heads and hk != hv:
                return f"key and value need the same num_heads, got {hk} and {hv}"
            if hq % hk != 0 or (not same_kv_heads and hq % hv != 0):
                return f"num_heads of key/value ({hk}/{hv}) must divide num_heads of query ({hq})"
            return None
        if hq == hk == hv:
            return None
        if supports_mqa and hq > 0 and hk == 1 and hv == 1:
            return None  # broadcastable (MQA) heads
        return f"q/k/v num_heads differ ({hq}, {hk}, {hv}) and enable_gqa is False"

    return check


def _try_broadcast(sizes: tuple[int, int, int]) -> bool:
    # sdp_utils_cpp.h, try_broadcast_param_size.
    m = max(sizes)
    return all(s in (m, 1) for s in sizes)


def _batch_nested(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_batch_size_nested.
    b = (ctx.q[0], ctx.k[0], ctx.v[0])
    if len(set(b)) == 1:
        return None
    if ctx.req.requires_grad:
        return "fused kernels do not support training with broadcasted nested inputs"
    return None if _try_broadcast(b) else f"nested batch sizes {b} do not broadcast"


def _seq_len_0_nested(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_for_seq_len_0_nested_tensor (per-sample lengths are described by their
    # maximum, so only an all-empty sequence is seen), then the num_heads broadcast rule.
    if ctx.q[2] == 0 or ctx.k[2] == 0 or ctx.v[2] == 0:
        return "fused kernels do not support seq_len == 0 in nested inputs"
    h = (ctx.q[1], ctx.k[1], ctx.v[1])
    if len(set(h)) == 1:
        return None
    if ctx.req.requires_grad:
        return "fused kernels do not support training with broadcasted nested inputs"
    return None if _try_broadcast(h) else f"nested num_heads {h} do not broadcast"


def _flash_head_dim_nested(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_head_dim_size_flash_nested<false>: equal, multiple of 8, <= 256.
    e = (ctx.q[-1], ctx.k[-1], ctx.v[-1])
    if len(set(e)) == 1 and e[0] % 8 == 0 and e[0] <= 256:
        return None
    return f"nested inputs: flash needs equal head dims, a multiple of 8 and <= 256, got {e}"


def _mem_eff_no_training_nested(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_requires_grad_and_nested.
    if ctx.req.requires_grad:
        return "memory-efficient attention does not support training with nested inputs"
    return None


def _gemm_alignment(ctx: _Ctx) -> int:
    # sdp_utils.cpp, minimum_gemm_alignment / use_tensor_cores.
    is_half = ctx.req.dtype in _HALF
    use_tc = ctx.cc[0] >= 8 or (ctx.cc[0] >= 7 and is_half)
    align = 4 if ctx.cc[0] >= 8 else 1
    return max(align, 128 // (16 if is_half else 32)) if use_tc else align


def _mem_eff_head_dim(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_head_dim_size_mem_efficient (CUDA): q/k head dims equal, q and v head
    # dims positive multiples of minimum_gemm_alignment. No upper bound on CUDA.
    a, dq, dk, dv = _gemm_alignment(ctx), ctx.q[-1], ctx.k[-1], ctx.v[-1]
    if dq == dk and dq > 0 and dv > 0 and dq % a == 0 and dv % a == 0:
        return None
    return (
        "memory-efficient attention needs q/k head dims equal and q/v head dims divisible by "
        f"{a}, got ({dq}, {dk}, {dv})"
    )


def _mem_eff_ptr_alignment(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_data_ptr_alignment_mem_efficient: dense, sm80+; the caching allocator
    # aligns bases to 256 bytes, so storage_offset * element_size decides.
    if not ctx.dense or ctx.cc[0] < 8:
        return None
    size = ctx.req.dtype.itemsize
    align = _gemm_alignment(ctx) * size
    shapes = (ctx.q, ctx.k, ctx.v)
    bad = [
        off * size % align
        for off, shape in zip(ctx.req.storage_offsets, shapes)
        if math.prod(shape) != 0 and off * size % align != 0
    ]
    if bad:
        return f"q/k/v storage offsets must be {align}-byte aligned on sm80+"
    return None


def _cudnn_built(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, can_use_cudnn_attention: needs AT_CUDNN_ENABLED and cuDNN >= 9.0.0.
    v = ctx.env.cudnn_version
    if v is None:
        return "torch was not built with cuDNN"
    if v < 90000:
        return f"cuDNN {v} too old for cuDNN attention (< 9.0.0)"
    return None


def _cudnn_dropout_versions(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, can_use_cudnn_attention: cuDNN 9.11-9.13 heuristics break with dropout.
    v = ctx.env.cudnn_version or 0
    if ctx.req.dropout_p > 0.0 and 91100 < v < 91400:
        return f"cuDNN {v} (9.11 - 9.13) does not support dropout in SDPA"
    return None


def _cudnn_nested(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_for_nested_inputs.
    if not ctx.req.is_nested:
        return None
    if not ctx.env.cudnn_nested_enabled:
        return "cuDNN nested-tensor support is off (TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 turns it on)"
    if ctx.cc[0] not in (9, 10):
        return f"cuDNN SDPA supports nested inputs on sm90/sm10x only, target is {ctx.sm}"
    return None


def _cudnn_deterministic(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_cudnn_deterministic.
    if ctx.env.deterministic and not ctx.env.deterministic_warn_only:
        return "cuDNN SDPA is not deterministic (torch.use_deterministic_algorithms(True))"
    return None


def _mask_shape(ctx: _Ctx) -> str | None:
    # sdp_utils_cpp.h, check_attn_mask_shape: 2-D (L, S) or 4-D (B, H, L, S), each dim equal or 1;
    # a mask that requires grad is refused.
    mask = ctx.req.attn_mask
    if mask is None:
        return None
    if mask.requires_grad:
        return "attn_mask requires grad"

    def fits(m: int, t: int) -> bool:
        return m == t or m == 1

    shape, (b, h, lq), lk = mask.shape, ctx.q[:3], ctx.k[2]
    ok = len(shape) in (2, 4) and fits(shape[-2], lq) and fits(shape[-1], lk)
    if ok and len(shape) == 4:
        ok = fits(shape[0], b) and fits(shape[1], h)
    return None if ok else f"attn_mask shape {shape} is not (L|1, S|1) or (B|1, H|1, L|1, S|1)"


def _cudnn_dropout_resolution(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_cudnn_dropout: probability in steps of 1/16.
    p = ctx.req.dropout_p
    if p * 16.0 != math.floor(p * 16.0):
        return f"cuDNN dropout must be a multiple of 1/16, got {p}"
    return None


def _sm90_or_sm10x(cc: tuple[int, int]) -> bool:
    return cc == (9, 0) or cc[0] == 10


def _cudnn_supports_d256(ctx: _Ctx) -> bool:
    # sdp_utils.cpp, check_cudnn_tensor_shapes / check_cudnn_d256_bprop_head_dim: cuDNN > 9.22,
    # cudnn-frontend >= 1.24 (kCuDNNFrontendSupportsD256: true in this build), sm90/sm10x, and
    # not sm107 with cuDNN <= 9.25.0.
    v = ctx.env.cudnn_version or 0
    sm107_broken = ctx.cc == (10, 7) and v <= 92500
    return _sm90_or_sm10x(ctx.cc) and not sm107_broken and v > 92200


def _cudnn_decode_disabled(ctx: _Ctx) -> bool:
    # sdp_utils.cpp, is_cudnn_attention_decode_disabled (PR #194927, issue #193893): sm10x/sm11x
    # with cuDNN 9.19.0 - 9.25.0 except 9.24.1+ patch releases (disassembly: 91900 <= v <= 92500 and
    # not 92401 <= v <= 92499).
    v = ctx.env.cudnn_version or 0
    return ctx.cc[0] in (10, 11) and 91900 <= v <= 92500 and not 92401 <= v <= 92499


def _cudnn_shapes(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_cudnn_tensor_shapes, in its order (first failure wins).
    b, h, s_q, d_qk = ctx.q
    s_k, d_v = ctx.k[2], ctx.v[3]
    v, p = ctx.env.cudnn_version or 0, ctx.req.dropout_p
    if b > 65535 or h > 65535:
        return f"cuDNN SDPA needs batch and num_heads <= 65535, got {b}, {h}"
    if v < 8903:
        return "cuDNN SDPA needs cuDNN >= 8.9.3"
    if v < 8906 and p != 0.0:
        return "cuDNN dropout needs cuDNN >= 8.9.6"
    if s_q == 1 and _cudnn_decode_disabled(ctx):
        return f"cuDNN SDPA decode (seq_len_q 1) is disabled on {ctx.sm} with cuDNN {v}"
    limit = 128
    if _cudnn_supports_d256(ctx):
        limit = 256
    elif _sm90_or_sm10x(ctx.cc) and v >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    if d_qk > limit or d_v > limit:
        return f"head dim {max(d_qk, d_v)} > {limit} (cuDNN limit on {ctx.sm})"
    if d_qk % 8 or d_v % 8:
        return f"cuDNN SDPA needs head dims that are multiples of 8, got {d_qk}, {d_v}"
    if v < 8906 and s_k % 64:
        return "seq_len_kv not a multiple of 64 needs cuDNN >= 8.9.6"
    if v < 90000 and (s_q < 64 or (p != 0.0 and (s_q % 64 or s_k % 64))):
        return "this seq_len_q needs cuDNN >= 9.0.0"
    if s_k == 1:
        return "cuDNN SDPA does not support key/value sequence length 1"
    if p != 0.0 and s_q == 1:
        return "cuDNN SDPA does not support query sequence length 1 with dropout"
    return None


def _cudnn_d256_backward(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_cudnn_d256_bprop_head_dim: where the d256 kernels are on, backward
    # exists only for (<=128, <=128), (192, 128) and (256, 256).
    if not ctx.req.requires_grad or not _cudnn_supports_d256(ctx):
        return None
    d_qk, d_v = ctx.q[3], ctx.v[3]
    if (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256)):
        return None
    return f"cuDNN SDPA on {ctx.sm} has no backward for head dims (q/k {d_qk}, v {d_v})"


def _cudnn_query_len_nested(ctx: _Ctx) -> str | None:
    # sdp_utils.cpp, check_cudnn_query_seq_len_nested: max seq_len_q must exceed 128.
    return "cuDNN attention needs nested seq_len_q > 128" if ctx.q[2] <= 128 else None


def _built(flag: str, what: str) -> _Check:
    def check(ctx: _Ctx) -> str | None:
        return None if getattr(ctx.env, flag) else f"torch was not built with {what}"

    return check


# Template arguments <supports_gqa, requires_same_num_heads, supports_mqa> as the C++ passes them.
_HEADS_SAME_KV = _batch_and_heads(True, True, True)  # flash; mem-efficient on CUDA
_HEADS_ANY_KV = _batch_and_heads(True, False, True)  # cuDNN

# sdp_utils.cpp, can_use_flash_attention: general, nested, then dense constraints.
_FLASH_RULES: tuple[_Rule, ...] = (
    _Rule("USE_FLASH_ATTENTION", _built("flash_available", "flash attention"), gate=True),
    _Rule("check_runtime_disabled_flash", _runtime_enabled("flash", "flash_sdp_enabled")),
    _Rule("check_tensor_shapes", _four_dims, gate=True),
    _Rule("check_for_attn_mask", _no_attn_mask),
    _Rule("check_head_dim_size_flash", _flash_head_dim),
    _Rule("check_flash_attention_hardware_support", _sm_range((8, 0), (12, 1), "flash attention")),
    _Rule("check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120", _flash_sm86_89_training),
    _Rule("check_flash_causal_non_square_seqlens", _flash_causal_square),
    _Rule("check_dtypes_flash_attention", _dtype_in(_flash_dtypes, "flash attention")),
    _Rule("check_batch_size_nested", _batch_nested, scope="nested"),
    _Rule("check_head_dim_size_flash_nested", _flash_head_dim_nested, scope="nested"),
    _Rule("check_for_seq_len_0_nested_tensor", _seq_len_0_nested, scope="nested"),
    _Rule("check_batch_size_and_num_heads_dense<true, true, true>", _HEADS_SAME_KV, "dense"),
    _Rule("check_nonzero_sequence_lengths_dense", _nonzero_seqlens, scope="dense"),
    _Rule("check_last_dim_stride_equals_1_dense<true>", _last_dim_stride_1(True), scope="dense"),
)

# sdp_utils.cpp, can_use_mem_efficient_attention (CUDA build, not ROCm).
_EFFICIENT_RULES: tuple[_Rule, ...] = (
    _Rule("USE_MEM_EFF_ATTENTION", _built("mem_efficient_available", "mem-efficient attention"), gate=True),
    _Rule("check_runtime_disabled_mem_efficient", _runtime_enabled("efficient", "mem_efficient_sdp_enabled")),
    _Rule("check_mem_efficient_hardware_support", _sm_range((5, 0), (12, 1), "memory-efficient attention")),
    _Rule("check_tensor_shapes", _four_dims, gate=True),
    _Rule("check_head_dim_size_mem_efficient", _mem_eff_head_dim),
    _Rule("check_data_ptr_alignment_mem_efficient", _mem_eff_ptr_alignment),
    _Rule("check_requires_grad_and_nested", _mem_eff_no_training_nested, scope="nested"),
    _Rule("check_batch_size_nested", _batch_nested, scope="nested"),
    _Rule("check_for_seq_len_0_nested_tensor", _seq_len_0_nested, scope="nested"),
    _Rule("check_nonzero_sequence_lengths_dense", _nonzero_seqlens, scope="dense"),
    _Rule("check_last_dim_stride_equals_1_dense<false>", _last_dim_stride_1(False), scope="dense"),
    _Rule("check_batch_size_and_num_heads_dense<true, true, true>", _HEADS_SAME_KV, "dense"),
    _Rule("check_tensor_dtype (mem-efficient)", _dtype_in(_mem_efficient_dtypes, "mem-efficient attention")),
)

# sdp_utils.cpp, can_use_cudnn_attention.
_CUDNN_RULES: tuple[_Rule, ...] = (
    _Rule("AT_CUDNN_ENABLED / CUDNN_VERSION >= 90000", _cudnn_built, gate=True),
    _Rule("can_use_cudnn_attention (dropout on cuDNN 9.11-9.13)", _cudnn_dropout_versions),
    _Rule("check_runtime_disabled_cudnn", _runtime_enabled("cudnn", "cudnn_sdp_enabled")),
    _Rule("check_for_nested_inputs", _cudnn_nested),
    _Rule("check_tensor_shapes", _four_dims, gate=True),
    _Rule("check_cudnn_deterministic", _cudnn_deterministic),
    _Rule("check_dtypes_low_precision", _dtype_in(_low_precision_dtypes, "cuDNN attention")),
    _Rule("check_attn_mask_shape", _mask_shape),
    _Rule("check_cudnn_hardware_support", _sm_range((8, 0), (12, 1), "cuDNN attention")),
    _Rule("check_cudnn_dropout", _cudnn_dropout_resolution),
    _Rule("check_nonzero_sequence_lengths_dense", _nonzero_seqlens, scope="dense"),
    _Rule("check_last_dim_stride_equals_1_dense<true>", _last_dim_stride_1(True), scope="dense"),
    _Rule("check_batch_size_and_num_heads_dense<true, false, true>", _HEADS_ANY_KV, "dense"),
    _Rule("check_cudnn_tensor_shapes", _cudnn_shapes, scope="dense"),
    _Rule("check_cudnn_d256_bprop_head_dim", _cudnn_d256_backward, scope="dense"),
    _Rule("check_cudnn_query_seq_len_nested", _cudnn_query_len_nested, scope="nested"),
)

_RULES: Mapping[str, tuple[_Rule, ...]] = {
    "flash": _FLASH_RULES,
    "efficient": _EFFICIENT_RULES,
    "cudnn": _CUDNN_RULES,
}


def _failures(rules: Sequence[_Rule], ctx: _Ctx) -> list[str]:
    out: list[str] = []
    for rule in rules:
        if not rule.applies(ctx):
            continue
        why = rule.check(ctx)
        if why is not None:
            out.append(f"{why} [{rule.cpp}]")
            if rule.gate:
                break
    return out


# ---------------------------------------------------------------------------------------------
# The choice
# ---------------------------------------------------------------------------------------------


def _enabled_from_torch() -> frozenset[str]:
    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
        "overrideable": overrideable_sdp_enabled(),
    }
    return frozenset(name for name, on in flags.items() if on)


def _prefer_cudnn(cc: tuple[int, int], env: SdpaEnv) -> bool:
    # sdp_utils.cpp, check_prefer_cudnn_attention: cuDNN > 9.15.0 on sm9x/sm10x (CUDA 13 builds;
    # CUDA < 13 builds only minor 0 or 3), unless TORCH_CUDNN_SDPA_DEPRIORITIZED=1.
    v = env.cudnn_version or 0
    if env.cudnn_deprioritized or v <= 91500 or cc[0] not in (9, 10):
        return False
    return env.cuda_version >= 13000 or cc[1] in (0, 3)


def _priority(cc: tuple[int, int], env: SdpaEnv) -> tuple[str, ...]:
    # sdp_utils.cpp, priority_order: the Context order (flash, efficient, math, cudnn), switched
    # once to cudnn-first when check_prefer_cudnn_attention() holds on the device.
    if env.priority is not None:
        return env.priority
    return _CUDNN_FIRST_ORDER if _prefer_cudnn(cc, env) else _CONTEXT_DEFAULT_ORDER


def _check_enabled(enabled: frozenset[str]) -> frozenset[str]:
    unknown = set(enabled) - set(BACKENDS) - {"overrideable"}
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {sorted(unknown)}; expected some of {BACKENDS}")
    return frozenset(enabled)


def choose_backend(
    req: SdpaRequest,
    compute_capability: tuple[int, int],
    enabled: frozenset[str] | None = None,
    *,
    env: SdpaEnv | None = None,
) -> tuple[str, dict[str, list[str]]]:
    """The backend torch's `select_sdp_backend` picks on a GPU of this compute capability.

    Returns (backend, reasons): reasons maps each of the other backends of BACKENDS to why it was
    not used. `enabled` names the backends switched on (None: torch.backends.cuda.*_sdp_enabled()
    now); `env` the other runtime facts (None: SdpaEnv.from_torch()). Raises NoSdpaBackendError
    where torch raises "No available kernel".
    """
    env = SdpaEnv.from_torch() if env is None else env
    on = _check_enabled(_enabled_from_torch() if enabled is None else enabled)
    cc = (int(compute_capability[0]), int(compute_capability[1]))
    norm = _normalize_unbatched(req)
    strides = norm.strides or tuple(_contiguous_stride(s) for s in (norm.q_shape, norm.k_shape, norm.v_shape))
    ctx = _Ctx(norm, cc, env, on, strides)
    fails = {name: _failures(rules, ctx) for name, rules in _RULES.items()}
    math_off = "math disabled at runtime (torch.backends.cuda.math_sdp_enabled() is False)"
    fails["math"] = [] if "math" in on else [math_off]

    order = _priority(cc, env)
    # select_sdp_backend: nothing of math/flash/efficient/cudnn on is an error before any filter.
    chosen = None if not on & set(BACKENDS) else next((b for b in order if b in fails and not fails[b]), None)
    # An enabled "overrideable" met before any viable backend makes torch raise "Invalid backend".
    if chosen is not None and "overrideable" in on and "overrideable" in order:
        if order.index("overrideable") < order.index(chosen):
            chosen = None
    if chosen is None:
        raise NoSdpaBackendError(
            "no SDPA backend can run this call on "
            f"sm{cc[0]}{cc[1]}: " + "; ".join(f"{b}: {', '.join(r) or 'n/a'}" for b, r in fails.items()),
            fails,
        )
    reasons = {}
    for b in BACKENDS:
        if b == chosen:
            continue
        reasons[b] = fails[b] or [f"usable, but {chosen!r} comes first in the priority order {order}"]
    return chosen, reasons


# ---------------------------------------------------------------------------------------------
# Issuing the composite's ops (attention.cpp, scaled_dot_product_attention)
# ---------------------------------------------------------------------------------------------

_aten = torch.ops.aten


def _convert_boolean_attn_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # attention.cpp, convert_boolean_attn_mask: where(mask, 0.0, scalar_tensor(-inf)) - the
    # where.ScalarSelf overload, as C++ `at::where(*attn_mask, 0.0, at::scalar_tensor(...))`.
    if mask is None or mask.dtype != torch.bool:
        return mask
    # aten ops called directly: torch.scalar_tensor would add pin_memory=False, which C++ omits.
    neg_inf = _aten.scalar_tensor.default(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask, 0.0, neg_inf)


def _should_compute_logsumexp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # attention.cpp, should_compute_logsumexp.
    return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()


def _aligned_tensor(t: torch.Tensor, alignment: int) -> bool:
    # attention.cpp, aligned_tensor<alignment>: every stride but the last a known multiple of
    # alignment (an unknown symbolic stride counts as unaligned), the last stride 1.
    for s in t.stride()[:-1]:
        if not isinstance(s, int) or s % alignment:
            return False
    return t.stride(-1) == 1


def _pad_bias(t: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp, pad_bias<alignment>: pad the last dim up (always, even by a full alignment),
    # then slice back, so the storage is aligned and autograd tracks it.
    last = t.size(-1)
    padded = torch.nn.functional.pad(t, (0, alignment - last % alignment))
    return _aten.slice.Tensor(padded, -1, 0, last)


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp, preprocess_mask: mem_eff_alignment 8, then expand to (B, H, L, S).
    if not _aligned_tensor(mask, 8):
        mask = _pad_bias(mask, 8)
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _pad_last_dim(t: torch.Tensor, alignment: int) -> torch.Tensor:
    # attention.cpp, pad_last_dim<slice=false>: FlashAttention-2 needs head dims padded to 8.
    last = t.size(-1)
    if last % alignment == 0:
        return t
    return torch.nn.functional.pad(t, (0, alignment - last % alignment))


def _flash(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    if q.device.type != "cuda":
        # attention.cpp: the CPU flash kernel takes the mask and needs no padding.
        out = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale
        )
        return out[0]
    og_size = q.size(-1)
    qp, kp, vp = (_pad_last_dim(t, 8) for t in (q, k, v))
    # sdp::calculate_scale on the unpadded head dim.
    og_scale = scale if scale is not None else 1.0 / math.sqrt(og_size)
    out = _aten._scaled_dot_product_flash_attention(
        qp, kp, vp, dropout_p, is_causal, False, scale=og_scale  # return_debug_mask=False
    )[0]
    # attention.cpp, post_process_flash_output.
    if not out.is_nested and out.size(-1) != og_size:
        out = _aten.slice.Tensor(out, -1, 0, og_size)
    return out


def _efficient(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    lse = _should_compute_logsumexp(q, k, v)
    if mask is not None:
        mask = _preprocess_mask(mask, q, k)
    out = _aten._scaled_dot_product_efficient_attention(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)
    return out[0]


def _cudnn(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    lse = _should_compute_logsumexp(q, k, v)
    out = _aten._scaled_dot_product_cudnn_attention(
        q, k, v, mask, lse, dropout_p, is_causal, False, scale=scale  # return_debug_mask=False
    )
    return out[0]


def _math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    # The math op is itself composite: it upcasts fp16/bf16 and repeat_interleaves k/v for GQA.
    out = _aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa  # dropout_mask=None
    )
    return out[0]


# The fused ops take GQA k/v as they are (the kernels index k/v heads); only math expands them.
_CALLS: Mapping[str, Callable[..., torch.Tensor]] = {
    "flash": _flash,
    "efficient": _efficient,
    "cudnn": _cudnn,
    "math": _math,
}


def _is_unbatched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # sdp_utils_cpp.h, normalize_unbatched_input's condition.
    qkv = (q, k, v)
    return all(not t.is_nested and t.layout == torch.strided and t.dim() == 3 for t in qkv)


def call_backend(
    backend: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Issue the ops `scaled_dot_product_attention` issues once `backend` is chosen.

    Same arguments as F.scaled_dot_product_attention; works on real or fake tensors. Autograd
    records the backend's own node (ScaledDotProductFlashAttentionBackward0, ...).
    """
    if backend not in _CALLS:
        raise ValueError(f"unknown SDPA backend {backend!r}; expected one of {BACKENDS}")
    if _is_unbatched(query, key, value):
        # attention.cpp: unbatched inputs get a batch dim, run, and lose it again.
        q, k, v = (t.unsqueeze(0) for t in (query, key, value))
        mask = attn_mask
        while mask is not None and mask.dim() < 4:
            mask = mask.unsqueeze(0)
        return call_backend(backend, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa).squeeze(0)
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        # attention.cpp: empty inputs return zeros that still depend on every input.
        shape = [*query.shape[:-1], value.size(-1)]
        out = _aten.zeros.default(shape, dtype=query.dtype, layout=query.layout, device=query.device)
        # `(q.sum() + k.sum() + v.sum()) * 0`, the sums in the order the installed build runs them.
        v_sum, k_sum, q_sum = value.sum(), key.sum(), query.sum()
        return out + _aten.mul.Scalar(q_sum + k_sum + v_sum, 0)
    mask = _convert_boolean_attn_mask(attn_mask, query.dtype)
    return _CALLS[backend](query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    compute_capability: tuple[int, int],
    enabled: frozenset[str] | None = None,
    env: SdpaEnv | None = None,
) -> torch.Tensor:
    """F.scaled_dot_product_attention as a GPU of `compute_capability` would run it: choose, then call."""
    req = SdpaRequest.from_tensors(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    backend, _ = choose_backend(req, compute_capability, enabled, env=env)
    return call_backend(backend, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
