"""Tracing device="cuda" on a machine with no GPU (needs a CUDA build of torch, not a GPU)."""

from collections import Counter

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.analysis.explain import explain_op, render

from .conftest import TINY_LLAMA, profile_spec, tiny

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")


def _rmsnorm_step(device):
    """The forum post's program: nn.RMSNorm(8) on x of shape (4, 8) that requires grad."""
    return tapescope.profile(lambda: nn.RMSNorm(8), tapescope.spec((4, 8), requires_grad=True),
                             device=device, optimizer=None, steps=1, loss_fn=lambda out, x: out.sum())


def _model_backward(p):
    """Backward ops of the model's own autograd nodes (not the loss's, not gradient bookkeeping)."""
    return [op for op in p.ops if op.phase == "backward" and op.forward_op is not None
            and p.ops[op.forward_op].module != "(loss)" and op.name != "aten.detach.default"]


def _functional(name):
    """AOTAutograd's graphs are functionalised: aten.add_.Tensor appears there as aten.add.Tensor."""
    op, overload = name.split(".")[1:]
    return f"{op.rstrip('_')}.{overload}"


# The backward graph of the forum post for device='meta' (the decomposition), detaches left out.
POST_META_BACKWARD = Counter({
    "mul.Tensor": 6, "sum.dim_IntList": 2, "view.default": 1, "mul.Scalar": 2,
    "pow.Tensor_Scalar": 2, "expand.default": 1, "div.Scalar": 1, "add.Tensor": 1})


def test_forum_rmsnorm_cuda_backward_is_fused():
    p = _rmsnorm_step("cuda")
    fwd = [op.name for op in p.ops if op.phase == "forward" and op.module != "(loss)"]
    bwd = _model_backward(p)
    assert fwd == ["aten._fused_rms_norm.default"]
    assert [op.name for op in bwd] == ["aten._fused_rms_norm_backward.default"]
    assert bwd[0].autograd_node == "FusedRmsNormBackward0"


def test_forum_rmsnorm_meta_backward_is_the_decomposition():
    p = _rmsnorm_step("meta")
    bwd = Counter(_functional(op.name) for op in _model_backward(p))
    assert bwd == POST_META_BACKWARD
    assert not any("fused_rms_norm" in op.name for op in p.ops)


def test_explain_tells_both_stories():
    cuda = render(explain_op("aten::rms_norm", "cuda"))
    meta = render(explain_op("aten::rms_norm", "meta"))
    assert "FusedRmsNormBackward0" in cuda and "aten._fused_rms_norm_backward" in cuda
    assert "decomposes above autograd" in cuda  # rms_norm itself, on every device
    assert "PowBackward0" in meta and "RsqrtBackward0" in meta and "FusedRmsNorm" not in meta


def test_llama_on_cuda_uses_fused_norms_and_foreach_adamw():
    m = tiny(TINY_LLAMA)
    p = profile_spec(m, device="cuda", dtype="bf16")
    names = {op.name for op in p.ops}
    assert "aten._fused_rms_norm.default" in names
    assert "aten._fused_rms_norm_backward.default" in names
    assert p.facts["optimizer"]["implementation"] == "foreach"
    assert any(n.startswith("aten._foreach_") for n in names)
    assert p.peak_bytes > 0 and p.trace.device == torch.device("cuda", 0)
    # parameters are bf16 on the GPU; the optimizer's step counters stay on the CPU (not counted)
    cpu_steps = [s for s in p.trace.storages if s.device.type == "cpu" and "optimizer state" in s.roles]
    assert cpu_steps and p.memory.at_peak["optimizer state"] == 2 * p.memory.at_peak["parameters"]


class _Attention(torch.nn.Module):
    """Self-attention that calls SDPA by the name it was given."""

    def __init__(self, sdpa, d=64, heads=4):
        super().__init__()
        self.sdpa, self.heads = sdpa, heads
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d).sum()


