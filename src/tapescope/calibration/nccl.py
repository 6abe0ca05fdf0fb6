"""Collectives over this machine's GPUs, timed as nccl-tests times them.

One process per GPU (torch.multiprocessing.spawn), a process group over them (NCCL on GPUs; the
tests run the same code with gloo on the CPU), then for each collective and size: warm-up calls,
a barrier, back-to-back calls timed on rank 0 (CUDA events on a GPU, the wall clock otherwise).
The size is nccl-tests' (the whole tensor of an all-reduce, the gathered output of an all-gather,
the input of a reduce-scatter) and so is the bus bandwidth: size / time x 2(n-1)/n for an
all-reduce, x (n-1)/n for the others (nccl-tests doc/PERFORMANCE.md).

torch.distributed's own launcher is used rather than nccl-tests: it is what the user's training
runs, needs nothing installed, and NCCL chooses the same algorithms for it.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist

from ..devices.calibration import NcclPoint

__all__ = ["measure_collectives", "bus_factor", "DEFAULT_NCCL_BYTES", "COLLECTIVES"]

DEFAULT_NCCL_BYTES = tuple(1 << p for p in range(20, 31, 2))    # 1 MiB .. 1 GiB
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth."""
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(collective: str, big: torch.Tensor, small: torch.Tensor):
    if collective == "all_reduce":
        return lambda: dist.all_reduce(big)
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(big, small)
    return lambda: dist.reduce_scatter_tensor(small, big)


def _time(fn, device, iters: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) / iters


def _worker(rank: int, world: int, port: int, backend: str, sizes, collectives, iters: int,
            out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows = []
    try:
        for collective in collectives:
            for size in sizes:
                numel = max(world, size // 4 // world * world)   # divisible by the ranks
                big = torch.ones(numel, device=device)
                small = torch.ones(numel // world, device=device)
                fn = _call(collective, big, small)
                for _ in range(2):
                    fn()
                dist.barrier()
                seconds = _time(fn, device, iters)
                nbytes = numel * 4
                rows.append(dict(collective=collective, ranks=world, bytes=nbytes,
                                 seconds=seconds,
                                 bus_bandwidth=nbytes / seconds * bus_factor(collective, world)))
                del big, small, fn
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, backend: str = "nccl", sizes=DEFAULT_NCCL_BYTES,
                        collectives=COLLECTIVES, iters: int = 20) -> tuple:
    """NcclPoints of each collective and size over `world` processes (one per GPU for NCCL)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        torch.multiprocessing.spawn(_worker, nprocs=world, args=(
            world, _free_port(), backend, tuple(sizes), tuple(collectives), iters, out))
        with open(out) as f:
            rows = json.load(f)
    return tuple(NcclPoint(**r) for r in rows)
