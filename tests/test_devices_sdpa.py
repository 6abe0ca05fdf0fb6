"""SDPA backend choice for a named GPU, and the ops the composite issues, without a GPU.

Expected choices are derived from the C++ filters cited in each test
(aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.h, torch 2.14.1) with the
runtime of this wheel: cuDNN 9.24.0 (92400), CUDA 13.0.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from tapescope.devices.sdpa import (
    NoSdpaBackendError,
    SdpaEnv,
    SdpaMask,
    SdpaRequest,
    call_backend,
    choose_backend,
    scaled_dot_product_attention,
)

H100, A100, RTX3090, L4, T4, B200, RTX5090 = (9, 0), (8, 0), (8, 6), (8, 9), (7, 5), (10, 0), (12, 0)
ALL = frozenset({"flash", "efficient", "cudnn", "math"})
# The env of this wheel, pinned so the tests do not depend on the machine's cuDNN or env vars.
ENV = SdpaEnv(cudnn_version=92400, cuda_version=13000)
OLD_CUDNN = SdpaEnv(cudnn_version=91500, cuda_version=13000)


def req(b=2, h=8, lq=128, e=64, *, hk=None, lk=None, ev=None, dtype=torch.bfloat16, **kw) -> SdpaRequest:
    hk, lk, ev = hk or h, lq if lk is None else lk, ev or e
    kw.setdefault("requires_grad", True)
    return SdpaRequest(
        q_shape=(b, h, lq, e), k_shape=(b, hk, lk, e), v_shape=(b, hk, lk, ev), dtype=dtype, **kw
    )


def choose(r, cc, enabled=ALL, env=ENV):
    return choose_backend(r, cc, enabled, env=env)


def reasons_text(reasons, backend):
    return " | ".join(reasons[backend])


# --- priority: check_prefer_cudnn_attention / priority_order ---------------------------------------


@pytest.mark.parametrize("e", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_prefers_cudnn_with_new_cudnn(e, dtype):
    # check_prefer_cudnn_attention: cuDNN > 9.15.0 on sm90/sm10x (CUDA 13 build) puts cudnn first.
    backend, reasons = choose(req(e=e, dtype=dtype, is_causal=True), H100)
    assert backend == "cudnn"
    assert "comes first" in reasons_text(reasons, "flash")


@pytest.mark.parametrize("e", [64, 128])
def test_sm90_flash_when_cudnn_not_preferred(e):
    # Same call, cuDNN <= 9.15.0 (or TORCH_CUDNN_SDPA_DEPRIORITIZED=1): Context order, flash first.
    assert choose(req(e=e, is_causal=True), H100, env=OLD_CUDNN)[0] == "flash"
    deprioritized = SdpaEnv(cudnn_version=92400, cudnn_deprioritized=True)
    assert choose(req(e=e, is_causal=True), H100, env=deprioritized)[0] == "flash"
    assert choose(req(e=e, is_causal=True), H100, enabled=ALL - {"cudnn"})[0] == "flash"


def test_cuda12_build_prefers_cudnn_only_on_minor_0_or_3():
    # check_prefer_cudnn_attention, CUDA < 13: (major 9 or 10) and minor 0 or 3.
    env12 = SdpaEnv(cudnn_version=92400, cuda_version=12090)
    assert choose(req(), (10, 0), env=env12)[0] == "cudnn"
    assert choose(req(), (10, 3), env=env12)[0] == "cudnn"
    assert choose(req(), (10, 1), env=env12)[0] == "flash"


@pytest.mark.parametrize("cc", [A100, RTX3090, L4, RTX5090])
def test_other_sm_flash_first(cc):
    # check_prefer_cudnn_attention holds only on sm9x/sm10x: sm80/86/89/120 keep flash first.
    backend, reasons = choose(req(is_causal=True), cc)
    assert backend == "flash"
    assert "comes first" in reasons_text(reasons, "cudnn")


def test_user_priority_order_wins():
    # sdpa_kernel(..., set_priority=True) writes the Context order that priority_order() returns.
    env = SdpaEnv(cudnn_version=92400, priority=("efficient", "flash", "math", "cudnn", "overrideable"))
    assert choose(req(), A100, env=env)[0] == "efficient"


def test_defaults_read_from_torch_flags():
    # enabled=None reads torch.backends.cuda.*_sdp_enabled(), which sdpa_kernel sets.
    r = req()
    with sdpa_kernel(SDPBackend.MATH):
        backend, reasons = choose_backend(r, A100, env=ENV)
    assert backend == "math"
    assert "flash_sdp_enabled() is False" in reasons_text(reasons, "flash")
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert choose_backend(r, A100, env=SdpaEnv.from_torch())[0] == "efficient"
    assert choose_backend(r, A100, env=ENV)[0] == "flash"


def test_env_from_torch_reads_this_wheel():
    env = SdpaEnv.from_torch()
    assert env.cudnn_version == torch.backends.cudnn.version()
    assert env.flash_available == torch.backends.cuda.is_flash_attention_available()


# --- dtypes and hardware ----------------------------------------------------------------------------


def test_fp32_on_sm90_is_efficient():
    # check_dtypes_flash_attention / check_dtypes_low_precision: fp16/bf16 only; mem-efficient
    # takes fp32 (can_use_mem_efficient_attention).
    backend, reasons = choose(req(dtype=torch.float32), H100)
    assert backend == "efficient"
    assert "got float32" in reasons_text(reasons, "flash")
    assert "got float32" in reasons_text(reasons, "cudnn")


def test_sm75_bf16_is_math():
    # check_flash_attention_hardware_support [sm80, sm121]; mem-efficient below sm80 has no bf16;
    # check_cudnn_hardware_support [sm80, sm121].
    backend, reasons = choose(req(dtype=torch.bfloat16), T4)
    assert backend == "math"
    assert "sm80..sm121, target is sm75" in reasons_text(reasons, "flash")
    assert "got bfloat16" in reasons_text(reasons, "efficient")
    assert "sm80..sm121" in reasons_text(reasons, "cudnn")


def test_sm75_fp16_is_efficient_with_gemm_alignment():
    # check_mem_efficient_hardware_support [sm50, sm121]; check_head_dim_size_mem_efficient with
    # minimum_gemm_alignment: 8 for fp16 on sm7x tensor cores.
    assert choose(req(dtype=torch.float16), T4)[0] == "efficient"
    backend, reasons = choose(req(e=60, dtype=torch.float16), T4)
    assert backend == "math"
    assert "divisible by 8" in reasons_text(reasons, "efficient")
    # fp32 on sm75 has no tensor cores: alignment 1.
    assert choose(req(e=60, dtype=torch.float32), T4)[0] == "efficient"


def test_fp8_needs_fa3():
    # check_dtypes_flash_attention: float8_e4m3fn only on sm90+ with FA3 activated.
    r = req(dtype=torch.float8_e4m3fn, requires_grad=False)
    assert choose(r, H100)[0] == "math"
    assert choose(r, H100, env=SdpaEnv(cudnn_version=92400, fa3_enabled=True))[0] == "flash"


# --- head dims ----------------------------------------------------------------------------------


def test_head_dim_over_256_rejects_flash():
    # check_head_dim_size_flash: <= 256. Mem-efficient has no upper bound on CUDA.
    assert choose(req(e=256), A100)[0] == "flash"
    backend, reasons = choose(req(e=264), A100)
    assert backend == "efficient"
    assert "head dim 264 > 256" in reasons_text(reasons, "flash")


def test_odd_head_dim_flash_pads():
    # check_head_dim_size_flash does not need a multiple of 8 (the composite pads); mem-efficient does.
    backend, reasons = choose(req(e=100), A100)
    assert backend == "flash"
    assert "divisible by 8" in reasons_text(reasons, "efficient")


def test_cudnn_head_dim_limits_on_sm90():
    # check_cudnn_tensor_shapes: limit 256 on sm90 with cuDNN > 9.22; check_cudnn_d256_bprop_head_dim:
    # backward only for (<=128, <=128), (192, 128), (256, 256).
    assert choose(req(e=256), H100)[0] == "cudnn"
    backend, reasons = choose(req(e=160), H100)
    assert backend == "flash"
    assert "no backward" in reasons_text(reasons, "cudnn")
    assert choose(req(e=160, requires_grad=False), H100)[0] == "cudnn"
    assert choose(req(e=192, ev=128), H100)[0] == "cudnn"


def test_cudnn_head_dim_limit_128_before_9_22():
    env = SdpaEnv(cudnn_version=92000)
    backend, reasons = choose(req(e=256), H100, env=env)
    assert backend == "flash"
    assert "head dim 256 > 128" in reasons_text(reasons, "cudnn")


@pytest.mark.parametrize("cc", [RTX3090, (8, 7), L4, RTX5090, (12, 1)])
def test_sm86_89_120_training_head_dim_gt192(cc):
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: training needs head
    # dim <= 192, or > 224 without dropout.
    backend, reasons = choose(req(e=224), cc)
    assert backend == "efficient"
    assert "head dim <= 192" in reasons_text(reasons, "flash")
    assert choose(req(e=224, requires_grad=False), cc)[0] == "flash"
    assert choose(req(e=192), cc)[0] == "flash"
    assert choose(req(e=256), cc)[0] == "flash"
    assert choose(req(e=256, dropout_p=0.1), cc)[0] == "efficient"


def test_sm80_has_no_head_dim_training_limit():
    assert choose(req(e=224), A100)[0] == "flash"


# --- dropout, masks, causal, sequence lengths --------------------------------------------------------


def test_dropout():
    # Flash and mem-efficient take any dropout; check_cudnn_dropout wants multiples of 1/16.
    assert choose(req(dropout_p=0.1), A100)[0] == "flash"
    backend, reasons = choose(req(dropout_p=0.1), H100)
    assert backend == "flash"
    assert "multiple of 1/16" in reasons_text(reasons, "cudnn")
    assert choose(req(dropout_p=0.125), H100)[0] == "cudnn"


def test_cudnn_dropout_broken_versions():
    # can_use_cudnn_attention: no dropout with cuDNN 9.11 - 9.13.
    env = SdpaEnv(cudnn_version=91200, priority=("cudnn", "flash", "efficient", "math", "overrideable"))
    backend, reasons = choose(req(dropout_p=0.125), H100, env=env)
    assert backend == "flash"
    assert "9.11 - 9.13" in reasons_text(reasons, "cudnn")


def test_float_mask_rejects_flash():
    # check_for_attn_mask: flash takes no mask; mem-efficient does.
    mask = SdpaMask(torch.bfloat16, (2, 1, 128, 128))
    backend, reasons = choose(req(attn_mask=mask), A100)
    assert backend == "efficient"
    assert "does not support an attn_mask" in reasons_text(reasons, "flash")


def test_mask_shapes_for_cudnn():
    # check_attn_mask_shape: 2-D or 4-D, each dim equal or 1; not requiring grad.
    assert choose(req(attn_mask=SdpaMask(torch.bool, (128, 128))), H100)[0] == "cudnn"
    assert choose(req(attn_mask=SdpaMask(torch.bfloat16, (2, 8, 128, 128))), H100)[0] == "cudnn"
    backend, reasons = choose(req(attn_mask=SdpaMask(torch.bfloat16, (2, 128, 128))), H100)
    assert backend == "efficient"
    assert "attn_mask shape" in reasons_text(reasons, "cudnn")
    grad_mask = SdpaMask(torch.bfloat16, (128, 128), requires_grad=True)
    assert choose(req(attn_mask=grad_mask), H100)[0] == "efficient"


def test_mask_last_dim_stride():
    # check_last_dim_stride_equals_1_dense: on GPU the mask's last dim must have stride 1.
    mask = SdpaMask(torch.bfloat16, (128, 128), stride=(1, 128))
    backend, reasons = choose(req(attn_mask=mask), A100)
    assert backend == "math"
    assert "stride 1" in reasons_text(reasons, "efficient")


def test_causal_non_square_rejects_flash():
    # check_flash_causal_non_square_seqlens.
    backend, reasons = choose(req(lq=64, lk=128, is_causal=True), A100)
    assert backend == "efficient"
    assert "seqlen_q 64 != seqlen_k 128" in reasons_text(reasons, "flash")
    assert choose(req(lq=64, lk=128, is_causal=False), A100)[0] == "flash"


def test_zero_seq_len():
    # check_nonzero_sequence_lengths_dense.
    backend, reasons = choose(req(lk=0), A100)
    assert backend == "math"
    assert "seq_len" in reasons_text(reasons, "flash")


def test_cudnn_kv_len_1_and_decode_guard():
    # check_cudnn_tensor_shapes: no seq_len_kv 1; is_cudnn_attention_decode_disabled: seq_len_q 1
    # on sm10x/11x with cuDNN 9.19 - 9.25.0 except 9.24.1+.
    assert choose(req(lq=128, lk=1), H100)[0] == "flash"
    decode = req(lq=1, lk=128, requires_grad=False)
    backend, reasons = choose(decode, B200)
    assert backend == "flash"
    assert "decode" in reasons_text(reasons, "cudnn")
    assert choose(decode, B200, env=SdpaEnv(cudnn_version=92401))[0] == "cudnn"
    assert choose(decode, H100)[0] == "cudnn"


def test_deterministic_rejects_cudnn():
    # check_cudnn_deterministic.
    env = SdpaEnv(cudnn_version=92400, deterministic=True)
    backend, reasons = choose(req(), H100, env=env)
    assert backend == "flash"
    assert "deterministic" in reasons_text(reasons, "cudnn")
    warn_only = SdpaEnv(cudnn_version=92400, deterministic=True, deterministic_warn_only=True)
    assert choose(req(), H100, env=warn_only)[0] == "cudnn"


# --- GQA / MQA ------------------------------------------------------------------------------------


def test_gqa():
    # check_batch_size_and_num_heads_dense<supports_gqa=true, ...> -> check_grouped_query_attention.
    assert choose(req(h=32, hk=8, enable_gqa=True), A100)[0] == "flash"
    assert choose(req(h=32, hk=8, enable_gqa=True), H100)[0] == "cudnn"
    backend, reasons = choose(req(h=32, hk=8, enable_gqa=False), A100)
    assert backend == "math"
    assert "enable_gqa is False" in reasons_text(reasons, "flash")
    backend, reasons = choose(req(h=32, hk=6, enable_gqa=True), A100)
    assert backend == "math"
    assert "must divide" in reasons_text(reasons, "efficient")


def test_mqa_without_enable_gqa():
    # supports_mqa: key and value with one head broadcast even without enable_gqa.
    assert choose(req(h=32, hk=1), A100)[0] == "flash"


def test_gqa_key_value_heads_differ():
    # requires_same_num_heads: true for flash / mem-efficient, false for cuDNN.
    r = SdpaRequest((2, 32, 128, 64), (2, 8, 128, 64), (2, 4, 128, 64), torch.bfloat16, enable_gqa=True)
    assert choose(r, H100)[0] == "cudnn"
    # On sm80 math comes before cudnn in the order, so math runs once flash and mem-efficient refuse.
    backend, reasons = choose(r, A100)
    assert backend == "math"
    assert "same num_heads" in reasons_text(reasons, "flash")
    assert "comes first" in reasons_text(reasons, "cudnn")


# --- layout, nested, unbatched, errors ----------------------------------------------------------------


def test_unbatched_inputs_are_normalized():
    # normalize_unbatched_input: 3-D q/k/v become 4-D before the filters.
    r = SdpaRequest((8, 128, 64), (8, 128, 64), (8, 128, 64), torch.bfloat16, is_causal=True)
    assert choose(r, A100)[0] == "flash"
    mask = SdpaMask(torch.bool, (128, 128))
    r2 = SdpaRequest((8, 128, 64), (8, 128, 64), (8, 128, 64), torch.bfloat16, attn_mask=mask)
    assert choose(r2, H100)[0] == "cudnn"


def test_five_dims_is_math():
    # check_tensor_shapes.
    shape = (2, 3, 8, 128, 64)
    r = SdpaRequest(shape, shape, shape, torch.bfloat16)
    backend, reasons = choose(r, H100)
    assert backend == "math"
    assert all("4-D" in reasons_text(reasons, b) for b in ("flash", "efficient", "cudnn"))


def test_non_unit_last_stride_is_math():
    # check_last_dim_stride_equals_1_dense.
    s = ((64 * 128 * 8 * 2, 64 * 128, 1, 128),) * 3
    backend, reasons = choose(req(strides=s), A100)
    assert backend == "math"


def test_mem_efficient_pointer_alignment():
    # check_data_ptr_alignment_mem_efficient (sm80+): storage_offset * 2 bytes % 16.
    r = req(dtype=torch.float32, storage_offsets=(3, 0, 0))
    backend, reasons = choose(r, A100)
    assert backend == "math"
    assert "aligned" in reasons_text(reasons, "efficient")
    assert choose(req(dtype=torch.float32, storage_offsets=(4, 0, 0)), A100)[0] == "efficient"


def test_nested():
    # has_for_nested_inputs: cuDNN refuses without TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1;
    # mem-efficient refuses training (check_requires_grad_and_nested); flash takes it (head dim a
    # multiple of 8: check_head_dim_size_flash_nested); dense-only filters are skipped.
    r = req(is_nested=True)
    backend, reasons = choose(r, H100)
    assert backend == "flash"
    assert "nested" in reasons_text(reasons, "cudnn")
    assert "training with nested" in reasons_text(reasons, "efficient")
    assert choose(req(is_nested=True, requires_grad=False, e=264), A100)[0] == "efficient"
    nested_env = SdpaEnv(cudnn_version=92400, cudnn_nested_enabled=True)
    assert choose(req(is_nested=True, lq=256), H100, env=nested_env)[0] == "cudnn"
    assert choose(req(is_nested=True, lq=128), H100, env=nested_env)[0] == "flash"  # seq_len_q <= 128


def test_no_backend_raises():
    # select_sdp_backend: "No available kernel" when nothing is viable and math is off.
    with pytest.raises(NoSdpaBackendError) as err:
        choose(req(dtype=torch.float32), A100, enabled=frozenset({"flash"}))
    assert "got float32" in " ".join(err.value.reasons["flash"])
    with pytest.raises(NoSdpaBackendError):
        choose(req(), A100, enabled=frozenset())
    with pytest.raises(ValueError):
        choose(req(), A100, enabled=frozenset({"fast"}))


def test_every_other_backend_has_reasons():
    backend, reasons = choose(req(), H100)
    assert set(reasons) == {"flash", "efficient", "cudnn", "math"} - {backend}
    assert all(reasons.values())


# --- call_backend under FakeTensorMode on fake CUDA tensors ------------------------------------------


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # aten ops only; `detach` is autograd saving an output for backward, not the composite.
        if func.namespace == "aten" and func is not torch.ops.aten.detach.default:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def fake_qkv(b=2, h=8, lq=128, e=64, *, hk=None, lk=None, dtype=torch.bfloat16):
    hk, lk = hk or h, lq if lk is None else lk
    mk = lambda *s: torch.empty(*s, device="cuda", dtype=dtype, requires_grad=True)  # noqa: E731
    return mk(b, h, lq, e), mk(b, hk, lk, e), mk(b, hk, lk, e)


def run_backward_node(out):
    """Call the output's grad_fn directly (the C++ engine needs a GPU), recording the ops."""
    node = out.grad_fn
    with torch.no_grad(), OpLog() as log:
        grads = node(torch.ones_like(out), *[None] * (len(node._input_metadata) - 1))
    return log.ops, grads


