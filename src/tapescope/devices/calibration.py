"""A calibration file: what one real GPU measured, as a plain frozen record.

`tapescope calibrate` (tapescope/calibration/) writes it on a machine with the GPU; `--calibration
FILE` (or TAPESCOPE_CALIBRATION) applies it to GPU-less profiles of that GPU, where
analysis/calibrated_cost.py prices each kernel from the nearest measurement instead of the priors
of devices/efficiency.py.

The file is JSON (FORMAT below): the GPU as the driver described it (name, SMs, clocks, power
limit, driver and CUDA versions), the torch version and the date, then every measurement with its
shape and its seconds per call (CUDA events around back-to-back calls, replayed from a CUDA graph
where it can capture them: calibration/measure.py):

- gemm: torch.matmul of (batch x) m x k by k x n in one dtype;
- attention: one fused attention kernel (backend flash / efficient / cudnn), forward or backward,
  by batch x heads, query and key lengths, head dim and causal mask; FLOPs counted over the
  unmasked pairs, as analysis/flops.py counts them;
- bandwidth: a copy (`dst.copy_(src)`) or an elementwise kernel (`torch.add`) of so many bytes read
  plus written;
- launch: the GPU's time per tiny kernel issued back to back from a CUDA graph (no host in the
  way), and the host's time per tiny eager op (Python, dispatcher and launch, the GPU waiting);
- nccl: a collective over the node's GPUs, with the bus bandwidth nccl-tests would print.

What it does not hold: convolutions, fp8 GEMMs unless the step had them, anything across nodes.
Kernels of a kind the file did not measure keep the model's priors (and their time stays marked
uncalibrated).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from ..errors import TapescopeError

__all__ = ["Calibration", "GemmPoint", "AttentionPoint", "BandwidthPoint", "NcclPoint",
           "FORMAT", "ENV_VAR", "load_calibration", "nearest"]

FORMAT = "tapescope-calibration/1"
ENV_VAR = "TAPESCOPE_CALIBRATION"


@dataclass(frozen=True)
class GemmPoint:
    dtype: str          # "bf16", "fp16", "fp32", "fp8"
    batch: int
    m: int
    n: int
    k: int
    seconds: float      # per call

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class AttentionPoint:
    backend: str        # "flash", "efficient", "cudnn"
    direction: str      # "forward", "backward"
    dtype: str
    batch_heads: int    # batch x heads
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    flops: int          # over the unmasked pairs (analysis/flops.py's count)
    seconds: float


@dataclass(frozen=True)
class BandwidthPoint:
    kind: str           # "copy" or "elementwise"
    bytes: int          # read + written
    seconds: float


@dataclass(frozen=True)
class NcclPoint:
    collective: str     # "all_reduce", "all_gather", "reduce_scatter"
    ranks: int
    bytes: int          # the collective's size as nccl-tests counts it
    seconds: float
    bus_bandwidth: float   # bytes/s, nccl-tests' busbw


@dataclass(frozen=True)
class Calibration:
    """Measurements of one GPU; `source` is the file it was read from (for the report)."""

    gpu_name: str                   # torch.cuda.get_device_name, e.g. "NVIDIA H100 80GB HBM3"
    torch: str
    date: str                       # ISO 8601, UTC
    kernel_overhead_s: float        # GPU time per tiny kernel, back to back
    host_op_s: float                # host time per tiny eager op
    gemm: tuple = ()                # GemmPoint
    attention: tuple = ()           # AttentionPoint
    bandwidth: tuple = ()           # BandwidthPoint
    nccl: tuple = ()                # NcclPoint
    device: dict = field(default_factory=dict, hash=False)   # sms, clocks, power limit, driver...
    source: str = ""

    @property
    def label(self) -> str:
        """How a report names it: the file, the GPU and the day it was measured."""
        where = self.source or "a calibration"
        return f"{where} ({self.gpu_name}, {self.date[:10]})"

    def to_dict(self) -> dict:
        d = {"format": FORMAT, "gpu_name": self.gpu_name, "torch": self.torch, "date": self.date,
             "device": dict(self.device),
             "launch": {"kernel_overhead_s": self.kernel_overhead_s, "host_op_s": self.host_op_s}}
        for name in ("gemm", "attention", "bandwidth", "nccl"):
            d[name] = [asdict(p) for p in getattr(self, name)]
        return d

    @classmethod
    def from_dict(cls, d, source: str = "") -> "Calibration":
        """The record of a file's JSON; a TapescopeError naming the file and the bad entry."""
        where = source or "the calibration"
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise TapescopeError(f"{where} is not a tapescope calibration file (no \"format\": "
                                 f"\"{FORMAT}\"); write one with `tapescope calibrate --out FILE`"
                                 " on a machine with the GPU")
        try:
            launch = d["launch"]
            points = {name: tuple(_point(kind, p) for p in d.get(name, ()))
                      for name, kind in (("gemm", GemmPoint), ("attention", AttentionPoint),
                                         ("bandwidth", BandwidthPoint), ("nccl", NcclPoint))}
            return cls(gpu_name=str(d["gpu_name"]), torch=str(d["torch"]), date=str(d["date"]),
                       kernel_overhead_s=_positive(launch["kernel_overhead_s"]),
                       host_op_s=_positive(launch["host_op_s"]), device=dict(d.get("device", {})),
                       source=source, **points)
        except (KeyError, TypeError, ValueError) as e:
            raise TapescopeError(f"{where}: cannot read it as a calibration ({type(e).__name__}: "
                                 f"{e}); write it again with `tapescope calibrate`") from None


def _positive(x) -> float:
    x = float(x)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"a measured time or size must be positive, got {x}")
    return x


def _point(kind, raw: dict):
    names = {f.name for f in fields(kind)}
    missing = names - set(raw) - ({"flops"} if kind is GemmPoint else set())
    if missing:
        raise KeyError(f"{kind.__name__} without {', '.join(sorted(missing))}")
    values = {k: raw[k] for k in names if k in raw}
    point = kind(**values)
    for f in ("seconds", "bytes", "flops", "m", "n", "k", "batch", "batch_heads", "seq_q",
              "seq_k", "head_dim", "ranks"):
        if f in names:
            _positive(getattr(point, f))
    return point


def load_calibration(path: str) -> Calibration:
    """Read a calibration file; one clear TapescopeError when it cannot be used."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise TapescopeError(f"cannot read the calibration file {path}: {e.strerror}") from None
    except ValueError as e:
        raise TapescopeError(f"the calibration file {path} is not JSON ({e})") from None
    return Calibration.from_dict(data, source=str(path))


def nearest(points, key, target: tuple):
    """The point whose key(point) is nearest `target` in log space (sizes span decades: a 4096
    GEMM is as far from 2048 as 2048 from 1024); None when there are no points. A key entry that
    is a bool (the causal mask) counts a mismatch as a factor of e^4 in size."""
    best, best_d = None, math.inf
    for p in points:
        d = 0.0
        for a, b in zip(key(p), target):
            if isinstance(a, bool) or isinstance(b, bool):
                d += 0.0 if a == b else 4.0
            else:
                d += abs(math.log(a / b))
        if d < best_d:
            best, best_d = p, d
    return best
