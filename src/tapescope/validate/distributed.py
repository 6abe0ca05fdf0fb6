"""Run a parallelised training step for real, one process per rank, and read each rank's allocator.

The ground truth for distributed profiles on a machine without GPUs: `torch.multiprocessing` starts
one process per rank, the gloo backend connects them, and each process builds the model on the CPU,
applies the user's own `parallelize(model, mesh)` to it (FSDP2, tensor parallel, DDP ...) and runs
the very step tapescope traces (`capture.step.train_step`) under `torch.profiler` with
`profile_memory=True`. Each rank's peak live bytes are read from its allocator's own running total,
exactly as the single-process truth (`validate.real`) reads them.

Everything a rank allocates for the step is created inside the profiler, so live bytes are the
allocator's total less its value before the first allocation. The functions passed in (model
builder, parallelize, loss) must be importable by name: the workers are spawned processes.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from dataclasses import dataclass, field

import torch

__all__ = ["RealRank", "RealJob", "run_real_distributed", "run_real_jobs"]


@dataclass
class RealRank:
    """One rank of a real run.

    peaks: step -> the peak of the bytes the program's own thread allocated (its tensors).
    allocator_peaks: step -> the allocator's peak, which also counts the staging buffers the
        communication backend's threads allocate while collectives run (gloo copies an all-gather
        into a buffer of its own); when those overlap the program's peak varies from run to run.
    late_frees: step -> bytes of the program's tensors that a backend thread freed: gloo's work
        object holds a collective's tensors until its worker thread lets go of it, just after the
        wait returns; when the program dropped its own reference first, the free happens there,
        a moment later, with no profiler event (timed only where the allocator's total counts
        every thread: torch_compat.cpu_allocator_counts_every_thread, not on in these runs). A
        step with late frees can peak higher than the program alone would (a worker thread kept
        off the CPU until after the peak); a step without them is the program's peak.
    unstepped: how many of the rank's parameters the optimizer never updated (no state after the
        last step: no step gave them a gradient). A truth whose real run left parameters without
        gradients is no truth of a training step.
    ops: (step, phase, "aten::name") of each op the program dispatched, outermost only, in order
        (validate.real's RealStep.ops; validate.harness.same_ops compares a trace with them).
    """

    rank: int
    peaks: dict = field(default_factory=dict)
    allocator_peaks: dict = field(default_factory=dict)
    late_frees: dict = field(default_factory=dict)  # step -> bytes freed out of the program's sight
    unstepped: int = 0
    ops: list = field(default_factory=list)


@dataclass
class RealJob:
    """One parallelised step to run for real: the model builder, inputs, mesh and parallelize
    function (module-level functions: the workers are spawned processes that import them)."""

    build: object
    inputs: tuple = ()
    mesh: dict = field(default_factory=dict)
    parallelize: object = None
    input_kwargs: dict = field(default_factory=dict)
    loss_fn: object = None
    optimizer: object = "adamw"
    dtype: object = None
    steps: int = 2
    seed: int = 0
    pipeline: object = None   # a schedule name or dict, as profile(pipeline=...) takes it


def run_real_distributed(build, inputs=(), input_kwargs=None, *, mesh: dict, parallelize,
                         loss_fn=None, optimizer="adamw", dtype=None, steps: int = 2,
                         seed: int = 0, threads: int = 1, pipeline=None) -> list[RealRank]:
    """Run `steps` real steps on `prod(mesh.values())` CPU processes; each rank's peaks.

    build: a function that builds the model (called on the CPU in every rank, same seed).
    mesh: {"dp": 2, "tp": 2}, the device mesh's dimension names and sizes, outermost first.
    parallelize: `fn(model, mesh) -> model`, the user's torch.distributed code (None: a
        pipelined job's stages alone).
    pipeline: as `tapescope.profile(pipeline=...)`: each rank builds its stages with the same
        split and runs the same schedule (distributed/pipeline.py's PipelineStep), over gloo.
    threads: intra-op threads per process (kernel choices do not depend on it for the ops whose
        memory tapescope models; fewer threads keep N processes from fighting over the cores).
    """
    job = RealJob(build, tuple(inputs), dict(mesh), parallelize, input_kwargs or {}, loss_fn,
                  optimizer, dtype, steps, seed, pipeline)
    return run_real_jobs([job], threads=threads)[0]


def run_real_jobs(jobs: list, threads: int = 1) -> list[list[RealRank]]:
    """Run several RealJobs on one world of processes (they must have the same world size:
    starting the processes costs more than a small step). Returns, per job, each rank's
    RealRank."""
    import torch.multiprocessing as mp

    worlds = {_world_size(j.mesh) for j in jobs}
    if len(worlds) != 1:
        raise ValueError(f"jobs of one run need one world size, got {sorted(worlds)}")
    world = worlds.pop()
    with tempfile.TemporaryDirectory(prefix="tapescope-dist-") as tmp:
        mp.start_processes(_worker, args=(world, tmp, list(jobs), threads), nprocs=world,
                           join=True, start_method="spawn")
        out = []
        for j in range(len(jobs)):
            ranks = []
            for rank in range(world):
                with open(os.path.join(tmp, f"job{j}-rank{rank}.json")) as f:
                    d = json.load(f)
                ranks.append(RealRank(rank, _steps(d["peaks"]), _steps(d["allocator_peaks"]),
                                      _steps(d["late_frees"]), d["unstepped"],
                                      [tuple(op) for op in d["ops"]]))
            out.append(ranks)
    return out


def _world_size(mesh: dict) -> int:
    n = 1
    for s in mesh.values():
        n *= s
    return n


def _steps(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def _worker(rank: int, world: int, tmp: str, jobs: list, threads: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        for j, job in enumerate(jobs):
            result = _run_job(job)
            with open(os.path.join(tmp, f"job{j}-rank{rank}.json"), "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _run_job(job: RealJob) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..capture.model import real_inputs, resolve_dtype
    from ..capture.optimizers import make_optimizer
    from ..capture.program import StepRuntime
    from ..capture.step import train_step
    from .real import _read_allocations

    mesh = init_device_mesh("cpu", tuple(job.mesh.values()), mesh_dim_names=tuple(job.mesh))
    device, dtype = torch.device("cpu"), resolve_dtype(job.dtype)
    plan = None
    if job.pipeline is not None:
        plan = _pipeline_plan(job)
        if job.parallelize is not None:
            plan.shapes = _parallelised_shapes(job, plan)
        # imported before the profiler starts, as a training script imports it: the module
        # makes a 4-byte tensor at import (microbatch.py's sum_reducer), which is no step's
        from torch.distributed import pipelining  # noqa: F401
    torch.manual_seed(job.seed)
    gen = torch.Generator().manual_seed(job.seed)
    # gloo's worker threads free a collective's tensors when the program has dropped them first,
    # a free c10 takes off its total only when told to count every thread
    # (torch_compat.cpu_allocator_counts_every_thread). Not turned on here: with it, a drop in the
    # total can be a block gloo made inside a functional collective as well as a program block of
    # the same size, and CI once read a TP rank 16,384 B below its own program that way
    # (tests/test_fit_layouts_checkpoint.py). A truth may read a delayed free late (above the
    # program's peak: the tests take the least of several runs), never early.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=True) as prof:
        with record_function("tapescope::step0"):
            with torch.device(device):
                model = job.build()
            if dtype is not None:
                model = model.to(dtype)
            args, kwargs = real_inputs((tuple(job.inputs), job.input_kwargs), device, dtype, gen)
            if plan is None:
                model = job.parallelize(model, mesh)
                opt = make_optimizer(job.optimizer, list(model.parameters()), device)
            else:  # the rank's stages, as tapescope's capture makes them (distributed/profile.py)
                rank = torch.distributed.get_rank()
                program = plan.program(rank, mesh, job.loss_fn, job.optimizer)
                model = plan.stage_modules(model, program.stages, lambda m: m if job.parallelize
                                           is None else job.parallelize(m, mesh))
                state = program.setup(model, list(model.parameters()), device)
            # the tensors parallelize replaced can sit in reference cycles until the collector
            # runs, which in a real job happens long before the steady state (tapescope
            # collects at the same point)
            gc.collect()

        def phase(step, name):
            return record_function(f"tapescope::phase::{name}")

        for s in range(1, job.steps + 1):
            with record_function(f"tapescope::step{s}"):
                if plan is None:
                    train_step(model, args, kwargs, job.loss_fn, opt, step=s, phase=phase)
                else:
                    program.run(model, args, kwargs, state, s, StepRuntime(phase=phase))
    own = _read_allocations(prof, device, program_only=True)
    allocator = _read_allocations(prof, device)
    optimizer = opt if plan is None else state[1]
    unstepped = sum(1 for group in optimizer.param_groups for p in group["params"]
                    if not optimizer.state.get(p))
    return {"peaks": own.peaks, "allocator_peaks": allocator.peaks,
            "late_frees": own.late_frees, "unstepped": unstepped, "ops": own.ops}


def _parallelised_shapes(job: RealJob, plan) -> list:
    """The stages' StageShapes with each stage parallelised (under sequence parallelism a stage
    sends its share of the sequence): every rank runs every stage's forward once, on real
    tensors, before the profiler starts, so a tensor-parallel group's collectives pair up. What
    tapescope measures on fake tensors (PipelinePlan.measure_parallelised), found here by
    running the real parallelised stages. On a mesh of its own: the job's mesh makes its
    sub-meshes (and their rank maps) inside step 0, as the traced rank does."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..capture.model import real_inputs, resolve_dtype
    from ..distributed.pipeline import stage_boundaries

    dtype = resolve_dtype(job.dtype)

    def build():
        model = job.build()
        return model if dtype is None else model.to(dtype)

    mesh = init_device_mesh("cpu", tuple(job.mesh.values()), mesh_dim_names=tuple(job.mesh))
    gen = torch.Generator().manual_seed(job.seed)
    inputs = real_inputs(tuple(job.inputs), torch.device("cpu"), dtype, gen)[:-1]
    shapes = stage_boundaries(build, inputs, plan.spec, plan.pp, plan.microbatches, plan.split,
                              lambda m: job.parallelize(m, mesh))
    del inputs
    gc.collect()
    return shapes


def _pipeline_plan(job: RealJob):
    """The PipelinePlan tapescope's profile of this job makes (the same split and shapes)."""
    from ..capture.model import build_on_meta
    from ..distributed.pipeline import pipeline_plan
    from ..options import Options, Workload

    options = Options.create(loss_fn=job.loss_fn, optimizer=job.optimizer, dtype=job.dtype,
                             mesh=job.mesh, parallelize=job.parallelize, pipeline=job.pipeline)
    return pipeline_plan(Workload(build_on_meta(job.build), tuple(job.inputs), {}), options)