@pytest.fixture
def fake_mode():
    with FakeTensorMode() as mode:
        yield mode


def test_call_flash(fake_mode):
    q, k, v = fake_qkv()
    with OpLog() as log:
        out = call_backend("flash", q, k, v, None, 0.0, True, None, False)
    assert log.ops == ["_scaled_dot_product_flash_attention"]
    assert out.shape == (2, 8, 128, 64) and out.device.type == "cuda"
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"
    ops, grads = run_backward_node(out)
    assert "_scaled_dot_product_flash_attention_backward" in ops
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]


def test_call_flash_pads_head_dim(fake_mode):
    # attention.cpp: pad_last_dim<false>(t, 8) on q/k/v, scale from the unpadded head dim,
    # post_process_flash_output slices the padding off.
    q, k, v = fake_qkv(e=100)
    seen = {}

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._scaled_dot_product_flash_attention.default:
                seen["head_dim"], seen["scale"] = args[0].shape[-1], kwargs["scale"]
            return func(*args, **(kwargs or {}))

    with OpLog() as log, Spy():
        out = call_backend("flash", q, k, v)
    assert log.ops == ["constant_pad_nd"] * 3 + ["_scaled_dot_product_flash_attention", "slice"]
    assert seen == {"head_dim": 104, "scale": 1.0 / math.sqrt(100)}
    assert out.shape == (2, 8, 128, 100)
    assert out.grad_fn.name() == "SliceBackward0"
    assert out.grad_fn.next_functions[0][0].name() == "ScaledDotProductFlashAttentionBackward0"