def test_prebound_sdpa_gets_the_same_kernel_as_F_sdpa():
    """`from torch.nn.functional import scaled_dot_product_attention` binds the builtin before
    tapescope runs; the GPU's backend choice must reach it all the same (a patch of
    torch.nn.functional's attribute would not)."""
    from torch.nn.functional import scaled_dot_product_attention as prebound

    x = tapescope.spec((2, 32, 64), dtype="bf16")
    ops = {}
    for label, fn in (("F", lambda *a, **k: torch.nn.functional.scaled_dot_product_attention(*a, **k)),
                      ("prebound", prebound)):
        p = tapescope.profile(_Attention(fn), x, device="cuda", gpu="h100", dtype="bf16")
        ops[label] = [op.name for op in p.ops if op.phase != "optimizer"]
        assert p.facts["sdpa_backends"] == {"cudnn": 1}  # sm90, bf16, head dim 16: cuDNN
    assert ops["F"] == ops["prebound"]
    assert "aten._scaled_dot_product_cudnn_attention.default" in ops["prebound"]
    p = tapescope.profile(_Attention(prebound), x, device="cuda", gpu="a100", dtype="bf16")
    assert p.facts["sdpa_backends"] == {"flash": 1}  # sm80: flash


class _PriorityAttention(_Attention):
    """torchtitan's SDPA wrapper: the call inside sdpa_kernel(backends, set_priority=True)."""

    def __init__(self, order):
        super().__init__(torch.nn.functional.scaled_dot_product_attention)
        self.order = order

    def forward(self, x):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.order, set_priority=True):
            return super().forward(x)


@pytest.mark.parametrize("compile", [None, {"backend": "aot_eager"}], ids=["eager", "compiled"])
@pytest.mark.parametrize("first", ["cudnn", "flash"])
def test_sdpa_kernel_priority_on_cuda_without_a_gpu(compile, first):
    """sdpa_kernel([...], set_priority=True) around attention: on sm90 in bf16 with head dim 16
    both cuDNN and flash can run (sdp_utils.cpp), so the backend is the first of the user's
    order. Under torch.compile dynamo does not trace the context, so the call runs in eager code
    between graphs, in the C++ composite, whose backend choice reads the device ("CUDA driver
    version is insufficient" before): it gets the named GPU's choice too, and nothing of it is
    left in the dispatcher afterwards."""
    from torch.nn.attention import SDPBackend

    order = {"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
             "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]}
    p = tapescope.profile(_PriorityAttention(order[first]), tapescope.spec((2, 32, 64), dtype="bf16"),
                          device="cuda", gpu="h100", dtype="bf16", compile=compile)
    ops = {op.name for op in p.ops}
    assert f"aten._scaled_dot_product_{first}_attention.default" in ops
    other = "flash" if first == "cudnn" else "cudnn"
    assert f"aten._scaled_dot_product_{other}_attention.default" not in ops
    assert set(p.facts["sdpa_backends"]) == {first}
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::scaled_dot_product_attention", "AutogradCUDA")


@pytest.mark.parametrize("gpu,backend", [("h100", "cudnn"), ("a100", "flash")])
def test_compiled_attention_takes_the_gpus_backend(gpu, backend):
    """AOTAutograd traces F.scaled_dot_product_attention through the C++ composite, which on a
    GPU picks the backend (sm90: cuDNN, sm80: flash, bf16, head dim 16; sdp_utils.cpp): its
    graph holds that backend's forward and backward, not the math decomposition."""
    p = tapescope.profile(_Attention(torch.nn.functional.scaled_dot_product_attention),
                          tapescope.spec((2, 32, 64), dtype="bf16"), device="cuda", gpu=gpu,
                          dtype="bf16", compile={"backend": "aot_eager"})
    ops = {op.name for op in p.ops}
    assert {f"aten._scaled_dot_product_{backend}_attention.default",
            f"aten._scaled_dot_product_{backend}_attention_backward.default"} <= ops
    assert "aten._safe_softmax.default" not in ops and "aten.bmm.default" not in ops
