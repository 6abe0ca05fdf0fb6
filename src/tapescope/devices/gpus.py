"""The GPU catalogue: vendor numbers for the GPUs tapescope can predict for, as one constant table.

Conventions (read these before using a number):

- ``peak_flops`` holds DENSE peaks in FLOP/s (OP/s for ``int8``): the rate without 2:4 structured
  sparsity. NVIDIA datasheets usually print the sparse figure, marked "*With sparsity"; those are
  halved here. The comment on each entry names the table it comes from and whether it was halved.
- Keys of ``peak_flops``: ``fp64`` (non-tensor), ``fp64_tensor``, ``fp32`` (non-tensor CUDA cores),
  ``tf32``, ``bf16``, ``fp16``, ``fp8``, ``int8`` (all tensor core except fp64/fp32). A key is
  ABSENT when the GPU lacks the format (no bf16/tf32 before Ampere, no fp8 before Ada) or when the
  source does not print the number; the entry's comment says which.
- ``bf16``/``fp16``/``fp8`` are the FP32-accumulate rates, which is what PyTorch matmuls use. On
  GeForce cards (RTX 3090/4090) that is half the FP16-accumulate rate NVIDIA also prints.
- ``memory_bytes``: the capacity NVIDIA markets, times 2**30. NVIDIA's "GB" for DRAM capacity is
  binary: DRAM parts come in power-of-two sizes (H100's 80 GB is 5 HBM3 stacks of 16 GiB), and what
  the card reports always lies just below the marketed number read as GiB (H100 SXM: 79.2 GiB
  reported of 80 GiB), never below it read as 10**9.
- ``reported_memory_bytes``: ``torch.cuda.get_device_properties(i).total_memory`` (the same value
  as CUDA's ``cudaDeviceProp.totalGlobalMem`` that ``deviceQuery`` prints), as seen in a published
  ``deviceQuery`` / torch printout named in the entry's comment; ``None`` where none was found. It
  varies with the driver by up to ~1% (H100 SXM: 81079, 81090 and 81106 MiB seen under three
  drivers), and ECC on GDDR cards (T4, L4, L40S) lowers it further; treat it as typical, not exact.
  Where only torch's printout was found, it prints whole MiB (rounded down), so the value is exact
  to 1 MiB.
- ``memory_bandwidth`` in bytes/s, decimal (3.35 TB/s = 3.35e12), as the datasheet prints it.
- ``l2_bytes`` as the device reports it (``deviceQuery`` "L2 Cache Size" / torch ``L2_cache_size``)
  where such a report was found, else the whitepaper's KB figure times 1024.
- ``tdp_watts``: the maximum board power of the datasheet (the top of a configurable range).
- ``power_limit_watts``: the board power limit the part runs at where it is set below
  ``tdp_watts`` (a power-capped deployment), else None. A lower limit lowers the sustained clock,
  hence every compute-bound kernel (devices/efficiency.py, ``sustained_clock``).
- ``memory_type``: the DRAM technology as the datasheet names it (HBM3, HBM2e, GDDR6, ...).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = [
    "GPU",
    "GPUS",
    "ALIASES",
    "DTYPES",
    "ARCH_COMPUTE_CAPABILITIES",
    "normalize_name",
    "resolve_gpu_key",
    "get_gpu",
    "cuda_context_bytes",
    "usable_memory_bytes",
    "Interconnect",
    "INTERCONNECTS",
    "interconnect",
    "SMLimits",
    "sm_limits",
]

DTYPES: tuple[str, ...] = ("fp64", "fp64_tensor", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")

# Compute capabilities (major, minor) each architecture name may carry.
ARCH_COMPUTE_CAPABILITIES: Mapping[str, frozenset[tuple[int, int]]] = MappingProxyType(
    {
        "volta": frozenset({(7, 0), (7, 2)}),
        "turing": frozenset({(7, 5)}),
        "ampere": frozenset({(8, 0), (8, 6), (8, 7)}),
        "ada": frozenset({(8, 9)}),
        "hopper": frozenset({(9, 0)}),
        "blackwell": frozenset({(10, 0), (10, 3), (12, 0), (12, 1)}),
    }
)

_T = 1e12  # tera
_GIB = 2**30
_MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One GPU model as its vendor documents it. Every number is per GPU (not per board or node)."""

    key: str
    name: str
    arch: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    reported_memory_bytes: int | None
    memory_bandwidth: float
    sms: int
    l2_bytes: int
    tdp_watts: int
    peak_flops: Mapping[str, float] = field(hash=False)
    source: str
    memory_type: str = ""
    power_limit_watts: int | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.peak_flops) - set(DTYPES))
        if unknown:
            raise ValueError(f"GPU {self.key!r}: unknown peak_flops keys {unknown}; known: {list(DTYPES)}")
        # A read-only view, so the constant table cannot be changed through an entry.
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def peak(self, dtype: str) -> float | None:
        """Dense peak FLOP/s (OP/s for int8) for `dtype`, or None where unsupported / not published."""
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {list(DTYPES)}")
        return self.peak_flops.get(dtype)


