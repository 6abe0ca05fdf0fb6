"""The CPU a profile's kernels are chosen for: its vector ISA and its intra-op threads.

oneDNN picks a convolution kernel for the ISA it detects and sizes per-thread buffers for
`omp_get_max_threads()`, so a CPU profile's kernel workspaces depend on both. By default they are
this machine's, read the way PyTorch and oneDNN read them (`torch.backends.cpu.get_cpu_capability()`,
which honours ATEN_CPU_CAPABILITY; ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA caps oneDNN alone;
`torch.get_num_threads()`); `Options(threads=..., cpu_isa=...)` names a target instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["CpuTarget", "cpu_target", "ISAS"]

# oneDNN's x86 ISAs that decide an fp32 convolution kernel, weakest first
ISAS = ("sse41", "avx2", "avx512")
_FROM_TORCH = {"AVX512": "avx512", "AVX2": "avx2", "DEFAULT": "sse41"}
# ONEDNN_MAX_CPU_ISA values (oneDNN's cpu_isa_traits) -> the ISA class that matters here
_FROM_ONEDNN = {"SSE41": "sse41", "AVX": "sse41", "AVX2": "avx2", "AVX2_VNNI": "avx2",
                "AVX2_VNNI_2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512",
                "AVX512_CORE_BF16": "avx512", "AVX10_1_512": "avx512",
                "AVX512_CORE_FP16": "avx512", "AVX10_1_512_AMX": "avx512",
                "AVX512_CORE_AMX": "avx512", "AVX10_1_512_AMX_FP16": "avx512",
                "AVX512_CORE_AMX_FP16": "avx512", "AVX10_2_512": "avx512",
                "AVX10_2_512_AMX_2": "avx512", "ALL": None, "DEFAULT": None}


@dataclass(frozen=True)
class CpuTarget:
    isa: str          # "avx2", "avx512" or "sse41" (the vector width oneDNN's kernels use)
    threads: int      # intra-op threads (OpenMP's max threads, as oneDNN sizes buffers for)
    detected: bool    # both read from this machine (False: named by the user)

    @property
    def simd_floats(self) -> int:
        """fp32 lanes of a vector register: oneDNN's channel block for blocked layouts."""
        return {"avx512": 16, "avx2": 8}.get(self.isa, 4)

    def describe(self) -> str:
        how = "this machine" if self.detected else "target"
        return f"{self.isa.upper()}, {self.threads} thread{'s' * (self.threads != 1)} ({how})"


def _detected_isa() -> str:
    isa = _FROM_TORCH.get(torch.backends.cpu.get_cpu_capability(), "sse41")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    capped = _FROM_ONEDNN.get(cap.upper()) if cap else None
    if capped is not None and ISAS.index(capped) < ISAS.index(isa):
        isa = capped
    return isa


def cpu_target(isa: str | None = None, threads: int | None = None) -> CpuTarget:
    """This machine's ISA and threads, or the target's where given."""
    if isa is not None and isa not in ISAS:
        raise ValueError(f"unknown CPU ISA {isa!r}; use one of {', '.join(ISAS)}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return CpuTarget(isa or _detected_isa(), threads or torch.get_num_threads(),
                     isa is None and threads is None)