def test_call_efficient_with_masks(fake_mode):
    q, k, v = fake_qkv(dtype=torch.float32, lk=100)
    # A float (L, S) mask whose rows are not 8-aligned: preprocess_mask pads and slices, then expands.
    mask = torch.empty(128, 100, device="cuda", dtype=torch.float32)
    with OpLog() as log:
        out = call_backend("efficient", q, k, v, mask, 0.0, False, None, False)
    assert log.ops == ["constant_pad_nd", "slice", "expand", "_scaled_dot_product_efficient_attention"]
    assert out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"
    ops, _ = run_backward_node(out)
    assert "_scaled_dot_product_efficient_attention_backward" in ops
    # A bool mask goes through convert_boolean_attn_mask first; 104 columns are aligned: no pad.
    q, k, v = fake_qkv(dtype=torch.float32, lk=104)
    bmask = torch.empty(128, 104, device="cuda", dtype=torch.bool)
    with OpLog() as log:
        call_backend("efficient", q, k, v, bmask)
    convert = ["scalar_tensor", "scalar_tensor", "where"]  # where(mask, 0.0, scalar_tensor(-inf))
    assert log.ops == convert + ["expand", "_scaled_dot_product_efficient_attention"]


def test_call_cudnn(fake_mode):
    q, k, v = fake_qkv(h=32, hk=8)
    with OpLog() as log:
        out = call_backend("cudnn", q, k, v, None, 0.0, True, None, True)
    assert log.ops == ["_scaled_dot_product_cudnn_attention"]  # GQA k/v go in unexpanded
    assert out.grad_fn.name() == "ScaledDotProductCudnnAttentionBackward0"
    ops, grads = run_backward_node(out)
    assert "_scaled_dot_product_cudnn_attention_backward" in ops
    assert grads[1].shape == k.shape


