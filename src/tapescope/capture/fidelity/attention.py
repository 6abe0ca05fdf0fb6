"""scaled_dot_product_attention: the backend a named GPU would choose, and the math path's mask add."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ...torch_compat import sdpa_builtin
from .registry import FORWARD_OP, FUNCTION, RULES

__all__ = ["sdpa_composite_of_the_gpu"]


@RULES.register(FUNCTION, sdpa_builtin,
                source="aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend)",
                test="tests/test_devices_sdpa.py, tests/test_cuda_without_gpu.py")
def sdpa_backend_of_the_gpu(ctx, func, args, kwargs):
    """On CUDA the C++ composite picks its backend by asking the device, which a fake CUDA tensor
    on a machine without a GPU cannot answer, so the trace would fall back to the math path.
    devices.sdpa applies sdp_utils.cpp's rules to the named GPU's compute capability and issues the
    ops of the chosen backend. On other devices the composite runs as it is (the CPU's choice does
    not depend on the machine). Either way the call is marked running, for the rule below."""
    if ctx.device.type != "cuda" or ctx.gpu is None:
        return func(*args, **kwargs)
    from ...devices.sdpa import SdpaRequest, call_backend, choose_backend

    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
    req = SdpaRequest.from_tensors(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    backend, _ = choose_backend(req, ctx.gpu.compute_capability)
    ctx.count(f"sdpa:{backend}")
    return call_backend(backend, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


@contextmanager
def sdpa_composite_of_the_gpu(ctx):
    """The rule above, for calls no TorchFunctionMode sees: eager code between torch.compile's
    graphs (tapescope suspends its modes there, as the user's process has none; a graph break at
    `sdpa_kernel(..., set_priority=True)`, which dynamo does not trace, puts torchtitan's
    attention there) and AOTAutograd's trace of a graph. There the C++ composite runs
    (attention.cpp, scaled_dot_product_attention) and asks `_fused_sdp_choice_stub`, a
    DispatchStub no dispatch mode sees, whose CUDA kernel reads the device's properties: "CUDA
    driver version is insufficient" on a machine without a GPU. For a CUDA capture with a named
    GPU the composite's place in the dispatcher (AutogradCUDA, where a CompositeImplicitAutograd
    kernel runs for CUDA tensors, after autocast) gets this capture's choice, and is given back
    when the capture ends. A real GPU's AOTAutograd trace likewise holds the backend's op (as
    `_scaled_dot_product_cudnn_attention`), not the math decomposition."""
    if ctx.device.type != "cuda" or ctx.gpu is None:
        yield
        return

    def composite(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):
        return ctx.call(sdpa_builtin, (query, key, value, attn_mask, dropout_p, is_causal),
                        {"scale": scale, "enable_gqa": enable_gqa})

    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("scaled_dot_product_attention", composite, "AutogradCUDA")
        yield
    finally:
        lib._destroy()


_ADD, _ADD_ = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor


@RULES.register(FORWARD_OP, _ADD,
                source="aten/src/ATen/native/transformers/attention.cpp "
                       "(_scaled_dot_product_attention_math: attn.add_(mask))",
                test="tests/test_engine.py::test_composite_branches_and_literals_run_as_for_plain_tensors")
def sdpa_math_adds_mask_in_place(ctx, func, args, kwargs):
    """The math path adds the mask to the scores with `attn.add_(mask)` for plain tensors,
    `attn.add(mask)` (one more scores-sized tensor) for subclasses; it is the only `add` the math
    path runs (the fused backends run none)."""
    if ctx.inside(sdpa_builtin) and not kwargs and len(args) == 2 \
            and isinstance(args[1], torch.Tensor) \
            and torch.broadcast_shapes(args[0].shape, args[1].shape) == args[0].shape:
        return _ADD_, args, kwargs
    return None
