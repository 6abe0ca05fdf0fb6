"""Profile every rank of a parallelised training step in one process, on fake tensors.

For each simulated rank: a fake process group makes this process that rank of a world of
`prod(mesh)` ranks, `init_device_mesh` builds the mesh, and the user's own `parallelize(model,
mesh)` runs on tapescope's fake copy of the model (recorded as step 0, setup). The training steps
are then traced exactly as for one device: FSDP2's hooks all-gather and reduce-scatter through the
fake group (the collectives are recorded as ops, with their buffers), DTensor runs each op on the
local shards, and tapescope's own autograd engine runs the backward (it answers FSDP2's
queue_callback and graph-task queries, capture/graph_task.py). Ranks whose shards have the same
shapes are traced once (ranks.py).

device="cuda" on a machine without a GPU: DeviceMesh needs no GPU with the fake backend (torch
skips device setup for it), and FSDP2's streams, events and current_device are answered by
cuda_standin.py.
"""

from __future__ import annotations

import gc
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..capture.session import capture
from ..errors import TapescopeError
from ..options import Options, Workload
from .fidelity import decisions_shared_by_ranks, eager_distributed
from .groups import collective_groups, process_groups
from .mesh import MeshSpec, fake_world
from .pipeline import extend_traced_steps, pipeline_plan
from .ranks import RankClasses, rank_classes, shard_layouts

__all__ = ["RankProfile", "DistributedFacts", "profile_ranks"]


@dataclass(frozen=True)
class RankProfile:
    """One rank's memory: its peak (steady state) and first-step peak, and the categories at the
    peak. `traced_as` is the rank whose trace stands for this one (itself if it was traced)."""

    rank: int
    coordinate: dict
    peak_bytes: int
    first_step_peak_bytes: int
    at_peak: dict
    traced_as: int
    step_seconds: float | None = None   # on the profiled GPU (device cuda), with its collectives
    mfu: float | None = None
    stages: tuple | None = None         # the pipeline stages it holds (pipelined profiles)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "coordinate": self.coordinate, "peak_bytes": self.peak_bytes,
                "first_step_peak_bytes": self.first_step_peak_bytes, "at_peak": self.at_peak,
                "traced_as": self.traced_as, "step_seconds": self.step_seconds, "mfu": self.mfu,
                "stages": None if self.stages is None else list(self.stages)}


@dataclass(frozen=True)
class DistributedFacts:
    """What a distributed profile knows beyond one rank's trace: the rank's place in the job
    (built as its capture ends), and for the Profile the job returns, the whole job (its rank
    classes, every traced rank's Profile, their tracing times; `with_job`)."""

    mesh: MeshSpec
    rank: int
    groups: dict               # group name -> GroupInfo: every process group this rank is in
    collective_groups: dict    # op index -> the name of the group each collective ran on
    parallelize: str | None    # the name of the user's parallelize function
    # the dtype FSDP2's MixedPrecisionPolicy computes in, as the preset says (it stands in for
    # --amp: the report's header says so); None without a preset that says
    fsdp_param_dtype: object = None
    model_parameters: int | None = None   # a pipelined rank: the whole model's (its stages hold part)
    # a pipelined rank: the micro-batches traced before the schedule was proven to repeat (None:
    # every one traced), and why a shortened trace was not proven
    pipeline_traced_microbatches: int | None = None
    pipeline_not_repeated: str | None = None
    classes: RankClasses | None = None    # the job's
    profiles: dict = field(default_factory=dict, repr=False)   # traced rank -> Profile
    trace_seconds: dict = field(default_factory=dict)     # traced rank -> seconds to trace it
    trace_cpu_seconds: dict = field(default_factory=dict)  # ... this process's CPU time
    pipeline: object = None    # distributed.pipeline.PipelineReport of a pipelined profile

    def as_facts(self) -> dict:
        """The rank's facts by name, as `Profile.facts` has them."""
        out = {"collective_groups": self.collective_groups,
               "process_groups": {name: {"label": g.label, "dims": list(g.dims), "size": g.size,
                                         "ranks": list(g.ranks)}
                                  for name, g in self.groups.items()},
               "mesh": self.mesh.as_dict(), "rank": self.rank, "parallelize": self.parallelize,
               "fsdp_param_dtype": self.fsdp_param_dtype}
        if self.model_parameters is not None:
            out["model_parameters"] = self.model_parameters
            out["pipeline_traced_microbatches"] = self.pipeline_traced_microbatches
            if self.pipeline_not_repeated is not None:
                out["pipeline_not_repeated"] = self.pipeline_not_repeated
        return out

    def to_dict(self) -> dict:
        return {"mesh": self.mesh.as_dict(), "world_size": self.mesh.world_size,
                "rank_classes": [list(m) for m in self.classes.members],
                "classes_provable": self.classes.provable,
                "traced_ranks": sorted(self.profiles), "trace_seconds": self.trace_seconds,
                "trace_cpu_seconds": self.trace_cpu_seconds,
                "pipeline": None if self.pipeline is None else self.pipeline.to_dict()}


