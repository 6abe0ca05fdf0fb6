"""Classes of aten ops, defined once: which ops are matmuls, convolutions, attention kernels, and
which launch no kernel or move no data. Keyed by op packet (`aten.mm`), so every overload of an op
is in its class."""

from __future__ import annotations

import torch

__all__ = ["MATMUL", "CONVOLUTION", "ATTENTION", "NO_KERNEL", "NO_TRAFFIC", "op_class",
           "launches_kernel"]

aten = torch.ops.aten


def _packets(*names) -> frozenset:
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# GEMM kernels (cuBLAS / cuBLASLt on CUDA). matmul and linear are composites: a trace records
# the mm/addmm/bmm they call, never them.
MATMUL = _packets("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm", "_grouped_mm",
                  "_scaled_grouped_mm")
CONVOLUTION = _packets("convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                       "cudnn_convolution_transpose", "mkldnn_convolution",
                       "_slow_conv2d_forward", "_slow_conv2d_backward", "convolution_overrideable")
# the fused attention kernels and their backward (the math path is made of matmuls and softmax)
ATTENTION = _packets(
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_fused_attention_overrideable_backward")

# Ops that only allocate, or only change metadata: no kernel runs, no byte moves.
_ALLOCATION_ONLY = _packets("empty", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_like")
_METADATA_ONLY = _packets("detach", "detach_", "alias", "lift_fresh", "_unsafe_view",
                          "_reshape_alias", "set_", "resize_")
NO_KERNEL = _ALLOCATION_ONLY | _METADATA_ONLY
# `.item()` launches a device-to-host copy of one element: a kernel, but no traffic worth counting
NO_TRAFFIC = NO_KERNEL | _packets("_local_scalar_dense")


def op_class(func) -> str:
    """"matmul", "convolution", "attention" or "other" for an OpOverload."""
    packet = func.overloadpacket
    if packet in MATMUL:
        return "matmul"
    if packet in CONVOLUTION:
        return "convolution"
    if packet in ATTENTION:
        return "attention"
    return "other"


def launches_kernel(func) -> bool:
    return not func.is_view and func.overloadpacket not in NO_KERNEL
