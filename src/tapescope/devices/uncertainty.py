"""How far each mechanism of the step-time model can be off: the data behind the error band
(analysis/time_band.py).

A mechanism is one way the model turns work into time: a GEMM of a given size class priced by
its ceiling and tiles, an attention kernel priced on a published curve, a memory-bound kernel at
the STREAM bandwidth, a collective that compute waits for, the host issuing ops while the GPU
waits, the clock of several GPUs run in lockstep. Each carries the range of its time error
(predicted / true - 1 of the seconds it prices) and where that range comes from: measured
against a published measurement the model was not fitted on, or a stated prior where none was
found (`prior=True`; the band says it rests on priors).

These ranges were set from the sources named at each entry before the band they make was
compared with any held-out published run (docs/validation.md, "The error band").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Uncertainty", "MECHANISMS", "GEMM_LARGE", "GEMM_OTHER", "ATTENTION_CURVE",
           "ATTENTION_INTERPOLATED", "ATTENTION_FLAT", "CONVOLUTION", "MEMORY_BOUND",
           "COLLECTIVES", "HOST", "LOCKSTEP_CLOCK", "LARGE_GEMM_DIM"]


@dataclass(frozen=True)
class Uncertainty:
    """The range of the time error of the seconds one mechanism prices."""

    low: float        # predicted / true - 1 at its most optimistic (a time too short)
    high: float       # ... at its most pessimistic
    source: str
    prior: bool = False   # no measurement found: a stated round range


GEMM_LARGE = "GEMM, every dimension >= 4096"
GEMM_OTHER = "GEMM, a dimension < 4096"
ATTENTION_CURVE = "attention on a published curve"
ATTENTION_INTERPOLATED = "attention between a curve's known points"
ATTENTION_FLAT = "attention at a flat figure"
CONVOLUTION = "convolution"
MEMORY_BOUND = "memory-bound kernel"
COLLECTIVES = "exposed collectives"
HOST = "GPU waiting for the host"
LOCKSTEP_CLOCK = "several GPUs' clocks in lockstep"

# the size class of a GEMM: Azure's rows with every dimension >= this are the "large" ones
LARGE_GEMM_DIM = 4096

MECHANISMS = {
    # Azure AI-benchmarking-guide cuBLASLt GEMMs (A100 fp16, H100 and H200 fp8; the rows
    # tests/test_gpu_model.py holds), this model's TFLOP/s against each: the 11 rows with every
    # dimension >= 4096 and not fitted are +0.3% to +7.4% optimistic; the 3 fitted 16384^3 rows
    # are within 0.03%. As time errors: 1 / 1.074 - 1 = -6.9% to +0.0%.
    GEMM_LARGE: Uncertainty(-0.069, 0.0, "Azure's cuBLASLt GEMM tables, the 14 rows with every "
                            "dimension >= 4096 (11 not fitted): TFLOP/s +0.3% to +7.4%"),
    # the same tables' other 12 rows (1024^3, 2048^3, 1024 x 2145 x 1024, 802816 x 192 x 768):
    # TFLOP/s -11.6% (A100 2048^3) to +35.3% (H200 802816 x 192 x 768); time +13.1% to -26.1%
    GEMM_OTHER: Uncertainty(-0.261, 0.131, "Azure's cuBLASLt GEMM tables, the 12 rows with a "
                            "dimension < 4096: TFLOP/s -11.6% to +35.3%"),
    # FlashAttention-3 paper's curves as transcribed from a third-party extraction (published_
    # runs.md says to check them against the figures; not done): a round prior for the reading
    ATTENTION_CURVE: Uncertainty(-0.10, 0.10, "FlashAttention-3 paper curves as a third-party "
                                 "extraction transcribed them, unchecked: a +-10% prior", True),
    # FlashAttention-2's curve has only its ends (512 and 16k): a straight line in log2(seq)
    # between the ends of each complete cuDNN curve lies up to 16.4% below its known points
    # (causal forward at 2k: 404.6 vs 484 TFLOP/s), i.e. a time up to 1 / 0.836 - 1 = +19.6% too
    # long; the transcription prior below
    ATTENTION_INTERPOLATED: Uncertainty(-0.10, 0.196, "a straight line between a curve's ends "
                                        "against the cuDNN curves' known points: up to 16.4% "
                                        "low in TFLOP/s; the transcription's +-10% prior below"),
    # the flat figures of devices/efficiency.py ATTENTION come from published ranges over
    # sequences 2k-16k; the widest, flash backward on A100 150-190 TFLOP/s against 0.54 x 312 =
    # 168.5: time -11.3% to +12.3%
    ATTENTION_FLAT: Uncertainty(-0.113, 0.123, "the published range behind the widest flat "
                                "attention figure (FlashAttention-2 backward on A100, 150-190 "
                                "TFLOP/s)"),
    CONVOLUTION: Uncertainty(-0.20, 0.20, "no published per-shape measurement used: the prior's "
                             "round 60% of peak, +-20%", True),
    # STREAM Copy / Triad (Azure) price copies and elementwise kernels on A100, H100, H200; how
    # close torch's own eager kernels (reductions, norms, strided copies) come to STREAM was not
    # found measured
    MEMORY_BOUND: Uncertainty(-0.15, 0.15, "torch's memory-bound kernels against the STREAM "
                              "bandwidths they are priced at: not found measured, +-15% prior",
                              True),
    # NVLink all-gather / reduce-scatter: the model's 360 GB/s against the 360-370 GB/s NCCL's
    # maintainer gives for 8 H100 (nccl-tests#212, #326); across nodes the 90% of the NIC's rate
    # is a prior
    COLLECTIVES: Uncertainty(-0.10, 0.10, "NVLink bus bandwidth within 3% of nccl-tests' "
                             "maintainer figures; the network's 90% of line rate a prior: "
                             "+-10%", True),
    # host seconds per op are priors (devices/efficiency.py HOST_OP_S); the one measured group
    # cost moved 0.46 -> 0.37 ms between two torch versions (PR #133369), and host CPUs differ
    HOST: Uncertainty(-0.50, 0.50, "per-op host costs are priors; FSDP2's all-gather host cost "
                      "moved 24% between two torch versions: +-50% prior", True),
    # ml-engineering's MSMF on an 8 x H200 node all busy: node MSMF 698.6 TFLOP/s mean with a
    # 4.5% spread, and 727 for the node against a median GPU's 752 (the slowest GPU sets the
    # pace of a step that synchronises every GPU): compute-bound time up to 4.5% too short
    LOCKSTEP_CLOCK: Uncertainty(-0.045, 0.0, "ml-engineering MSMF on an 8-GPU node: the slowest "
                                "GPU sets the pace, 3.3-4.5% below one GPU's"),
}
