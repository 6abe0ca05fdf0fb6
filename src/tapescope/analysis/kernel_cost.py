"""What one GPU kernel costs: the per-kernel half of the step-time model.

A `Kernel` is the work of one kernel launch, as a plain record: its op class, FLOPs, DRAM bytes,
math dtype, and the shape facts the efficiency model needs (a GEMM's output shape). Eager ops
become Kernels through `kernel_of` (one aten op, one kernel); an inductor-compiled step's generated
kernels are built as Kernels from inductor's own figures. `kernel_time` prices one Kernel on a
named GPU; analysis/timing.py schedules the priced kernels on the host and the GPU's streams.

Each kernel takes max(FLOPs / achieved FLOP/s, bytes moved / achieved bandwidth) plus a kernel
overhead (devices/efficiency.py holds every constant and its source). Every compute rate is taken
at the clock a loaded GPU sustains (burst MAMF x the measured MSMF / MAMF ratio, lowered by a
board power limit):
- matmuls: the GPU's measured matmul ceiling (bf16/fp16, or fp8) times the share of the tile
  work that is useful for the output's shape (tile and wave quantization over the GPU's SMs, at
  the best of cuBLAS's tiles); fp32 matmuls run on CUDA cores (allow_tf32 is off by default);
- fused attention: the share of peak the backend (flash, cuDNN, memory-efficient) reaches on the
  architecture, forward and backward apart, at the call's sequence length and mask where a
  published curve exists (FlashAttention-3 paper, Hopper), else a flat figure;
- convolutions (TF32 for fp32: cudnn.allow_tf32 is on) and other ops: the class's prior;
- memory-bound kernels move their bytes at the STREAM bandwidth measured on the part (Copy for
  copies and casts, Triad for the rest), else at ELEMENTWISE_BANDWIDTH of the DRAM peak.
Small kernels cannot fill the GPU: their efficiency falls off below the class's saturation size
(a GEMM of known shape: by its tile and wave quantization alone). Ops that launch no kernel cost 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..devices.efficiency import (KERNEL_OVERHEAD_S, achievable_bandwidth, attention_efficiency,
                                  efficiency_for, gemm_tile_utilization, matmul_ceiling,
                                  sustained_clock)
from .calibrated_cost import calibrated_seconds
from .op_classes import COPY_KERNELS, launches_kernel, op_class

__all__ = ["AttentionShape", "Kernel", "kernel_of", "kernel_from_aten", "kernel_time", "on_gpu",
           "step_kernels", "TENSOR_CORE"]

TENSOR_CORE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8",
               torch.float8_e5m2: "fp8"}


class AttentionShape(NamedTuple):
    """A fused attention call's shape: what its efficiency depends on."""

    batch_heads: int                # batch x heads
    seq_q: int                      # query length
    seq_k: int                      # key length
    head_dim: int
    causal: bool


@dataclass(frozen=True)
class Kernel:
    """One kernel launch's work: all a kernel's time is computed from."""

    name: str                       # the aten op ("aten.mm.default") or the generated kernel's name
    op_class: str                   # "matmul", "convolution", "attention", "other" (op_classes),
                                    # or "none": the op launches no GPU kernel, and costs nothing
    flops: int                      # FLOPs (a multiply-add is 2)
    bytes: int                      # DRAM bytes read + written
    dtype: torch.dtype              # the dtype of its math (its first input's)
    gemm: tuple | None = None       # a matmul's output as (batch, m, n)
    # a fused attention kernel's shape (AttentionShape), from its call
    attention: AttentionShape | None = None


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


def _argument(func, args, kwargs, name):
    """The value of `func`'s schema argument `name` in a call (its default when not passed)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, arg.default_value if arg.has_default_value() else None)
    return None


def _attention_shape(func, args, kwargs, inputs, flops: int) -> AttentionShape | None:
    """The shape of a fused attention kernel's call. The SDPA ops take (B, H, S, D), the
    _flash/_efficient_attention ones (B, S, H, D); a backward's query and key follow its
    grad_out. Causal as the call's `is_causal` says where its schema has one, else when its FLOPs
    (analysis/flops.py counts the unmasked pairs) are fewer than every pair's."""
    name = str(func)
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
    if any(a.name == "is_causal" for a in func._schema.arguments):
        causal = bool(_argument(func, args, kwargs, "is_causal"))
    else:
        macs = 3 * dq + 2 * dv if first else dq + dv
        causal = flops < 2 * b * h * sq * sk * macs
    return AttentionShape(b * h, sq, sk, dq, causal)