def profile_ranks(workload: Workload, options: Options, analyse, progress=None):
    """Trace one rank of each class; returns (the Profile of the rank with the highest peak,
    every rank's RankProfile, the job's DistributedFacts).
    `analyse(trace, run_facts, distributed_facts) -> Profile`.

    The phases: build the model once (every rank copies the same meta model), trace rank 0 (or
    one rank per pipeline coordinate) to learn the rank classes, trace each class's
    representative, then spread each representative's memory and time to its members."""
    from ..capture.model import built_for

    workload = replace(workload, model=built_for(workload.model, options))
    job = _RankJob(workload, options, analyse, progress)
    # (what each trace makes is frozen before the next; all of it released on return; DTensor's
    # sharding decisions are the same for every rank, made once: fidelity.py, point 4)
    with _collector_kept_to_each_rank() as rank_starts, decisions_shared_by_ranks() as decisions:
        job.rank_starts, job.decisions = rank_starts, decisions
        classes = job.rank_classes()
        for rep in classes.representatives:
            if rep not in job.profiles:
                job.trace_timed(rep)
        return job.result(classes)


@dataclass
class _RankJob:
    """The ranks of one distributed profile as they are traced: what each traced rank gave
    (its Profile, process groups, pipeline order, trace times), filled by `trace_timed`."""

    workload: Workload
    options: Options
    analyse: Callable                   # analyse(trace, run_facts, distributed_facts) -> Profile
    progress: Callable | None = None
    pipelined: object = None            # distributed.pipeline.PipelinePlan of a pipelined step
    rank_starts: Callable | None = None  # _collector_kept_to_each_rank's, set while tracing
    decisions: object = None            # decisions_shared_by_ranks's, likewise
    measured: bool = False              # a pipeline's stage shapes found (once, on one rank)
    profiles: dict = field(default_factory=dict)     # traced rank -> Profile
    orders: dict = field(default_factory=dict)       # traced rank -> its pipeline order
    seconds: dict = field(default_factory=dict)
    cpu: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.options.pipeline is not None:
            self.pipelined = pipeline_plan(self.workload, self.options)

    @property
    def spec(self) -> MeshSpec:
        return self.options.mesh

    def rank_classes(self) -> RankClasses:
        """The rank classes, from the first rank's trace (a pipeline's: one trace per pipeline
        coordinate, as its stages differ in their modules, and the classes of the other
        dimensions within it); warns first when they cannot be proven."""
        if self.pipelined is None:
            classes = rank_classes(self.spec, self.trace_timed(0))
        else:
            classes = self.pipelined.classes(self.spec, self.trace_timed)
        if not classes.provable and self.spec.world_size > 1:
            self._warn_every_rank_traced()
        return classes

    def _warn_every_rank_traced(self) -> None:
        """Said before the long part starts, with what it will cost."""
        n, first = self.spec.world_size, self.seconds[0]
        note = (f"cannot prove which ranks run the same step (a parameter's device mesh has no "
                f"layout over the world's ranks: torch older than 2.9, or a mesh that leaves "
                f"ranks out): tracing each of the {n} ranks, about "
                f"{first * (n - 1):.0f} s more (rank 0 took {first:.1f} s)")
        warnings.warn(note, stacklevel=4)
        if self.progress is not None:
            self.progress(note)

    def trace_timed(self, rank: int):
        """Trace `rank`, keeping its Profile and times; returns its parameters' shard layouts."""
        start, start_cpu = time.perf_counter(), time.process_time()
        self.rank_starts()
        self.profiles[rank], layouts = self.trace_rank(rank)
        self.seconds[rank] = time.perf_counter() - start
        self.cpu[rank] = time.process_time() - start_cpu
        return layouts

    def trace_rank(self, rank: int, shortened: bool = True):
        """One rank's step in its fake world: (its Profile, its shard layouts). A pipelined
        rank's micro-batches are traced until they repeat (`shortened`), the rest counted."""
        options, spec = self.options, self.spec
        seen: dict = {}
        program = None
        standin = nullcontext()
        if options.device.type == "cuda":
            from .cuda_standin import cuda_without_gpu

            standin = cuda_without_gpu(options.gpu.compute_capability)
        with standin as streams, eager_distributed(self.decisions), \
                fake_world(spec, rank, options.device.type) as device_mesh:
            if self.pipelined is not None:
                program = self.pipelined.program(rank, device_mesh, options.loss_fn,
                                                 options.optimizer, until_repeat=shortened)

            def prepare(fmodel):
                return self.prepare(fmodel, rank, device_mesh, program, seen)

            # (capture retries a step whose sizes depend on data - an MoE's routing - with
            # values, as for one device; the fake world stays up for the retry)
            trace, facts = capture(self.workload, options, self.progress, prepare=prepare,
                                   streams=streams, program=program)
            if program is not None:
                seen["order"] = program.order
            groups = process_groups(spec)
            by_op = collective_groups(trace)
        self.orders[rank] = seen.get("order")
        place = self._place(rank, groups, by_op)
        if program is not None and program.traced < program.microbatches:
            why = extend_traced_steps(program, trace, spec.coordinate(rank)["pp"])
            if why is not None:  # not proven: every micro-batch traced, and said
                note = (f"rank {rank}: tracing all {program.microbatches} micro-batches (the "
                        f"steady state over {program.traced} could not be proven to repeat: "
                        f"{why})")
                warnings.warn(note, stacklevel=2)
                if self.progress is not None:
                    self.progress(note)
                analysed, layouts = self.trace_rank(rank, shortened=False)
                return replace(analysed, distributed=replace(
                    analysed.distributed, pipeline_traced_microbatches=None,
                    pipeline_not_repeated=why)), layouts
        if program is not None:
            place = replace(place, pipeline_traced_microbatches=program.traced)
        return self.analyse(trace, facts, place), seen["layouts"]

    def _place(self, rank: int, groups: dict, by_op: dict) -> DistributedFacts:
        """The rank's place in the job, as its report says it."""
        options = self.options
        return DistributedFacts(
            self.spec, rank, groups, by_op,
            parallelize=None if options.parallelize is None else
            getattr(options.parallelize, "__name__", str(options.parallelize)),
            # the preset's FSDP2 MixedPrecisionPolicy stands in for --amp: the header says so
            fsdp_param_dtype=getattr(options.parallelize, "param_dtype", None),
            # a rank holds its stages: the header also names the model's
            model_parameters=None if self.pipelined is None else
            self.pipelined.model_parameters)

    def prepare(self, fmodel, rank: int, device_mesh, program, seen: dict):
        """The rank's model as the user's parallelize makes it (a pipeline rank's: its stages,
        each parallelised over the other dimensions); notes its shard layouts in `seen`."""
        def parallelize(module):
            return _parallelized(module, self.options.parallelize, rank, device_mesh)

        if self.pipelined is None:
            out = parallelize(fmodel)
        else:
            if self.options.parallelize is not None and not self.measured:
                # the shapes between stages are the parallelised stages' (found once)
                self.pipelined.measure_parallelised(parallelize, self.options.device)
                self.measured = True
            program.shapes = self.pipelined.shapes
            out = self.pipelined.stage_modules(fmodel, program.stages, parallelize)
        seen["layouts"] = shard_layouts(out, self.spec)
        return out

    def result(self, classes: RankClasses):
        """(the highest-peak rank's Profile, every rank's RankProfile, DistributedFacts)."""
        spec, profiles = self.spec, self.profiles
        ranks = []
        for rep, members in zip(classes.representatives, classes.members):
            ranks += _member_profiles(profiles[rep], rep, members, spec, self.pipelined)
        ranks.sort(key=lambda r: r.rank)
        top = max(profiles, key=lambda r: (profiles[r].peak_bytes, -r))
        job = replace(profiles[top].distributed, classes=classes, profiles=profiles,
                      trace_seconds=self.seconds, trace_cpu_seconds=self.cpu,
                      pipeline=None if self.pipelined is None else
                      self.pipelined.report(ranks, profiles, self.orders))
        return profiles[top], ranks, job


