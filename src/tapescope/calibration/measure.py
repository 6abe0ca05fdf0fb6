"""Run the probes on the GPU, time each, and write what they measured as a Calibration.

`cuda_timer` times a function with CUDA events around back-to-back calls (warm-up first, then as
many calls as fit in about 50 ms, at least 5): seconds per call as the GPU's clock sees them. A
kernel's own time is taken with its calls captured in a CUDA graph and replayed: issued one by
one from Python, a kernel shorter than the host's launch (a 1024^3 GEMM on an H100, ~5 us) would
be timed at the host's pace, and the schedule (analysis/timing.py) adds the host's time already.
Where a probe cannot be captured, its eager calls are timed. `run_probes` takes the timer as an
argument, so tests run the whole path on the CPU with a timer of their own. The run stops starting probes at its deadline (the file says how many it skipped):
the default leaves the whole calibration under ten minutes.
"""

from __future__ import annotations

import datetime
import subprocess
import time

import torch

from ..devices.calibration import (AttentionPoint, BandwidthPoint, Calibration, GemmPoint)
from ..errors import TapescopeError

__all__ = ["cuda_timer", "run_probes", "cuda_facts", "require_gpu", "DEADLINE_S"]

DEADLINE_S = 540.0     # probes start no later than this: NCCL and writing the file fit in 10 min
_TARGET_S = 0.05       # time each probe's timed loop aims at


def _events_time(fn, iters: int) -> float:
    """Seconds per call of `iters` back-to-back calls of fn, on the GPU's clock."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _graphed(fn, calls: int):
    """`calls` calls of fn captured in one CUDA graph (warmed up on a side stream first, as
    torch.cuda.graph wants); its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def cuda_timer(fn, eager: bool = False, target_s: float = _TARGET_S, warmup: int = 3) -> float:
    """Seconds per call of `fn` on the current CUDA stream: its GPU time (calls replayed from a
    CUDA graph), or with `eager` as eager calls issue it (the host's pace when it is slower)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    once = max(_events_time(fn, 1), 1e-7)
    iters = int(min(1000, max(5, target_s / once)))
    if eager:
        return _events_time(fn, iters)
    calls = max(1, min(100, iters))
    try:
        replay = _graphed(fn, calls)
    except RuntimeError:       # not capturable (a host sync, a library that refuses capture)
        torch.cuda.synchronize()
        return _events_time(fn, iters)
    replay()
    torch.cuda.synchronize()
    replays = max(1, iters // calls)
    return _events_time(replay, replays) / calls


_POINTS = {"gemm": GemmPoint, "attention": AttentionPoint, "bandwidth": BandwidthPoint}


def run_probes(probes, device, timer, facts: dict, deadline_s: float = DEADLINE_S,
               progress=None, clock=time.monotonic) -> Calibration:
    """Time every probe on `device` with `timer(fn) -> seconds per call` (`timer(fn,
    eager=True)` for the probes to time as eager calls: cuda_timer) and return the Calibration.
    `facts`: the device's description (cuda_facts): "name", "torch" and the rest go to the file.
    A probe that fails (a backend this GPU lacks, out of memory) is listed in the file, not
    fatal; probes not started by `deadline_s` are skipped and counted."""
    device = torch.device(device)
    began = clock()
    found: dict = {"gemm": [], "attention": [], "bandwidth": []}
    launch: dict = {}
    skipped = 0
    failed: list = []
    for i, probe in enumerate(probes):
        if clock() - began > deadline_s:
            skipped = len(probes) - i
            break
        if progress is not None:
            progress(f"{i + 1} of {len(probes)}: {probe.label}")
        try:
            fn = probe.build(device)
            seconds = timer(fn, eager=True) if probe.eager else timer(fn)
        except RuntimeError as e:   # a backend this GPU or build lacks ("No available kernel")
            failed.append(f"{probe.label}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        finally:
            fn = None
        if probe.kind in _POINTS:
            found[probe.kind].append(_POINTS[probe.kind](**probe.shape, seconds=seconds))
        else:
            launch[probe.kind] = seconds
    missing = {"kernel_overhead", "host_op"} - set(launch)
    if missing:
        raise TapescopeError(f"calibration stopped before it measured {', '.join(sorted(missing))}"
                             f" (deadline {deadline_s:g} s): give it more time")
    extra = {k: v for k, v in facts.items() if k not in ("name", "torch")}
    extra.update(seconds=round(clock() - began, 3), probes=len(probes), skipped=skipped,
                 failed=failed)
    return Calibration(
        gpu_name=facts["name"], torch=facts.get("torch", torch.__version__),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        kernel_overhead_s=launch["kernel_overhead"], host_op_s=launch["host_op"],
        gemm=tuple(found["gemm"]), attention=tuple(found["attention"]),
        bandwidth=tuple(found["bandwidth"]), device=extra)


def require_gpu() -> torch.device:
    """The GPU to measure, or the one-line refusal when torch sees none."""
    if not torch.cuda.is_available():
        build = "a CUDA build" if torch.backends.cuda.is_built() else "a CPU-only build"
        raise TapescopeError(
            f"tapescope calibrate measures a GPU, and torch sees none here "
            f"(torch.cuda.is_available() is False; torch {torch.__version__}, {build}): run it "
            "on a machine with the GPU, then give its file to --calibration (or "
            "TAPESCOPE_CALIBRATION) on any machine")
    return torch.device("cuda", torch.cuda.current_device())


# nvidia-smi's names for what the file records about the board (clocks in MHz, power in W)
_SMI_FIELDS = {"driver": "driver_version", "sm_clock_max_mhz": "clocks.max.sm",
               "memory_clock_max_mhz": "clocks.max.memory", "sm_clock_mhz": "clocks.sm",
               "power_limit_w": "power.limit", "power_max_w": "power.max_limit",
               "temperature_c": "temperature.gpu"}


def cuda_facts(device: torch.device) -> dict:
    """The GPU as torch and the driver describe it: name, SMs, memory, CUDA and driver versions,
    clocks and power limit (nvidia-smi; left out where it is not installed)."""
    props = torch.cuda.get_device_properties(device)
    facts = {"name": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
             "sms": props.multi_processor_count, "memory_bytes": props.total_memory,
             "compute_capability": f"{props.major}.{props.minor}",
             "gpus": torch.cuda.device_count()}
    try:
        row = subprocess.run(
            ["nvidia-smi", f"--id={device.index or 0}", "--format=csv,noheader,nounits",
             "--query-gpu=" + ",".join(_SMI_FIELDS.values())],
            capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        for name, value in zip(_SMI_FIELDS, row.split(",")):
            value = value.strip()
            try:
                facts[name] = float(value) if name != "driver" else value
            except ValueError:
                facts[name] = value        # "[N/A]" where the board does not say
    except (OSError, subprocess.SubprocessError):
        facts["nvidia_smi"] = "not available"
    return facts
