"""How close to a GPU's peak each kind of op runs: the timing model's constants, as data.

Every entry says where it comes from. Measured entries (from `tapescope validate` on a real GPU,
`benchmarks/validate_models.py`) carry the GPU, the torch version and the date; until a GPU has
measured them the model runs on the priors below, which are round numbers from published kernel
benchmarks of this class of hardware, and its times are marked uncalibrated.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Efficiency", "PRIORS", "MEASURED", "efficiency_for"]


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
# in eager PyTorch (Python binding, dispatcher, autograd bookkeeping, launch call).
KERNEL_OVERHEAD_S = 3e-6
HOST_OP_S = 9e-6
HOST_VIEW_S = 3e-6


# (GPU catalogue key, op class) -> Efficiency measured on that GPU (gpu, torch and date set).
# Empty until a session with a GPU runs the calibration (docs/validation.md, issue "GPU").
MEASURED: dict = {}


def efficiency_for(op_class: str, gpu_key: str | None = None) -> Efficiency:
    """The constants for an op class on a GPU: the ones measured on that GPU when a calibration
    exists, else the priors."""
    measured = MEASURED.get((gpu_key, op_class))
    if measured is not None:
        return measured
    return PRIORS.get(op_class, PRIORS["other"])