def _member_profiles(p, rep: int, members, spec: MeshSpec, pipelined) -> list:
    """The RankProfile of each member of a class, from its representative's Profile `p`."""
    at_peak = {k: v for k, v in p.memory.at_peak.items() if v}
    t = p.time
    return [RankProfile(r, spec.coordinate(r), p.peak_bytes, p.first_step_peak_bytes, at_peak,
                        rep, None if t is None else t.seconds, None if t is None else t.mfu,
                        None if pipelined is None else pipelined.stages_of(r))
            for r in members]


def _parallelized(module, fn, rank: int, device_mesh):
    """The user's `fn(module, device_mesh)` on one simulated rank, checked: its failure named
    with the rank and the user's line, a non-module result or DDP refused."""
    if fn is None:
        return module
    try:
        out = fn(module, device_mesh)
    except TapescopeError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's parallelisation failed
        raise _parallelize_failed(e, fn, rank) from e
    if out is None:
        out = module  # parallelised in place
    if not isinstance(out, torch.nn.Module):
        name = getattr(fn, "__name__", "parallelize")
        raise TapescopeError(
            f"{name}(model, mesh) returned {type(out).__name__} {_short_repr(out)}; return "
            "the parallelised model (an nn.Module) or None when it changes the model in "
            "place")
    _refuse_ddp(out)
    return out