def kernel_from_aten(func, inputs, outputs, flops: int | None, nbytes: int,
                     on_gpu: bool = True, args: tuple = (), kwargs: dict | None = None) -> Kernel:
    """The Kernel of one aten op (an OpOverload) run as one kernel: `inputs` and `outputs` are
    anything with .shape and .dtype (TensorRefs, fake tensors, FX nodes' meta values); `args` and
    `kwargs` (the call's, tensors as anything with .shape) give attention its shape. An op that
    launches no kernel (views, metadata, autograd wrappers: op_classes.launches_kernel), or whose
    tensors all live on the host (`on_gpu` False: the optimizer's CPU step counters), is a
    Kernel of class "none" with no work."""
    if not on_gpu or not launches_kernel(func):
        return Kernel(str(func), "none", 0, 0, torch.float32)
    cls = op_class(func)
    dtype = (inputs[0].dtype if inputs else
             outputs[0].dtype if outputs and outputs[0] is not None else torch.float32)
    attention = (_attention_shape(func, args, kwargs or {}, inputs, flops or 0)
                 if cls == "attention" else None)
    return Kernel(str(func), cls, flops or 0, nbytes, dtype,
                  _gemm_shape(outputs) if cls == "matmul" else None, attention)


def on_gpu(op, storages) -> bool:
    """Whether an eager op (analysis.ops.Op) touches a CUDA tensor, by the devices of the
    storages of `storages` (Trace.storages) it reads and writes; an op with no tensor, or whose
    storages are not listed, counts as a GPU op."""
    devices = [storages[r.storage].device.type for r in (*op.inputs, *op.outputs)
               if 0 <= r.storage < len(storages)]
    return not devices or "cuda" in devices


def kernel_of(op, storages=()) -> Kernel:
    """The Kernel an eager op (analysis.ops.Op) launches; with the trace's storages, an op on
    host tensors only launches none."""
    rec = op.record
    return kernel_from_aten(rec.func, op.inputs, op.outputs, op.flops,
                            op.bytes_read + op.bytes_written, on_gpu(op, storages),
                            rec.args, rec.kwargs)


def step_kernels(ops, storages=()) -> tuple:
    """Per op of a step (analysis.ops.Op, in order), the Kernel it launches on the GPU, None
    where it launches none (a view, metadata op or autograd wrapper, or an op on host tensors
    only): the time model and the layout search's bounds read a step's kernels several times,
    and building each op's Kernel is most of what pricing it costs."""
    return tuple(kernel_of(op, storages)
                 if launches_kernel(op.record.func) and on_gpu(op, storages) else None
                 for op in ops)


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
    if cls == "none":
        return 0.0, True
    eff = efficiency_for(cls, gpu.key)
    compute = 0.0
    if kernel.flops:
        peak = _peak(gpu, cls, kernel.dtype)
        share = eff.compute
        if cls == "matmul" and kernel.dtype in TENSOR_CORE:
            share = matmul_ceiling(gpu.key, TENSOR_CORE[kernel.dtype])
            if kernel.gemm is not None:
                batch, m, n = kernel.gemm
                share *= gemm_tile_utilization(m, n, batch, gpu.sms)
        elif cls == "attention":
            share = attention_efficiency(kernel.name, gpu.arch, kernel.attention) or share
        # a kernel too small to fill the GPU runs below its class's share; a GEMM of known
        # shape has that in its tile and wave quantization already (one 1024^3 fp16 GEMM on an
        # A100: 64 of 108 SMs busy, 119 TFLOP/s measured; the fill term on top gave 17)
        gemm_shaped = cls == "matmul" and kernel.gemm is not None
        fill = 1.0 if gemm_shaped else min(1.0, kernel.flops / eff.saturation_flops)
        # the clock a loaded GPU sustains (MSMF, power limit): every compute-bound kernel
        precision = "fp8" if TENSOR_CORE.get(kernel.dtype) == "fp8" else "16-bit"
        compute = kernel.flops / (peak * share * sustained_clock(gpu, precision)
                                  * max(fill, 0.05))
    if cls == "other":   # at the STREAM bandwidth measured on the part (Copy or Triad)
        kind = "copy" if kernel.name.rsplit(".", 1)[0] in COPY_KERNELS else "triad"
        memory = kernel.bytes / achievable_bandwidth(gpu, kind)
    else:
        memory = kernel.bytes / (gpu.memory_bandwidth * eff.memory)
    return max(compute, memory) + KERNEL_OVERHEAD_S, eff.gpu is not None