def test_call_math_gqa(fake_mode):
    q, k, v = fake_qkv(h=32, hk=8)
    with OpLog() as log:
        out = call_backend("math", q, k, v, None, 0.0, True, None, True)
    # The math op is composite: bf16 upcast to fp32, k/v repeat_interleave'd to 32 heads (itself
    # unsqueeze/expand/clone/view), softmax, matmuls; no fused kernel.
    assert log.ops[:3] == ["_to_copy"] * 3
    assert log.ops.count("clone") == 2 and "_safe_softmax" in log.ops and "bmm" in log.ops
    assert not any(op.startswith("_scaled_dot_product") for op in log.ops)
    assert out.shape == q.shape and out.dtype == torch.bfloat16


def test_call_unbatched_and_empty(fake_mode):
    q, k, v = (t[0] for t in fake_qkv())
    with OpLog() as log:
        out = call_backend("flash", q, k, v, is_causal=True)
    assert log.ops[-2:] == ["_scaled_dot_product_flash_attention", "squeeze"]
    assert out.shape == (8, 128, 64)
    q, k, v = fake_qkv(lq=0)
    with OpLog() as log:
        out = call_backend("flash", q, k, v)
    assert "_scaled_dot_product_flash_attention" not in log.ops and out.shape == q.shape


