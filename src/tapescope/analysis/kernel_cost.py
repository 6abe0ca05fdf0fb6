"""What one GPU kernel costs: the per-kernel half of the step-time model.

A `Kernel` is the work of one kernel launch, as a plain record: its op class, FLOPs, DRAM bytes,
math dtype, and the shape facts the efficiency model needs (a GEMM's output shape). Eager ops
become Kernels through `kernel_of` (one aten op, one kernel); an inductor-compiled step's generated
kernels are built as Kernels from inductor's own figures. `kernel_time` prices one Kernel on a
named GPU; analysis/timing.py schedules the priced kernels on the host and the GPU's streams.

Each kernel takes max(FLOPs / achieved FLOP/s, bytes moved / achieved bandwidth) plus a kernel
overhead (devices/efficiency.py holds every constant and its source):
- matmuls: the GPU's measured matmul ceiling times the share of the tile work that is useful for
  the output's shape (tile and wave quantization over the GPU's SMs, at the best of cuBLAS's
  tiles); fp32 matmuls run on CUDA cores (allow_tf32 is off by default);
- fused attention: the share of peak the backend (flash, cuDNN, memory-efficient) reaches on the
  architecture, forward and backward apart;
- convolutions (TF32 for fp32: cudnn.allow_tf32 is on) and other ops: the class's prior;
- memory-bound kernels move their bytes at ELEMENTWISE_BANDWIDTH of the DRAM peak.
Small kernels cannot fill the GPU: their efficiency falls off below the class's saturation size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..devices.efficiency import (ELEMENTWISE_BANDWIDTH, KERNEL_OVERHEAD_S, attention_efficiency,
                                  efficiency_for, gemm_tile_utilization, matmul_ceiling)
from .calibrated_cost import calibrated_seconds
from .op_classes import op_class

__all__ = ["Kernel", "kernel_of", "kernel_from_aten", "kernel_time", "TENSOR_CORE"]

TENSOR_CORE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8",
               torch.float8_e5m2: "fp8"}


@dataclass(frozen=True)
class Kernel:
    """One kernel launch's work: all a kernel's time is computed from."""

    name: str                       # the aten op ("aten.mm.default") or the generated kernel's name
    op_class: str                   # "matmul", "convolution", "attention" or "other" (op_classes)
    flops: int                      # FLOPs (a multiply-add is 2)
    bytes: int                      # DRAM bytes read + written
    dtype: torch.dtype              # the dtype of its math (its first input's)
    gemm: tuple | None = None       # a matmul's output as (batch, m, n)
    # a fused attention kernel's (batch x heads, query length, key length, head dim, causal)
    attention: tuple | None = None


def _gemm_shape(outputs) -> tuple[int, int, int] | None:
    """(batch, m, n) of a matmul's output."""
    if not outputs or outputs[0] is None:
        return None
    shape = tuple(outputs[0].shape)
    if len(shape) < 2:
        return None
    batch = 1
    for d in shape[:-2]:
        batch *= int(d)
    return batch, int(shape[-2]), int(shape[-1])


def _attention_shape(name: str, inputs, flops: int) -> tuple | None:
    """(batch x heads, query length, key length, head dim, causal) of a fused attention kernel.
    The SDPA ops take (B, H, S, D), the _flash/_efficient_attention ones (B, S, H, D); a
    backward's query and key follow its grad_out. Causal when its FLOPs (analysis/flops.py counts
    the unmasked pairs) are fewer than every pair's."""
    first = 1 if "backward" in name else 0
    shapes = [getattr(t, "shape", None) for t in inputs[first:first + 3]]
    if len(shapes) < 3 or any(s is None or len(s) != 4 for s in shapes) or \
            not all(isinstance(d, int) for s in shapes for d in s):   # symbolic sizes: none
        return None
    q, k, v = (tuple(s) for s in shapes)
    if "scaled_dot_product" in name:
        (b, h, sq, dq), sk, dv = q, k[2], v[3]
    else:
        (b, sq, h, dq), sk, dv = q, k[1], v[3]
    macs = 3 * dq + 2 * dv if first else dq + dv
    return b * h, sq, sk, dq, flops < 2 * b * h * sq * sk * macs


def kernel_from_aten(func, inputs, outputs, flops: int | None, nbytes: int) -> Kernel:
    """The Kernel of one aten op (an OpOverload) run as one kernel: `inputs` and `outputs` are
    anything with .shape and .dtype (TensorRefs, fake tensors, FX nodes' meta values)."""
    cls = op_class(func)
    dtype = (inputs[0].dtype if inputs else
             outputs[0].dtype if outputs and outputs[0] is not None else torch.float32)
    name = str(func)
    return Kernel(name, cls, flops or 0, nbytes, dtype,
                  _gemm_shape(outputs) if cls == "matmul" else None,
                  _attention_shape(name, inputs, flops or 0) if cls == "attention" else None)


def kernel_of(op) -> Kernel:
    """The Kernel an eager op (analysis.ops.Op) launches."""
    return kernel_from_aten(op.record.func, op.inputs, op.outputs, op.flops,
                            op.bytes_read + op.bytes_written)


def _peak(gpu, cls: str, dtype) -> float:
    if cls != "other" and dtype in TENSOR_CORE and gpu.peak(TENSOR_CORE[dtype]):
        return gpu.peak(TENSOR_CORE[dtype])
    if cls == "convolution" and dtype == torch.float32 and gpu.peak("tf32"):
        return gpu.peak("tf32")
    return gpu.peak("fp32")


def kernel_time(kernel: Kernel, gpu, calibration=None) -> tuple[float, bool]:
    """(seconds on the GPU, whether every constant used was measured on it) of one kernel; with
    a calibration (devices.calibration.Calibration of this GPU), from its nearest measurement
    where it has one for the kernel (analysis/calibrated_cost.py)."""
    if calibration is not None:
        measured = calibrated_seconds(kernel, calibration)
        if measured is not None:
            return measured, True
    cls = kernel.op_class
    eff = efficiency_for(cls, gpu.key)
    compute = 0.0
    if kernel.flops:
        peak = _peak(gpu, cls, kernel.dtype)
        share = eff.compute
        if cls == "matmul" and kernel.dtype in TENSOR_CORE:
            share = matmul_ceiling(gpu.key)
            if kernel.gemm is not None:
                batch, m, n = kernel.gemm
                share *= gemm_tile_utilization(m, n, batch, gpu.sms)
        elif cls == "attention":
            share = attention_efficiency(kernel.name, gpu.arch) or share
        fill = min(1.0, kernel.flops / eff.saturation_flops)
        compute = kernel.flops / (peak * share * max(fill, 0.05))
    bandwidth = ELEMENTWISE_BANDWIDTH if cls == "other" else eff.memory
    memory = kernel.bytes / (gpu.memory_bandwidth * bandwidth)
    return max(compute, memory) + KERNEL_OVERHEAD_S, eff.gpu is not None