# fmt: off
_TABLE: tuple[GPU, ...] = (
    # --- Hopper -------------------------------------------------------------------------------
    # Dense rates: H100 architecture whitepaper v1.04, Table 3 "Comparison of NVIDIA A100 and H100
    # Data Center GPUs", H100 SXM5 column (printed dense/sparse, e.g. BF16 989.4/1978.9; the H100
    # datasheet's 1,979 TFLOPS is the sparse figure). 132 SMs, 50 MB L2 from the same table.
    # Memory and bandwidth from the H100 datasheet (80 GB HBM3, 3.35 TB/s, TDP up to 700 W).
    # reported_memory_bytes: deviceQuery "81090 MBytes (85028896768 bytes)", driver 12.8
    # (torch prints total_memory=81089/81090 MB on H100 80GB HBM3; other drivers 81079/81106 MiB).
    GPU(
        key="h100-sxm", name="NVIDIA H100 SXM5 80GB", arch="hopper", compute_capability=(9, 0),
        memory_bytes=80 * _GIB, reported_memory_bytes=85_028_896_768,
        memory_bandwidth=3.35e12, sms=132, l2_bytes=50 * _MIB, tdp_watts=700,
        peak_flops={"fp64": 33.5 * _T, "fp64_tensor": 66.9 * _T, "fp32": 66.9 * _T,
                    "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T,
                    "fp8": 1978.9 * _T, "int8": 1978.9 * _T},
        source="NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, Table 3 "
               "(https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper); "
               "NVIDIA H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/)",
        memory_type="HBM3",
    ),
    # H100 SXM5 with 96 GB of HBM2e run at a 500 W board limit: the part of Meta's Grand Teton
    # hosts, which several published clusters use (shared/reference/published_runs.md, "Power-capped
    # parts"). The GH100 die and its tensor rates are the H100 SXM5's (whitepaper v1.04 Table 3,
    # dense); the board is the 700 W SXM5 one, limited to 500 W (power_limit_watts), which lowers
    # its sustained clock (devices/efficiency.py). Memory: 96 GB = 6 HBM2e stacks of 16 GB on
    # GH100's six 1024-bit stacks' worth of controllers (12 x 512-bit; glennklockwood.com/garden/
    # processors/h100), at the H100 PCIe's HBM2e rate (2.0 TB/s over 5 stacks): 2.4 TB/s. DERIVED,
    # no datasheet of this part was found; reported memory and L2 likewise unknown (50 MB assumed).
    GPU(
        key="h100-sxm-96gb", name="NVIDIA H100 SXM5 96GB HBM2e (500 W)", arch="hopper",
        compute_capability=(9, 0),
        memory_bytes=96 * _GIB, reported_memory_bytes=None,
        memory_bandwidth=2.4e12, sms=132, l2_bytes=50 * _MIB, tdp_watts=700,
        peak_flops={"fp64": 33.5 * _T, "fp64_tensor": 66.9 * _T, "fp32": 66.9 * _T,
                    "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T,
                    "fp8": 1978.9 * _T, "int8": 1978.9 * _T},
        source="NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, Table 3 (rates); "
               "96 GB HBM2e at 500 W: shared/reference/published_runs.md (Grand Teton hosts); "
               "bandwidth derived (6 HBM2e stacks at the H100 PCIe's per-stack rate)",
        memory_type="HBM2e", power_limit_watts=500,
    ),
    # Tensor rates: H100 whitepaper v1.04 Table 1/Table 3, H100 PCIe column (BF16 756/1513 dense/
    # sparse; TF32 378, FP8 and INT8 1513 dense = the datasheet's 756*, 3,026* halved).
    # Non-tensor FP64 26, FP64 Tensor 51, FP32 51 TFLOPS: H100 datasheet (PCIe column), as printed.
    # 114 SMs, 50 MB L2, 80 GB HBM2e, 2 TB/s (2,000 GB/s), 350 W: datasheet / whitepaper.
    # reported_memory_bytes: torch printout total_memory=81008MB, multi_processor_count=114.
    GPU(
        key="h100-pcie", name="NVIDIA H100 PCIe 80GB", arch="hopper", compute_capability=(9, 0),
        memory_bytes=80 * _GIB, reported_memory_bytes=81_008 * _MIB,
        memory_bandwidth=2.0e12, sms=114, l2_bytes=50 * _MIB, tdp_watts=350,
        peak_flops={"fp64": 26 * _T, "fp64_tensor": 51 * _T, "fp32": 51 * _T,
                    "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T,
                    "fp8": 1513 * _T, "int8": 1513 * _T},
        source="NVIDIA H100 Tensor Core GPU Architecture whitepaper v1.04, Tables 1 and 3 "
               "(https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper); "
               "NVIDIA H100 PCIe datasheet / product brief PB-11133-001",
        memory_type="HBM2e",
    ),
    # H800 SXM5: the H100 SXM5 (same GH100 board, 132 SMs, 80 GB HBM3 at 3.35 TB/s, up to 700 W)
    # with FP64 cut to 1 TFLOPS (vector and tensor) and NVLink to 400 GB/s (both directions);
    # tensor rates as printed for H100 SXM, sparse halved (BF16 1,979* -> 989.4). Published runs
    # on it: Megatron-LM PR #482 (Llama-2-7B on 8 x H800, reference/published_runs.md). L2 and
    # reported memory: no H800 printout found; the H100 SXM's (same die and memory) are used.
    GPU(
        key="h800-sxm", name="NVIDIA H800 SXM5 80GB", arch="hopper", compute_capability=(9, 0),
        memory_bytes=80 * _GIB, reported_memory_bytes=None,
        memory_bandwidth=3.35e12, sms=132, l2_bytes=50 * _MIB, tdp_watts=700,
        peak_flops={"fp64": 1 * _T, "fp64_tensor": 1 * _T, "fp32": 66.9 * _T,
                    "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T,
                    "fp8": 1978.9 * _T, "int8": 1978.9 * _T},
        source="NVIDIA H800 Tensor Core GPU datasheet, H800 SXM column (FP64 1 TFLOPS, NVLink "
               "400GB/s, 80GB, 3.35TB/s, up to 700W; tensor rates as H100 SXM); NVIDIA H100 "
               "whitepaper v1.04 Table 3 for the dense rates",
        memory_type="HBM3",
    ),
    # H100 datasheet / product page spec table, H100 NVL column: FP64 30, FP64 Tensor 60, FP32 60
    # TFLOPS (as printed); TF32 835*, BF16/FP16 1,671*, FP8/INT8 3,341* are "with sparsity" and
    # halved here. 94 GB HBM3, 3.9 TB/s, 350-400 W (configurable; 400 stored). 132 SMs from the
    # H100 NVL product brief. L2: no NVL-specific figure found; 50 MB assumed as for the other
    # GH100 boards. reported_memory_bytes: no trustworthy printout found.
    GPU(
        key="h100-nvl", name="NVIDIA H100 NVL 94GB", arch="hopper", compute_capability=(9, 0),
        memory_bytes=94 * _GIB, reported_memory_bytes=None,
        memory_bandwidth=3.9e12, sms=132, l2_bytes=50 * _MIB, tdp_watts=400,
        peak_flops={"fp64": 30 * _T, "fp64_tensor": 60 * _T, "fp32": 60 * _T,
                    "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T,
                    "fp8": 1670.5 * _T, "int8": 1670.5 * _T},
        source="NVIDIA H100 datasheet, H100 NVL column (https://www.nvidia.com/en-us/data-center/h100/)",
        memory_type="HBM3",
    ),
    # H200 datasheet, H200 SXM column: FP64 34, FP64 Tensor 67, FP32 67 TFLOPS (as printed);
    # TF32 989*, BF16/FP16 1,979*, FP8/INT8 3,958* are "with sparsity" and halved here.
    # 141 GB HBM3e, 4.8 TB/s, up to 700 W. Same GH100 configuration as H100 SXM (132 SMs).
    # reported_memory_bytes and L2: torch printout "_CudaDeviceProperties(name='NVIDIA H200',
    # major=9, minor=0, total_memory=143156MB, multi_processor_count=132, ..., L2_cache_size=60MB)".
    # (60 MB L2 is from that single printout; H100 reports 50 MB.)
    GPU(
        key="h200-sxm", name="NVIDIA H200 SXM 141GB", arch="hopper", compute_capability=(9, 0),
        memory_bytes=141 * _GIB, reported_memory_bytes=143_156 * _MIB,
        memory_bandwidth=4.8e12, sms=132, l2_bytes=60 * _MIB, tdp_watts=700,
        peak_flops={"fp64": 34 * _T, "fp64_tensor": 67 * _T, "fp32": 67 * _T,
                    "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T,
                    "fp8": 1979 * _T, "int8": 1979 * _T},
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
               "(https://www.nvidia.com/en-us/data-center/h200/)",
        memory_type="HBM3e",
    ),
    # --- Blackwell ----------------------------------------------------------------------------
    # NVIDIA HGX B200 spec table, "Individual Blackwell GPU Specifications", HGX B200 column:
    # FP64/FP64 Tensor 37 TFLOPS, FP32 75 TFLOPS (as printed); TF32 2.2 PF, FP16/BF16 4.5 PF,
    # FP8 9 PF, INT8 9 POPS are with sparsity and halved here (2.25 PF dense BF16).
    # 180 GB HBM3e, 7.7 TB/s, configurable up to 1,000 W. (Earlier versions of the page printed
    # 8 TB/s and FP32 80 / FP64 40 TFLOPS; the later figures are used.)
    # SMs, L2, reported memory: torch printout "name='NVIDIA B200', major=10, minor=0,
    # total_memory=182631MB, multi_processor_count=148" (another shows 182642MB, L2_cache_size=126MB);
    # a CUDA query in pytorch/ao PR #4002 prints L2 126.50 MB, 148 SMs.
    GPU(
        key="b200-sxm", name="NVIDIA B200 (HGX B200, SXM) 180GB", arch="blackwell",
        compute_capability=(10, 0),
        memory_bytes=180 * _GIB, reported_memory_bytes=182_631 * _MIB,
        memory_bandwidth=7.7e12, sms=148, l2_bytes=int(126.5 * _MIB), tdp_watts=1000,
        peak_flops={"fp64": 37 * _T, "fp64_tensor": 37 * _T, "fp32": 75 * _T,
                    "tf32": 1100 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T,
                    "fp8": 4500 * _T, "int8": 4500 * _T},
        source="NVIDIA HGX B200 specifications, Individual Blackwell GPU Specifications "
               "(https://www.nvidia.com/en-us/data-center/hgx/)",
        memory_type="HBM3e",
    ),
    # --- Ampere -------------------------------------------------------------------------------
    # A100 datasheet (r4), A100 80GB SXM column: FP64 9.7, FP64 Tensor 19.5, FP32 19.5, TF32 156,
    # BF16/FP16 312, INT8 624 (dense; the datasheet prints dense and "*With sparsity" side by
    # side). No FP8. 80 GB HBM2e, 2,039 GB/s, 400 W. 108 SMs, 40 MB L2 (A100 whitepaper Table).
    # reported_memory_bytes: deviceQuery "81051 MBytes (84987740160 bytes)", driver 12.2
    # (81158 MiB seen under driver 12.5). L2: deviceQuery "L2 Cache Size: 41943040 bytes".
    GPU(
        key="a100-sxm-80gb", name="NVIDIA A100-SXM4-80GB", arch="ampere", compute_capability=(8, 0),
        memory_bytes=80 * _GIB, reported_memory_bytes=84_987_740_160,
        memory_bandwidth=2.039e12, sms=108, l2_bytes=41_943_040, tdp_watts=400,
        peak_flops={"fp64": 9.7 * _T, "fp64_tensor": 19.5 * _T, "fp32": 19.5 * _T,
                    "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T, "int8": 624 * _T},
        source="NVIDIA A100 Tensor Core GPU datasheet "
               "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)",
        memory_type="HBM2e",
    ),
    # A100 datasheet, A100 40GB SXM (and A100 whitepaper Table 1/4: 40 GB HBM2, 1,555 GB/s,
    # 40960 KB L2, 108 SMs, 400 W); same rates as the 80 GB part.
    # reported_memory_bytes: deviceQuery "40339 MBytes (42298834944 bytes)", driver 12.2
    # (40441 MiB under an older driver).
    GPU(
        key="a100-sxm-40gb", name="NVIDIA A100-SXM4-40GB", arch="ampere", compute_capability=(8, 0),
        memory_bytes=40 * _GIB, reported_memory_bytes=42_298_834_944,
        memory_bandwidth=1.555e12, sms=108, l2_bytes=41_943_040, tdp_watts=400,
        peak_flops={"fp64": 9.7 * _T, "fp64_tensor": 19.5 * _T, "fp32": 19.5 * _T,
                    "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T, "int8": 624 * _T},
        source="NVIDIA A100 Tensor Core GPU datasheet "
               "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf); NVIDIA Ampere architecture "
               "whitepaper, Table 1",
        memory_type="HBM2",
    ),
    # A100 datasheet, A100 80GB PCIe column: same rates as SXM; 80 GB HBM2e, 1,935 GB/s, 300 W.
    # reported_memory_bytes: no trustworthy printout found.
    GPU(
        key="a100-pcie-80gb", name="NVIDIA A100 80GB PCIe", arch="ampere", compute_capability=(8, 0),
        memory_bytes=80 * _GIB, reported_memory_bytes=None,
        memory_bandwidth=1.935e12, sms=108, l2_bytes=41_943_040, tdp_watts=300,
        peak_flops={"fp64": 9.7 * _T, "fp64_tensor": 19.5 * _T, "fp32": 19.5 * _T,
                    "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T, "int8": 624 * _T},
        source="NVIDIA A100 Tensor Core GPU datasheet "
               "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)",
        memory_type="HBM2e",
    ),
    # GA102 whitepaper v2, Appendix A "GeForce RTX 3090": 82 SMs, FP32 35.6 TFLOPS, 24 GB GDDR6X,
    # 936 GB/s, 6144 KB L2, 350 W. Tensor rates are the dense FP32-accumulate rows (TF32 35.6,
    # BF16 71, FP16 71 with FP32 accumulate; FP16 with FP16 accumulate is 142). INT8 284 TOPS.
    # No FP8. FP64 not in the table: absent.
    # reported_memory_bytes: deviceQuery "24039 MBytes (25206325248 bytes)", driver 12.4
    # (24235-24268 MiB under drivers 11.x).
    GPU(
        key="rtx-3090", name="NVIDIA GeForce RTX 3090", arch="ampere", compute_capability=(8, 6),
        memory_bytes=24 * _GIB, reported_memory_bytes=25_206_325_248,
        memory_bandwidth=936e9, sms=82, l2_bytes=6144 * 1024, tdp_watts=350,
        peak_flops={"fp32": 35.6 * _T, "tf32": 35.6 * _T, "bf16": 71 * _T, "fp16": 71 * _T,
                    "int8": 284 * _T},
        source="NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A "
               "(https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf)",
        memory_type="GDDR6X",
    ),
    # --- Ada Lovelace -------------------------------------------------------------------------
    # L4 datasheet: FP32 30.3 TFLOPS (as printed); TF32 120*, BF16/FP16 242*, FP8 485*, INT8 485*
    # are "with sparsity" and halved here. 24 GB GDDR6, 300 GB/s, 72 W. FP64 not printed: absent.
    # SMs, L2, reported memory: deviceQuery "22518 MBytes (23612293120 bytes)" (ECC enabled),
    # "(58) Multiprocessors", "L2 Cache Size: 50331648 bytes", driver 12.0.
    GPU(
        key="l4", name="NVIDIA L4", arch="ada", compute_capability=(8, 9),
        memory_bytes=24 * _GIB, reported_memory_bytes=23_612_293_120,
        memory_bandwidth=300e9, sms=58, l2_bytes=50_331_648, tdp_watts=72,
        peak_flops={"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T,
                    "fp8": 242.5 * _T, "int8": 242.5 * _T},
        source="NVIDIA L4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/l4/)",
        memory_type="GDDR6",
    ),
    # L40S datasheet: FP32 91.6; TF32 183 | 366*, BF16/FP16 362.05 | 733*, FP8 733 | 1,466*,
    # INT8 733 | 1,466* (the datasheet prints dense | sparse; dense taken). 48 GB GDDR6 with ECC,
    # 864 GB/s, 350 W. FP64 not printed: absent.
    # SMs, L2, reported memory: deviceQuery "45373 MBytes (47576711168 bytes)" (ECC enabled),
    # "(142) Multiprocessors", "L2 Cache Size: 100663296 bytes", driver 12.4.
    GPU(
        key="l40s", name="NVIDIA L40S", arch="ada", compute_capability=(8, 9),
        memory_bytes=48 * _GIB, reported_memory_bytes=47_576_711_168,
        memory_bandwidth=864e9, sms=142, l2_bytes=100_663_296, tdp_watts=350,
        peak_flops={"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T,
                    "fp8": 733 * _T, "int8": 733 * _T},
        source="NVIDIA L40S GPU datasheet (https://www.nvidia.com/en-us/data-center/l40s/)",
        memory_type="GDDR6",
    ),
    # Ada whitepaper v2.1, Appendix A "GeForce RTX 4090": 128 SMs, FP32 82.6 TFLOPS, 24 GB GDDR6X,
    # 1,008 GB/s, 72 MB L2, 450 W. Tensor rates are the dense FP32-accumulate rows: TF32 82.6,
    # BF16 165.2, FP16 165.2 (330.3 with FP16 accumulate), FP8 330.3 (660.6 with FP16 accumulate;
    # corrected to 330.3 in whitepaper v2.02), INT8 660.6 TOPS. FP64 not used: absent.
    # reported_memory_bytes: deviceQuery "24210 MBytes (25386352640 bytes)", Linux, driver 12.4
    # (torch printouts show 24563 MB on other drivers; Windows/WDDM reports less).
    GPU(
        key="rtx-4090", name="NVIDIA GeForce RTX 4090", arch="ada", compute_capability=(8, 9),
        memory_bytes=24 * _GIB, reported_memory_bytes=25_386_352_640,
        memory_bandwidth=1008e9, sms=128, l2_bytes=72 * _MIB, tdp_watts=450,
        peak_flops={"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T,
                    "fp8": 330.3 * _T, "int8": 660.6 * _T},
        source="NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A "
               "(https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf)",
        memory_type="GDDR6X",
    ),
    # --- Turing / Volta -----------------------------------------------------------------------
    # T4 datasheet: FP32 8.1 TFLOPS, mixed precision (FP16 multiply, FP32 accumulate) 65 TFLOPS,
    # INT8 130 TOPS (Turing has no sparsity). No BF16/TF32/FP8; FP64 not printed: absent.
    # 16 GB GDDR6, 320 GB/s (256-bit at 10 Gbps), 70 W, 40 SMs, 4 MB L2.
    # reported_memory_bytes: deviceQuery "14918 MBytes (15642329088 bytes)" (ECC on), drivers
    # 12.4 and 12.5 (15102 MiB under 12.0/12.2).
    GPU(
        key="t4", name="NVIDIA T4", arch="turing", compute_capability=(7, 5),
        memory_bytes=16 * _GIB, reported_memory_bytes=15_642_329_088,
        memory_bandwidth=320e9, sms=40, l2_bytes=4 * _MIB, tdp_watts=70,
        peak_flops={"fp32": 8.1 * _T, "fp16": 65 * _T, "int8": 130 * _T},
        source="NVIDIA T4 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/tesla-t4/)",
        memory_type="GDDR6",
    ),
    # V100 SXM2: A100 whitepaper Table 1 (V100 column) / Volta whitepaper: FP64 7.8, FP32 15.7,
    # FP16 Tensor (FP16 or FP32 accumulate) 125 TFLOPS; 80 SMs, 6144 KB L2, 900 GB/s, 300 W.
    # No BF16/TF32/FP8/INT8 tensor: absent.
    # reported_memory_bytes: deviceQuery "16144 MBytes (16928342016 bytes)", driver 12.4;
    # L2: deviceQuery "L2 Cache Size: 6291456 bytes".
    GPU(
        key="v100-sxm2-16gb", name="Tesla V100-SXM2-16GB", arch="volta", compute_capability=(7, 0),
        memory_bytes=16 * _GIB, reported_memory_bytes=16_928_342_016,
        memory_bandwidth=900e9, sms=80, l2_bytes=6_291_456, tdp_watts=300,
        peak_flops={"fp64": 7.8 * _T, "fp32": 15.7 * _T, "fp16": 125 * _T},
        source="NVIDIA Tesla V100 GPU Architecture whitepaper, Table 1 (https://images.nvidia.com/"
               "content/volta-architecture/pdf/volta-architecture-whitepaper.pdf); NVIDIA V100 datasheet",
        memory_type="HBM2",
    ),
)
# fmt: on

GPUS: dict[str, GPU] = {gpu.key: gpu for gpu in _TABLE}

# Other names -> key. Written already normalized (see `normalize_name`), so a torch device name
# such as "NVIDIA H100 80GB HBM3" (torch.cuda.get_device_name()) resolves too.
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "h100": "h100-sxm",
        "h100-sxm5": "h100-sxm",
        "h100-sxm-80gb": "h100-sxm",
        "h100-96gb": "h100-sxm-96gb",
        "h100-sxm5-96gb": "h100-sxm-96gb",
        "h100-96gb-500w": "h100-sxm-96gb",
        "nvidia-h100-80gb-hbm3": "h100-sxm",
        "h100-pcie-80gb": "h100-pcie",
        "nvidia-h100-pcie": "h100-pcie",
        "nvidia-h100-nvl": "h100-nvl",
        "h800": "h800-sxm",
        "nvidia-h800": "h800-sxm",
        "h200": "h200-sxm",
        "nvidia-h200": "h200-sxm",
        "b200": "b200-sxm",
        "nvidia-b200": "b200-sxm",
        "a100": "a100-sxm-80gb",
        "a100-80gb": "a100-sxm-80gb",
        "a100-sxm4-80gb": "a100-sxm-80gb",
        "nvidia-a100-sxm4-80gb": "a100-sxm-80gb",
        "a100-40gb": "a100-sxm-40gb",
        "a100-sxm4-40gb": "a100-sxm-40gb",
        "nvidia-a100-sxm4-40gb": "a100-sxm-40gb",
        "a100-pcie": "a100-pcie-80gb",
        "nvidia-a100-80gb-pcie": "a100-pcie-80gb",
        "3090": "rtx-3090",
        "rtx3090": "rtx-3090",
        "geforce-rtx-3090": "rtx-3090",
        "nvidia-geforce-rtx-3090": "rtx-3090",
        "nvidia-l4": "l4",
        "nvidia-l40s": "l40s",
        "4090": "rtx-4090",
        "rtx4090": "rtx-4090",
        "geforce-rtx-4090": "rtx-4090",
        "nvidia-geforce-rtx-4090": "rtx-4090",
        "tesla-t4": "t4",
        "nvidia-t4": "t4",
        "v100": "v100-sxm2-16gb",
        "v100-sxm2": "v100-sxm2-16gb",
        "tesla-v100-sxm2-16gb": "v100-sxm2-16gb",
    }
)


def normalize_name(name: str) -> str:
    """Lower case, runs of spaces/underscores -> one hyphen: "NVIDIA H100 PCIe" -> "nvidia-h100-pcie"."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def resolve_gpu_key(name: str) -> str:
    """The catalogue key for a key, alias or torch device name (case-insensitive); ValueError if unknown."""
    norm = normalize_name(name)
    if norm in GPUS:
        return norm
    if norm in ALIASES:
        return ALIASES[norm]
    known = sorted(GPUS)
    close = difflib.get_close_matches(norm, [*known, *ALIASES], n=1, cutoff=0.5)
    hint = ""
    if close:
        target = ALIASES.get(close[0], close[0])
        hint = f" Did you mean {close[0]!r}" + (f" ({target})?" if target != close[0] else "?")
    raise ValueError(
        f"unknown GPU {name!r}.{hint} Known GPUs: {', '.join(known)}; "
        "aliases such as 'h100', 'a100', '4090' also work."
    )


def get_gpu(name: str) -> GPU:
    """The catalogue entry for a key, alias or torch device name, e.g. "h100", "A100", "NVIDIA L4"."""
    return GPUS[resolve_gpu_key(name)]


# CUDA context + kernel images, outside the caching allocator, as nvidia-smi shows them before any
# tensor exists (lazy module loading, CUDA 12/13). Typical values; the driver and the libraries
# loaded vary them. The one model of this memory: gpu_memory adds it to the reserved bytes for
# nvidia-smi, fit subtracts it from the GPU's memory for a default budget.
_CONTEXT_BYTES = {"hopper": 530 << 20, "blackwell": 600 << 20, "ampere": 430 << 20,
                  "ada": 420 << 20, "turing": 300 << 20, "volta": 300 << 20}


def cuda_context_bytes(gpu: GPU) -> int:
    return _CONTEXT_BYTES.get(gpu.arch, 500 << 20)


def usable_memory_bytes(gpu: GPU) -> int:
    """What the caching allocator can take: the memory torch reports, less the CUDA context."""
    return (gpu.reported_memory_bytes or gpu.memory_bytes) - cuda_context_bytes(gpu)


# ---- per-SM limits by compute capability ------------------------------------------------------
# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": resident threads
# per SM, 32-bit registers per SM, shared memory per SM and the most one block may opt in to.
# What `torch.cuda.get_device_properties` reports as max_threads_per_multi_processor,
# regs_per_multiprocessor, shared_memory_per_multiprocessor, shared_memory_per_block_optin
# (H100: 2048, 65536, 233472, 232448); inductor and Triton read them when they generate kernels.


@dataclass(frozen=True)
class SMLimits:
    threads_per_sm: int
    regs_per_sm: int
    smem_per_sm: int
    smem_per_block_optin: int


_KIB = 1024
_SM_LIMITS: Mapping[tuple[int, int], SMLimits] = MappingProxyType({
    (7, 0): SMLimits(2048, 65536, 96 * _KIB, 96 * _KIB),
    (7, 2): SMLimits(2048, 65536, 96 * _KIB, 96 * _KIB),
    (7, 5): SMLimits(1024, 65536, 64 * _KIB, 64 * _KIB),
    (8, 0): SMLimits(2048, 65536, 164 * _KIB, 163 * _KIB),
    (8, 6): SMLimits(1536, 65536, 100 * _KIB, 99 * _KIB),
    (8, 7): SMLimits(2048, 65536, 164 * _KIB, 163 * _KIB),
    (8, 9): SMLimits(1536, 65536, 100 * _KIB, 99 * _KIB),
    (9, 0): SMLimits(2048, 65536, 228 * _KIB, 227 * _KIB),
    (10, 0): SMLimits(2048, 65536, 228 * _KIB, 227 * _KIB),
    (10, 3): SMLimits(2048, 65536, 228 * _KIB, 227 * _KIB),
    (12, 0): SMLimits(1536, 65536, 100 * _KIB, 99 * _KIB),
    (12, 1): SMLimits(1536, 65536, 100 * _KIB, 99 * _KIB),
})


def sm_limits(compute_capability: tuple[int, int]) -> SMLimits:
    return _SM_LIMITS[compute_capability]


# ---- interconnects ---------------------------------------------------------------------------
# How a GPU talks to the others in its node and to other nodes, per direction, per GPU, in
# bytes/s (decimal, as datasheets print them; NVIDIA prints NVLink and PCIe bandwidth as the sum
# of both directions, halved here). `inter_node` is the network a server built around the GPU
# gives each GPU: the DGX/HGX reference designs put one NIC per GPU (rail-optimised). Where no
# reference server exists (PCIe cards) it is None and the collective model assumes
# DEFAULT_INTER_NODE_BANDWIDTH, and says so.


@dataclass(frozen=True)
class Interconnect:
    intra_node: float            # bytes/s per direction, GPU to GPU inside a node
    intra_kind: str              # "NVLink 4 (NVSwitch)", "PCIe Gen4 x16", ...
    inter_node: float | None     # bytes/s per direction per GPU across nodes
    inter_kind: str
    gpus_per_node: int
    source: str


DEFAULT_INTER_NODE_BANDWIDTH = 25e9   # 200 Gb/s per GPU (one HDR / 200 GbE NIC), an assumption

_GBPS = 1e9 / 8   # one Gb/s in bytes/s

# fmt: off
INTERCONNECTS: Mapping[str, Interconnect] = MappingProxyType({
    # H100 datasheet: "NVLink: 900GB/s; PCIe Gen5: 128GB/s" (both directions). DGX H100 datasheet:
    # 8x single-port ConnectX-7 VPI, 400 Gb/s InfiniBand (NDR), one per GPU; NVSwitch inside.
    "h100-sxm": Interconnect(450e9, "NVLink 4 (NVSwitch)", 400 * _GBPS, "InfiniBand NDR 400 Gb/s",
                             8, "NVIDIA H100 datasheet; NVIDIA DGX H100 datasheet"),
    # the 96 GB 500 W H100 of Grand Teton hosts: the same NVLink 4 / NVSwitch baseboard; one
    # 400 Gb/s NIC per GPU as DGX H100 (assumed: the cluster's network is set per run)
    "h100-sxm-96gb": Interconnect(450e9, "NVLink 4 (NVSwitch)", 400 * _GBPS,
                                  "400 Gb/s per GPU (as DGX H100, assumed)", 8,
                                  "NVIDIA H100 datasheet; network as NVIDIA DGX H100 (assumed)"),
    # PCIe cards: GPU to GPU over PCIe Gen5 x16 (the NVLink bridge joins pairs only)
    "h100-pcie": Interconnect(64e9, "PCIe Gen5 x16", None, "unspecified", 8,
                              "NVIDIA H100 datasheet (PCIe Gen5 128GB/s; NVLink bridge 600GB/s for pairs)"),
    "h100-nvl": Interconnect(64e9, "PCIe Gen5 x16", None, "unspecified", 8,
                             "NVIDIA H100 NVL datasheet (PCIe Gen5 128GB/s; NVLink bridge 600GB/s for pairs)"),
    # H800 datasheet: NVLink 400GB/s (both directions); HGX H800 servers: NVSwitch, one 400 Gb/s
    # NIC per GPU as DGX H100 (assumed: no DGX H800 datasheet)
    "h800-sxm": Interconnect(200e9, "NVLink 4 at 400 GB/s (NVSwitch)", 400 * _GBPS,
                             "InfiniBand NDR 400 Gb/s (as DGX H100)", 8,
                             "NVIDIA H800 datasheet; network as NVIDIA DGX H100 (assumed)"),
    # H200 datasheet: NVLink 900GB/s; DGX H200: 8x ConnectX-7 400 Gb/s
    "h200-sxm": Interconnect(450e9, "NVLink 4 (NVSwitch)", 400 * _GBPS, "InfiniBand NDR 400 Gb/s",
                             8, "NVIDIA H200 datasheet; NVIDIA DGX H200 datasheet"),
    # HGX B200: NVLink 5, 1.8TB/s per GPU; DGX B200: 8x single-port ConnectX-7 400 Gb/s
    "b200-sxm": Interconnect(900e9, "NVLink 5 (NVSwitch)", 400 * _GBPS, "InfiniBand NDR 400 Gb/s",
                             8, "NVIDIA HGX B200 / DGX B200 datasheets"),
    # A100 datasheet: NVLink 600GB/s, PCIe Gen4 64GB/s; DGX A100: 8x single-port ConnectX-6 200 Gb/s
    "a100-sxm-80gb": Interconnect(300e9, "NVLink 3 (NVSwitch)", 200 * _GBPS,
                                  "InfiniBand HDR 200 Gb/s", 8,
                                  "NVIDIA A100 datasheet; NVIDIA DGX A100 datasheet"),
    "a100-sxm-40gb": Interconnect(300e9, "NVLink 3 (NVSwitch)", 200 * _GBPS,
                                  "InfiniBand HDR 200 Gb/s", 8,
                                  "NVIDIA A100 datasheet; NVIDIA DGX A100 datasheet"),
    "a100-pcie-80gb": Interconnect(32e9, "PCIe Gen4 x16", None, "unspecified", 8,
                                   "NVIDIA A100 datasheet (PCIe Gen4 64GB/s; NVLink bridge for pairs)"),
    "rtx-3090": Interconnect(32e9, "PCIe Gen4 x16", None, "unspecified", 8,
                             "PCI Express 4.0 x16: 32 GB/s per direction"),
    "l4": Interconnect(32e9, "PCIe Gen4 x16", None, "unspecified", 8,
                       "NVIDIA L4 datasheet (PCIe Gen4 x16 64GB/s)"),
    "l40s": Interconnect(32e9, "PCIe Gen4 x16", None, "unspecified", 8,
                         "NVIDIA L40S datasheet (PCIe Gen4 x16 64GB/s)"),
    "rtx-4090": Interconnect(32e9, "PCIe Gen4 x16", None, "unspecified", 8,
                             "PCI Express 4.0 x16: 32 GB/s per direction"),
    "t4": Interconnect(16e9, "PCIe Gen3 x16", None, "unspecified", 8,
                       "NVIDIA T4 datasheet (PCIe Gen3 x16 32GB/s)"),
    # V100 SXM2: NVLink 2, 300GB/s; DGX-1: 4x EDR 100 Gb/s InfiniBand for 8 GPUs
    "v100-sxm2-16gb": Interconnect(150e9, "NVLink 2 (hybrid cube mesh)", 50 * _GBPS,
                                   "InfiniBand EDR 100 Gb/s, one per two GPUs", 8,
                                   "NVIDIA V100 datasheet; NVIDIA DGX-1 datasheet"),
})
# fmt: on


def interconnect(gpu: GPU) -> Interconnect:
    """The interconnect of a catalogue GPU (its reference server's network)."""
    found = INTERCONNECTS.get(gpu.key)
    if found is None:  # a GPU added to the catalogue without its links: say PCIe Gen4
        return Interconnect(32e9, "PCIe Gen4 x16 (assumed)", None, "unspecified", 8, "assumed")
    return found