def test_end_to_end_on_fake_h100(fake_mode):
    q, k, v = fake_qkv()
    out = scaled_dot_product_attention(q, k, v, is_causal=True, compute_capability=A100, enabled=ALL, env=ENV)
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionBackward0"
    out = scaled_dot_product_attention(q, k, v, is_causal=True, compute_capability=H100, enabled=ALL, env=ENV)
    assert out.grad_fn.name() == "ScaledDotProductCudnnAttentionBackward0"
    req_ = SdpaRequest.from_tensors(q, k, v, is_causal=True)
    assert req_ == req(is_causal=True, strides=req_.strides)


def test_call_backend_rejects_unknown():
    with pytest.raises(ValueError):
        call_backend("fast", *(torch.zeros(1, 1, 2, 8),) * 3)


# --- the shared composite steps match the real composite (CPU, where torch runs it) -------------------


def _ops(fn):
    with OpLog() as log:
        out = fn()
    return log.ops, out


@pytest.mark.parametrize(
    "shapes, kw",
    [
        (((2, 8, 16, 12), (2, 8, 10, 12)), {"attn_mask": "bool2d"}),
        (((8, 16, 12), (8, 10, 12)), {"attn_mask": "bool2d"}),
        (((2, 8, 16, 12), (2, 8, 10, 12)), {"attn_mask": "float4d"}),
        (((2, 8, 16, 12), (2, 8, 16, 12)), {"is_causal": True, "scale": 0.3}),
        (((2, 8, 16, 12), (2, 2, 16, 12)), {"enable_gqa": True}),
        (((2, 8, 0, 12), (2, 8, 10, 12)), {}),
    ],
)
def test_math_path_matches_real_composite(shapes, kw):
    qs, ks = shapes
    q, k, v = torch.randn(*qs, requires_grad=True), torch.randn(*ks), torch.randn(*ks)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool2d":
        kw["attn_mask"] = torch.rand(qs[-2], ks[-2]) > 0.5
    elif kw.get("attn_mask") == "float4d":
        kw["attn_mask"] = torch.randn(2, 1, qs[-2], ks[-2])
    with sdpa_kernel(SDPBackend.MATH):
        real_ops, real = _ops(lambda: F.scaled_dot_product_attention(q, k, v, **kw))
    args = (kw.get("attn_mask"), 0.0, kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False))
    mine_ops, mine = _ops(lambda: call_backend("math", q, k, v, *args))
    assert mine_ops == real_ops
    torch.testing.assert_close(mine, real)
    assert mine.grad_fn.name() == real.grad_fn.name()


def test_cpu_flash_matches_real_composite():
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real_ops, real = _ops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    mine_ops, mine = _ops(lambda: call_backend("flash", q, k, v, is_causal=True))
    assert mine_ops == real_ops
    torch.testing.assert_close(mine, real)
