"""`tapescope calibrate`: measure this machine's GPU once, price GPU-less profiles with it anywhere.

    cal = tapescope.calibrate(out="h100.json")                 # on the GPU machine (default shapes)
    p = tapescope.profile(model, ..., gpu="h100")              # or the shapes of your own step:
    cal = tapescope.calibrate(p, out="h100.json")
    tapescope.profile(model, ..., calibration="h100.json")     # on a laptop: calibrated step time

What is measured (calibration/probes.py), how it is timed (calibration/measure.py) and what the file
holds (devices/calibration.py); analysis/calibrated_cost.py applies it.
"""

from __future__ import annotations

from ..devices.calibration import Calibration
from .measure import DEADLINE_S, cuda_facts, cuda_timer, require_gpu, run_probes
from .probes import default_probes, probes_for_kernels

__all__ = ["calibrate", "profile_kernels", "write_calibration"]


def profile_kernels(profile) -> list:
    """The kernels (analysis.kernel_cost.Kernel) a profile's step launches; a compiled profile's
    eager step (its GEMMs and attention are the same)."""
    from ..analysis.kernel_cost import kernel_of
    from ..analysis.op_classes import launches_kernel

    eager = profile.eager if profile.eager is not None else profile
    return [kernel_of(op, eager.trace.storages) for op in eager.ops
            if launches_kernel(op.record.func)]


def write_calibration(cal: Calibration, path: str) -> None:
    from ..report.files import write_json

    write_json(path, cal.to_dict())


def calibrate(profile=None, *, out: str | None = None, deadline_s: float = DEADLINE_S,
              progress=None, nccl: bool = True) -> Calibration:
    """Measure this machine's GPU: GEMMs and fused attention at the shapes `profile` (a CUDA
    Profile of the step you will plan) launches, else at transformer-sized defaults; copy and
    elementwise bandwidth from 64 KiB to 1 GiB; the launch overhead on the GPU and on the host;
    with several GPUs (and `nccl`), NCCL's all-reduce, all-gather and reduce-scatter over all of
    them. Writes the file to `out` when given. Refuses (TapescopeError) without a GPU."""
    import dataclasses

    import torch

    from ..errors import TapescopeError

    device = require_gpu()
    facts = cuda_facts(device)
    if profile is not None and (profile.gpu is None or profile.trace.device.type != "cuda"):
        raise TapescopeError("calibrate takes a CUDA profile (device='cuda'), whose kernels it "
                             "measures; this one traced no GPU kernels")
    probes = default_probes() if profile is None else probes_for_kernels(profile_kernels(profile))
    cal = run_probes(probes, device, cuda_timer, facts, deadline_s, progress)
    if nccl and torch.cuda.device_count() > 1:
        from .nccl import measure_collectives

        if progress is not None:
            progress(f"NCCL collectives over {torch.cuda.device_count()} GPUs")
        cal = dataclasses.replace(cal, nccl=measure_collectives(torch.cuda.device_count()))
    if out:
        write_calibration(cal, out)
    return cal
