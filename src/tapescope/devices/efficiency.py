"""How close to a GPU's peak each kind of op runs: the timing model's constants, as data.

Every entry says where it comes from. Measured entries (from `tapescope validate` on a real GPU,
`benchmarks/validate_models.py`) carry the GPU, the torch version and the date; until a GPU has
measured them the model runs on the priors below, which are round numbers from published kernel
benchmarks of this class of hardware, and its times are marked uncalibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Efficiency", "PRIORS", "MEASURED", "efficiency_for", "MATMUL_CEILING", "GEMM_TILES",
           "gemm_tile_utilization", "matmul_ceiling", "ATTENTION", "attention_efficiency",
           "MATMUL_CEILING_FP8", "ACHIEVABLE_BANDWIDTH", "achievable_bandwidth", "SUSTAINED_SHARE", "sustained_clock", "ATTENTION_CURVES",
           "attention_curve_share", "attention_provenance",
           "NCCL_SMS", "ELEMENTWISE_BANDWIDTH", "PYTHON_HOST_S", "FSDP2_ALL_GATHER_HOST_S"]


@dataclass(frozen=True)
class Efficiency:
    compute: float            # fraction of the dtype's peak FLOP/s a large kernel reaches
    memory: float             # fraction of peak DRAM bandwidth a large kernel reaches
    saturation_flops: float   # below about this many FLOPs a kernel cannot fill the GPU
    source: str
    gpu: str | None = None    # measured on
    torch: str | None = None
    date: str | None = None


_PRIOR = "prior: round figure from published GEMM/attention/elementwise benchmarks, not measured here"

PRIORS = {
    "matmul": Efficiency(0.75, 0.80, 2e10, _PRIOR),
    "attention": Efficiency(0.55, 0.80, 2e10, _PRIOR),
    "convolution": Efficiency(0.60, 0.80, 2e10, _PRIOR),
    "other": Efficiency(0.50, 0.75, 1e8, _PRIOR),
}

# GPU-side cost of one kernel (launch latency and tail), and host-side cost of dispatching one op
# in eager PyTorch (Python binding, dispatcher, autograd bookkeeping, launch call): priors, round
# figures. For scale: PyTorch's own launch study (meta-pytorch/tritonbench PR #1017, GB200 host)
# measured 6.8-9.1 us for one compiled kernel's launch from Python without the dispatcher or
# autograd (analysis/compiled_time.py), so an eager op's 9 us is at the low end of what an op
# that also goes through the dispatcher and autograd costs; devices/uncertainty.py carries the
# host's uncertainty as a prior.
KERNEL_OVERHEAD_S = 3e-6
HOST_OP_S = 9e-6
HOST_VIEW_S = 3e-6

# ---- host work the trace does not record: Python around some ops -------------------------------
# FSDP2's per-group host cost. One all-gather of a group (`foreach_all_gather`: the parameters'
# cast to the compute dtype, the copy-in, the collective's issue) costs the host 0.37 ms on
# Llama3-8B's blocks (pytorch/pytorch PR #133369, "[FSDP2] Added eager fast-path for fp32->bf16
# param cast", 2024-08: "(New) on Llama3-8B (0.37 ms CPU overhead for all-gather)", 0.46 ms
# before the fast path; 0.996 ms with float8 all-gather). The fast path is the code torch 2.14
# runs: the trace records it as two empty tensors, one split and one _foreach_copy_, the
# `fsdp.all_gather_copy_in` and the collective, which the schedule already charges 3 x HOST_OP_S +
# 3 x HOST_VIEW_S. The rest, FSDP2's Python (hooks, per-parameter bookkeeping, stream and event
# calls), is charged to the group's copy-in op. A user's report of the same kind: pytorch/pytorch
# issue #173680 (torch 2.10, a model of many small groups): `FSDP::pre_forward` about 1 ms per
# group, 50% of the step, the GPU mostly idle. No published figure was found for the
# reduce-scatter's side (`foreach_reduce`): nothing is added there.
FSDP2_ALL_GATHER_HOST_S = 0.37e-3
PYTHON_HOST_S = {
    "fsdp.all_gather_copy_in": FSDP2_ALL_GATHER_HOST_S - 3 * HOST_OP_S - 3 * HOST_VIEW_S,
}


# (GPU catalogue key, op class) -> Efficiency measured on that GPU (gpu, torch and date set).
# Empty until a session with a GPU runs the calibration (docs/validation.md, issue "GPU").
MEASURED: dict = {}


# ---- GEMMs: the ceiling a GPU's cuBLAS reaches, and the tiles that quantize it ----------------
# Maximum Achievable Matmul FLOPS (MAMF): the best bf16 matmul throughput over a sweep of shapes,
# measured with mamf-finder.py (S. Bekman, "Machine Learning Engineering", compute/accelerator,
# "Maximum Achievable Matmul FLOPS comparison table"): A100 SXM 271.2 of 312 TFLOPS (86.9%),
# A100 PCIe 252.9 (81.1%), H100 SXM 794.5 of 989 (80.3%, sustained clocks at 700 W included),
# GH200 828.6 (83.8%, 900 W: used for H200, same die and more power headroom).
# A GPU without a measurement keeps the prior (PRIORS["matmul"].compute).
# FP8 (float8_e4m3fn) MAMF, same table: H100 SXM 1402.6 of 1979 (70.9%), H200 SXM 1453.4
# (73.4%), B200 3432.5 of 4500 (76.3%); B200 bf16 1745.0 of 2250 (77.6%).
MATMUL_CEILING = {
    "a100-sxm-80gb": 0.869, "a100-sxm-40gb": 0.869, "a100-pcie-80gb": 0.811,
    "h100-sxm": 0.803, "h800-sxm": 0.803, "h200-sxm": 0.838, "b200-sxm": 0.776,
    "h100-sxm-96gb": 0.803,
}
MATMUL_CEILING_FP8 = {
    "h100-sxm": 0.709, "h800-sxm": 0.709, "h100-sxm-96gb": 0.709, "h200-sxm": 0.734,
    "b200-sxm": 0.763,
}

# ---- sustained clocks: burst (MAMF) vs sustained (MSMF) ---------------------------------------
# MAMF is the best short burst; a training step keeps the GPU loaded for seconds, and under
# sustained load the board's power and thermal limits pull the clock down. The share of the
# burst a loaded GPU keeps, per part and precision (16-bit: bf16/fp16; fp8), each measured:
# - bf16, Hopper: Maximum Sustained Matmul FLOPS (MSMF, ml-engineering compute/accelerator/
#   benchmarks, as transcribed in shared/reference/published_runs.md "Burst vs sustained matmul";
#   the stored snapshot of that repo, 744d01e of 2026-08-22, predates the MSMF section): H200 MSMF
#   743-746 vs MAMF 843-850 TFLOP/s over 5 runs (744.5 / 846.5 = 0.880). H100 SXM (and H800, and
#   the 96 GB part) share H200's die, its 700 W board and its clocks: H200's ratio is used.
# - bf16, B200: the same source, 1421-1428 vs 1682-1705 (1424.5 / 1693.5 = 0.841).
# - fp16 A100 SXM, fp8 H100 SXM and H200: Azure's AI-benchmarking-guide (Azure_Results/
#   ND_A100_v4_results.md, ND_H100_v5_results.md, ND_H200_v5_results.md), cuBLASLt GEMMs after
#   10,000 warm-up iterations (a sustained load): at 16384^3, a shape the tile model counts as
#   full (0.998 / 0.993 of the tile work useful), A100 256.5 TFLOP/s, H100 fp8 1377.3, H200 fp8
#   1366.3, against this model's burst there (MAMF x tile share, 3 us overhead): 0.948, 0.989,
#   0.948. FITTED on those three 16384^3 rows; the other shapes of the same tables are the check
#   (tests/test_gpu_model.py, docs/validation.md "GEMMs against Azure's tables").
# No sustained figure was found for other parts (Ada, Turing, Volta, A100 PCIe, fp8 on B200):
# their burst ceiling stands (factor 1). The factor scales every compute-bound kernel (GEMMs,
# attention, convolutions) at that precision: it is the clock, not a property of one kernel.
SUSTAINED_SHARE = {
    ("h100-sxm", "16-bit"): 0.880, ("h800-sxm", "16-bit"): 0.880,
    ("h200-sxm", "16-bit"): 0.880, ("h100-sxm-96gb", "16-bit"): 0.880,
    ("b200-sxm", "16-bit"): 0.841,
    ("a100-sxm-80gb", "16-bit"): 0.948, ("a100-sxm-40gb", "16-bit"): 0.948,
    ("h100-sxm", "fp8"): 0.989, ("h800-sxm", "fp8"): 0.989, ("h100-sxm-96gb", "fp8"): 0.989,
    ("h200-sxm", "fp8"): 0.948,
}
# Board power drawn at the sustained clock, measured: the same MSMF source's H200 4096^3
# example ran at 679 W and 1792 MHz sustained (781 TFLOP/s at 1980 MHz in a burst).
SUSTAINED_WATTS = {"h100-sxm": 679, "h800-sxm": 679, "h200-sxm": 679, "h100-sxm-96gb": 679}


def sustained_clock(gpu, precision: str = "16-bit") -> float:
    """Share of the burst clock a GPU (devices.gpus.GPU) keeps over a training step at a
    precision ("16-bit" or "fp8"; fp8 without its own figure takes the part's 16-bit one): the
    sustained / burst ratio measured on its part, lowered further by a board power limit set
    below the power it draws at that clock. Dynamic power is C V^2 f and, over the DVFS range,
    the voltage rises about linearly with the clock, so power goes as f^3 and the clock as the
    cube root of the power: f_cap = f_sustained * (limit / sustained draw)^(1/3) (500 W on a
    679 W H100: 0.903). Static power is ignored, so this is the smallest drop the limit causes."""
    share = SUSTAINED_SHARE.get((gpu.key, precision),
                                SUSTAINED_SHARE.get((gpu.key, "16-bit"), 1.0))
    limit = getattr(gpu, "power_limit_watts", None)
    draw = SUSTAINED_WATTS.get(gpu.key, gpu.tdp_watts)
    if limit and limit < draw:
        share *= (limit / draw) ** (1 / 3)
    return share
# Output tiles (rows x columns of C per thread block) cuBLAS's large bf16 kernels use, as their
# kernel names print them (sm80_xmma_gemm_..._tilesize256x128x32, ..._128x256x32, 128x128;
# sm90_xmma_gemm_..._tilesize128x256x64 / 256x128x64): the library picks the best of them.
GEMM_TILES = ((256, 128), (128, 256), (128, 128))


def gemm_tile_utilization(m: int, n: int, batch: int, sms: int) -> float:
    """Share of the SMs' tile work that is useful for a (batch x) m x n output: tile quantization
    (a partial tile costs a whole one) times wave quantization (the last wave of thread blocks
    leaves SMs idle), at the best of GEMM_TILES. 1.0 when both divide evenly."""
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = batch * -(-m // tm) * -(-n // tn)
        waves = -(-tiles // sms)
        best = max(best, batch * m * n / (waves * sms * tm * tn))
    return best


def matmul_ceiling(gpu_key: str | None, dtype: str = "bf16") -> float:
    """The burst (MAMF) share of the dense peak a GPU's matmuls reach, for bf16/fp16 or fp8."""
    if dtype == "fp8" and gpu_key in MATMUL_CEILING_FP8:
        return MATMUL_CEILING_FP8[gpu_key]
    return MATMUL_CEILING.get(gpu_key, PRIORS["matmul"].compute)


# ---- fused attention: achieved share of the dense peak, by backend, architecture, direction ----
# Causal, head dim 128, sequence 2k-16k, bf16, FLOPs counted over the unmasked pairs (as
# analysis.flops counts them and as the FlashAttention benchmarks do).
# - flash on Ampere: FlashAttention-2 (Dao 2023), A100 figures: forward 190-225 TFLOPS,
#   backward 150-190 (of 312).
# - flash on Hopper (FlashAttention-2 kernels, which torch's flash backend is): FlashAttention-3
#   paper (Shah et al. 2024) H100 baselines: FA2 forward ~330-370, backward ~290-310 TFLOPS.
# - cuDNN on Hopper: the same paper's cuDNN baselines: forward ~550-620, backward ~450-500.
# - memory-efficient (xformers/CUTLASS) kernels: FlashAttention-2 paper's xformers baselines on
#   A100, forward ~120-130, backward ~90-100 TFLOPS.
ATTENTION = {
    ("flash", "ampere", "forward"): 0.66, ("flash", "ampere", "backward"): 0.54,
    ("flash", "ada", "forward"): 0.66, ("flash", "ada", "backward"): 0.54,
    ("flash", "hopper", "forward"): 0.35, ("flash", "hopper", "backward"): 0.30,
    ("cudnn", "hopper", "forward"): 0.59, ("cudnn", "hopper", "backward"): 0.47,
    ("efficient", "ampere", "forward"): 0.40, ("efficient", "ampere", "backward"): 0.30,
    ("efficient", "hopper", "forward"): 0.25, ("efficient", "hopper", "backward"): 0.20,
}


# By sequence length, mask and direction, where a published curve exists: FlashAttention-3 paper
# (Shah et al. 2024, arXiv 2407.08608, Figs 5-6; H100 SXM5, bf16, head dim 128; values as
# transcribed in shared/reference/published_runs.md from a third-party extraction), TFLOP/s at
# sequence lengths 512, 1k, 2k, 4k, 8k, 16k:
# - cuDNN forward, causal: 315, 410, 484, 518, 529, 539; not causal: 497, 574, 617, 609, 600, 595;
# - cuDNN backward (no mask): 305, 408, 465, 499, 518, 516;
# - FlashAttention-2 (torch's flash backend) forward, causal: 191 at 512 -> 335 at 16k; backward
#   214 -> 322 (only the ends were transcribed: between them the curve is taken as straight in
#   log2(sequence), as the cuDNN curves nearly are from 512 to 4k).
# A curve missing for one mask is the other's times the cuDNN forward ratio causal / not causal at
# the same length (the masked tiles' waste and the imbalance they leave are the same in both
# directions and backends): 0.63 at 512, 0.85 at 4k, 0.91 at 16k. Head dim: the extraction's
# head-dim 64 and 256 curves do not say which mask they are; head dim is not modelled yet.
ATTENTION_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_PEAK = 989.4e12        # the H100 SXM5's dense bf16 peak the curves are shares of
ATTENTION_CURVES = {
    ("cudnn", "hopper", "forward", True): (315, 410, 484, 518, 529, 539),
    ("cudnn", "hopper", "forward", False): (497, 574, 617, 609, 600, 595),
    ("cudnn", "hopper", "backward", False): (305, 408, 465, 499, 518, 516),
    ("flash", "hopper", "forward", True): (191, None, None, None, None, 335),
    ("flash", "hopper", "backward", False): (214, None, None, None, None, 322),
}


def _backend(op_name: str) -> str | None:
    return ("cudnn" if "cudnn" in op_name else "flash" if "flash" in op_name else
            "efficient" if "efficient" in op_name else None)


def _on_curve(curve: tuple, seq: int) -> float:
    """TFLOP/s at `seq` on a curve over ATTENTION_SEQ: straight in log2(seq) between the known
    points, flat beyond the ends."""
    import math

    known = [(math.log2(s), v) for s, v in zip(ATTENTION_SEQ, curve) if v is not None]
    x = math.log2(max(seq, 1))
    if x <= known[0][0]:
        return known[0][1]
    for (x0, v0), (x1, v1) in zip(known, known[1:]):
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return known[-1][1]


def attention_curve_share(backend, arch, direction, causal, seq) -> float | None:
    """Share of the dense peak on the published curve for this backend, architecture, direction
    and mask at sequence length `seq`, None where no curve exists."""
    curve = ATTENTION_CURVES.get((backend, arch, direction, causal))
    if curve is not None:
        return _on_curve(curve, seq) * 1e12 / ATTENTION_PEAK
    other = ATTENTION_CURVES.get((backend, arch, direction, not causal))
    ratio = (ATTENTION_CURVES.get(("cudnn", "hopper", "forward", True)),
             ATTENTION_CURVES.get(("cudnn", "hopper", "forward", False)))
    if other is None or arch != "hopper":
        return None
    r = _on_curve(ratio[0], seq) / _on_curve(ratio[1], seq)
    return _on_curve(other, seq) * (r if causal else 1 / r) * 1e12 / ATTENTION_PEAK


def attention_provenance(op_name: str, arch: str | None, shape: tuple | None = None) -> str:
    """Where attention_efficiency's figure for this call comes from: "curve" (a point of a
    published curve, or between two of its neighbouring points), "interpolated" (a curve known
    only at its ends, or derived from the other mask's curve), "flat" (a flat figure), or "none"."""
    backend = _backend(op_name)
    direction = "backward" if "backward" in op_name else "forward"
    if shape is not None:
        causal = bool(shape.causal)
        curve = ATTENTION_CURVES.get((backend, arch, direction, causal))
        if curve is not None:
            return "interpolated" if None in curve else "curve"
        if attention_curve_share(backend, arch, direction, causal, shape.seq_k) is not None:
            return "interpolated"
    return "flat" if (backend, arch, direction) in ATTENTION else "none"


def attention_efficiency(op_name: str, arch: str | None, shape: tuple | None = None
                         ) -> float | None:
    """The achieved share of peak of a fused attention op (its aten name), None when unknown.
    `shape` (analysis.kernel_cost.AttentionShape: the keys' sequence length, head dim, causal),
    when known, picks the point on the published curve of the backend on this architecture; else
    the flat figure of ATTENTION."""
    backend = _backend(op_name)
    direction = "backward" if "backward" in op_name else "forward"
    if shape is not None:
        seq, causal = shape.seq_k, shape.causal
        on_curve = attention_curve_share(backend, arch, direction, bool(causal), seq)
        if on_curve is not None:
            return on_curve
    return ATTENTION.get((backend, arch, direction))


# ---- memory-bound kernels -------------------------------------------------------------------
# Share of the DRAM peak that large elementwise / reduction kernels reach where no measurement of
# the GPU exists: a prior, like PRIORS["other"].memory.
ELEMENTWISE_BANDWIDTH = 0.80
# Achievable DRAM bandwidth measured with STREAM kernels (BabelStream), bytes/s: Azure's
# AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md, ND_H100_v5_results.md,
# ND_H200_v5_results.md, "HBM Bandwidth": Copy (one read, one write: what copy, cast, cat and
# FSDP2's copy-in / copy-out kernels do) and Triad (two reads, one write: a binary elementwise
# op). A100 SXM 80GB 1.61 / 1.70 TB/s of 2.039 (79% / 83%), H100 SXM 2.90 / 2.97 of 3.35
# (87% / 89%), H200 4.01 / 4.15 of 4.8 (84% / 86%).
ACHIEVABLE_BANDWIDTH = {
    "a100-sxm-80gb": {"copy": 1.61e12, "triad": 1.70e12},
    "h100-sxm": {"copy": 2.90e12, "triad": 2.97e12},
    "h200-sxm": {"copy": 4.01e12, "triad": 4.15e12},
}


def achievable_bandwidth(gpu, kind: str) -> float:
    """Bytes/s a large memory-bound kernel of `kind` ("copy" or "triad") moves on `gpu`: the
    STREAM measurement of the part, else ELEMENTWISE_BANDWIDTH of its DRAM peak."""
    measured = ACHIEVABLE_BANDWIDTH.get(gpu.key, {}).get(kind)
    return measured if measured is not None else gpu.memory_bandwidth * ELEMENTWISE_BANDWIDTH

# ---- collectives overlapping compute ------------------------------------------------------------
# SMs an NCCL collective occupies while it runs (one thread block per channel): NCCL's INFO log
# prints "16 coll channels" (up to 32) on 8-GPU NVSwitch nodes. Compute overlapped with a
# collective runs on the rest; its memory traffic competes too (not modelled).
NCCL_SMS = 16


def efficiency_for(op_class: str, gpu_key: str | None = None) -> Efficiency:
    """The constants for an op class on a GPU: the ones measured on that GPU when a calibration
    exists, else the priors."""
    measured = MEASURED.get((gpu_key, op_class))
    if measured is not None:
        return measured
    return PRIORS.get(op_class, PRIORS["other"])