@contextmanager
def _collector_kept_to_each_rank():
    """Python's cyclic collector while the ranks are traced, kept to what each rank makes;
    yields `rank_starts()`, to call as a rank's trace begins.

    - What exists when a rank starts (torch's modules, the earlier ranks' traces: millions of
      objects, none garbage the rank's memory can depend on) is frozen out of the collector's
      reach (`gc.freeze`): the capture's own collection after prepare (FSDP2's cycles,
      collected so that their frees are recorded) walks only the rank's objects, and when a
      collection runs no longer depends on how much the earlier ranks left.
    - No automatic full collection (generation 2) until the ranks are done: a rank's trace grows
      by a million records that are never garbage, and the collector's rule (a full collection
      once the long-lived objects grew by a quarter) walked them over and over, 0.2-0.6 s each
      time, 13.5 s of the 70B pipelined profile's 68 s. Young cycles are still collected
      (generations 0 and 1, as often as before); a cycle that lived through two young
      collections before becoming garbage stays alive to the rank's end (its memory counted,
      not dropped), where a full collection would have freed it at a moment no real run shares.
    Nothing is frozen when the caller froze objects of their own (unfreeze would release theirs
    too).
    """
    thresholds = gc.get_threshold()
    ours = not gc.get_freeze_count()
    gc.set_threshold(thresholds[0], thresholds[1], 2 ** 30)
    try:
        yield gc.freeze if ours else (lambda: None)
    finally:
        gc.set_threshold(*thresholds)
        if ours:
            gc.unfreeze()


_DDP_NOTE = (
    "torch.nn.parallel.DistributedDataParallel reduces gradients from C++ hooks that its reducer "
    "puts on the autograd engine's AccumulateGrad nodes, which tapescope's Python engine cannot "
    "call (and its constructor reads parameter values). Profile data parallelism with "
    "torch.distributed._composable.replicate_with_fsdp.replicate (FSDP2's DDP), --dp-replicate "
    "N, or FSDP2 (--fsdp N / --hsdp R).")


def _refuse_ddp(model) -> None:
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        raise TapescopeError(_DDP_NOTE)


def _parallelize_failed(e: Exception, fn, rank: int) -> TapescopeError:
    """The user's parallelize raised on a simulated rank: say where, and what to do."""
    import traceback

    from ..errors import user_frame_of
    from ..torch_compat import DataDependentOutputException

    frames = traceback.extract_tb(e.__traceback__)
    if any("nn/parallel/distributed.py" in f.filename for f in frames):
        return TapescopeError(_DDP_NOTE)
    # the one definition of "the user's frame" (errors.py: by the installed packages' folders,
    # not by a folder's name: a user's checkout under a folder called tapescope is the user's)
    user = user_frame_of(e)
    where = f" at {user}" if user else ""
    why = ""
    if isinstance(e, DataDependentOutputException):
        why = (" It runs on fake tensors (no data) with torch's fake process group, so code "
               "that reads tensor values cannot run there.")
    return TapescopeError(
        f"parallelize ({getattr(fn, '__name__', fn)}) failed on simulated rank {rank}{where}: "
        f"{type(e).__name__}: {e}.{why}")


def _short_repr(x, limit: int = 40) -> str:
    """What a value is, in a few words: a tuple by its members' types, else its repr cut short."""
    if isinstance(x, (tuple, list)):
        return f"of {len(x)} ({', '.join(type(v).__name__ for v in x[:4])}" \
            f"{', ...' if len(x) > 4 else ''})"
    r = " ".join(repr(x).split())
    return r if len(r) <= limit else r[:limit - 3] + "..."
