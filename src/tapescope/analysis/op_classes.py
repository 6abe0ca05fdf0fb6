"""Classes of aten ops, defined once: which ops are matmuls, convolutions, attention kernels, and
which launch no kernel or move no data. Keyed by op packet (`aten.mm`), so every overload of an op
is in its class."""

from __future__ import annotations

import torch

__all__ = ["MATMUL", "CONVOLUTION", "ATTENTION", "NO_KERNEL", "NO_TRAFFIC", "NO_KERNEL_NAMES",
           "COPY_KERNELS", "op_class", "launches_kernel", "moves_no_data"]

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

# Ops that launch no kernel, as small rules (`launches_kernel`): views and in-place metadata
# changes (the schema says so: an aliasing result, Tag.inplace_view), and the packets below.
# Ops that only allocate, or only change metadata: no kernel runs, no byte moves.
_ALLOCATION_ONLY = _packets("empty", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_like")
_METADATA_ONLY = _packets("detach", "detach_", "alias", "lift_fresh", "_unsafe_view",
                          "_reshape_alias", "set_", "resize_", "resize_as_", "sym_size",
                          "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
                          "_has_same_storage_numel", "_assert_tensor_metadata", "record_stream")
# Host-side checks of symbolic values (shape guards the exporter and dynamo emit): no kernel.
_HOST_CHECKS = _packets("_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size",
                        "_functional_sym_constrain_range",
                        "_functional_sym_constrain_range_for_size")
# Non-aten ops that launch nothing, by name (their namespaces load with torch.distributed or the
# profiler, so they are matched by name, not by packet):
# - `_c10d_functional.wait_tensor` makes the current stream wait on the collective's work
#   (Functional.cpp: `work->wait()`, a cudaStreamWaitEvent) and returns its input;
# - `_c10d_functional._wrap_tensor_autograd` wraps the collective's result in an
#   AsyncCollectiveTensor around the same storage (_functional_collectives.py): an autograd
#   wrapper, no kernel (costed before as a copy of its input: 0.89 s of a 17 s 70B TP 8 step);
# - the profiler's record_function markers.
NO_KERNEL_NAMES = frozenset({
    "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd",
    "profiler._record_function_enter", "profiler._record_function_enter_new",
    "profiler._record_function_exit",
})
NO_KERNEL = _ALLOCATION_ONLY | _METADATA_ONLY | _HOST_CHECKS
# `.item()` launches a device-to-host copy of one element: a kernel, but no traffic worth counting
NO_TRAFFIC = NO_KERNEL | _packets("_local_scalar_dense")


# Kernels that copy: one read and one write per element (a STREAM Copy), by packet name: casts,
# clones, concatenations and FSDP2's all-gather copy-in / copy-out and reduce-scatter input.
COPY_KERNELS = frozenset({
    "aten.copy_", "aten._to_copy", "aten.clone", "aten.cat", "aten.stack", "aten.contiguous",
    "aten._foreach_copy_", "aten.split_with_sizes_copy", "aten.slice_backward",
    "fsdp.all_gather_copy_in", "fsdp.split_with_sizes_copy", "fsdp.chunk_cat",
})


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
    """Whether an OpOverload runs a kernel on its device (rules above; `moves_no_data` is the
    same set plus `.item()`)."""
    return not (func.is_view or torch.Tag.inplace_view in func.tags
                or func.overloadpacket in NO_KERNEL or str(func.overloadpacket) in NO_KERNEL_NAMES)


def moves_no_data(func) -> bool:
    """No byte moves: the ops that launch no kernel, and `.item()`'s one element."""
    return not launches_kernel(func) or func.overloadpacket in NO_TRAFFIC
