"""A kernel's time from a calibration file: the nearest measurement of its kind, scaled by work.

analysis/kernel_cost.kernel_time asks here first when the options carry a calibration
(devices.calibration.Calibration, measured on the GPU the profile names). Each rule is a small
function of the Kernel and the file, looked up by op class; None means the file has nothing for
this kernel and the model's priors price it (its time stays marked uncalibrated).

- matmul: the nearest measured GEMM of the same dtype in (batch, m, n, k), log distance; the
  kernel takes that GEMM's seconds times the ratio of FLOPs (the same throughput);
- attention: the nearest measurement of the same backend (flash, efficient, cudnn), direction and
  dtype in (batch x heads, query length, key length, head dim, causal), scaled by FLOPs;
- other (elementwise, reductions, norms, copies): memory-bound on a GPU: the nearest measured copy
  (for copy ops) or elementwise kernel in bytes moved, scaled by bytes;
- a kernel that moves and computes nothing, or less than the measured overhead: the measured time
  of a tiny kernel back to back.
Every time is at least that launch overhead: a kernel cannot finish sooner than an empty one.
"""

from __future__ import annotations

import torch

from ..devices.calibration import Calibration, nearest

__all__ = ["calibrated_seconds", "DTYPE_NAMES"]

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
               torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}
# ops that are copies (a read and a write of each byte, no arithmetic): priced by the copy kernel
_COPIES = frozenset({"copy", "copy_", "_to_copy", "clone", "_copy_from", "contiguous"})


def _matmul(kernel, cal: Calibration) -> float | None:
    dtype = DTYPE_NAMES.get(kernel.dtype)
    if kernel.gemm is None or not kernel.flops or dtype is None:
        return None
    batch, m, n = kernel.gemm
    k = max(1, kernel.flops // (2 * batch * m * n))
    p = nearest((g for g in cal.gemm if g.dtype == dtype),
                lambda g: (g.batch, g.m, g.n, g.k), (batch, m, n, k))
    return None if p is None else p.seconds * (kernel.flops / p.flops)


def _backend(name: str) -> str | None:
    return ("cudnn" if "cudnn" in name else "efficient" if "efficient" in name else
            "flash" if "flash" in name else None)


def _attention(kernel, cal: Calibration) -> float | None:
    backend, dtype = _backend(kernel.name), DTYPE_NAMES.get(kernel.dtype)
    if kernel.attention is None or not kernel.flops or backend is None:
        return None
    direction = "backward" if "backward" in kernel.name else "forward"
    p = nearest((a for a in cal.attention if (a.backend, a.direction, a.dtype) ==
                 (backend, direction, dtype)),
                lambda a: (a.batch_heads, a.seq_q, a.seq_k, a.head_dim, a.causal),
                kernel.attention)
    return None if p is None else p.seconds * (kernel.flops / p.flops)


def _memory_bound(kernel, cal: Calibration) -> float | None:
    if not kernel.bytes:
        return cal.kernel_overhead_s
    base = kernel.name.split(".")[1] if kernel.name.startswith("aten.") else kernel.name
    kind = "copy" if base in _COPIES else "elementwise"
    p = nearest((b for b in cal.bandwidth if b.kind == kind), lambda b: (b.bytes,),
                (kernel.bytes,))
    if p is None:   # a file with only one kind: the other's bytes move at its rate
        p = nearest(cal.bandwidth, lambda b: (b.bytes,), (kernel.bytes,))
    return None if p is None else p.seconds * (kernel.bytes / p.bytes)


RULES = {"matmul": _matmul, "attention": _attention, "other": _memory_bound}


def calibrated_seconds(kernel, cal: Calibration) -> float | None:
    """Seconds of one analysis.kernel_cost.Kernel by the file's measurements, None when the file
    measured nothing like it (a convolution, a dtype it did not time)."""
    rule = RULES.get(kernel.op_class)
    seconds = rule(kernel, cal) if rule is not None else None
    return None if seconds is None else max(seconds, cal.kernel_overhead_s)
