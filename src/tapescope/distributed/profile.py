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

import torch

from ..capture.session import capture
from ..errors import TapescopeError
from ..options import Options, Workload
from .categories import assign_roles
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


@dataclass
class DistributedFacts:
    """What a distributed profile knows beyond one rank's trace."""

    mesh: MeshSpec
    classes: RankClasses
    groups: dict                            # group name -> GroupInfo (of the reported rank)
    profiles: dict = field(default_factory=dict, repr=False)   # traced rank -> Profile
    trace_seconds: dict = field(default_factory=dict)     # traced rank -> seconds to trace it
    trace_cpu_seconds: dict = field(default_factory=dict)  # ... this process's CPU time
    pipeline: object = None    # distributed.pipeline.PipelineReport of a pipelined profile

    def to_dict(self) -> dict:
        return {"mesh": self.mesh.as_dict(), "world_size": self.mesh.world_size,
                "rank_classes": [list(m) for m in self.classes.members],
                "classes_provable": self.classes.provable,
                "traced_ranks": sorted(self.profiles), "trace_seconds": self.trace_seconds,
                "trace_cpu_seconds": self.trace_cpu_seconds,
                "pipeline": None if self.pipeline is None else self.pipeline.to_dict()}


def profile_ranks(workload: Workload, options: Options, analyse, progress=None):
    """Trace one rank of each class; returns (the Profile of the rank with the highest peak,
    every rank's RankProfile, DistributedFacts). `analyse(trace, facts) -> Profile`."""
    from ..capture.model import built_for

    spec = options.mesh
    # built once: every rank copies the same meta model
    workload = replace(workload, model=built_for(workload.model, options))
    pipelined = pipeline_plan(workload, options) if options.pipeline is not None else None
    measured: list = []

    def parallelize(module, rank, device_mesh):
        if options.parallelize is None:
            return module
        try:
            out = options.parallelize(module, device_mesh)
        except TapescopeError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's parallelisation failed
            raise _parallelize_failed(e, options.parallelize, rank) from e
        if out is None:
            out = module  # parallelised in place
        if not isinstance(out, torch.nn.Module):
            fn = getattr(options.parallelize, "__name__", "parallelize")
            raise TapescopeError(
                f"{fn}(model, mesh) returned {type(out).__name__} {_short_repr(out)}; return "
                "the parallelised model (an nn.Module) or None when it changes the model in "
                "place")
        _refuse_ddp(out)
        return out

    def trace_rank(rank: int, shortened: bool = True):
        seen: dict = {}
        program = None

        def prepare(fmodel):
            if pipelined is None:
                out = parallelize(fmodel, rank, device_mesh)
            else:  # this rank's stages, each parallelised over the other dimensions
                if options.parallelize is not None and not measured:
                    # the shapes between stages are the parallelised stages' (found once)
                    pipelined.measure_parallelised(lambda m: parallelize(m, rank, device_mesh),
                                                   options.device)
                    measured.append(True)
                program.shapes = pipelined.shapes
                out = pipelined.stage_modules(fmodel, program.stages,
                                               lambda m: parallelize(m, rank, device_mesh))
            seen["layouts"] = shard_layouts(out, spec)
            seen["sharded"] = _sharded_names(out)
            return out

        standin = nullcontext()
        if options.device.type == "cuda":
            from .cuda_standin import cuda_without_gpu

            standin = cuda_without_gpu(options.gpu.compute_capability)
        with standin as streams, eager_distributed(decisions), \
                fake_world(spec, rank, options.device.type) as device_mesh:
            if pipelined is not None:
                program = pipelined.program(rank, device_mesh, options.loss_fn,
                                            options.optimizer, until_repeat=shortened)
            # (capture retries a step whose sizes depend on data - an MoE's routing - with
            # values, as for one device; the fake world stays up for the retry)
            trace, facts = capture(workload, options, progress, prepare=prepare, streams=streams,
                                   program=program)
            if program is not None:
                seen["order"] = program.order
            groups = process_groups(spec)
            facts["collective_groups"] = collective_groups(trace)
        facts["process_groups"] = {name: {"label": g.label, "dims": list(g.dims), "size": g.size,
                                          "ranks": list(g.ranks)} for name, g in groups.items()}
        sharded = {sid for sid, fqn in trace.storage_owner.items() if fqn in seen["sharded"]}
        assign_roles(trace, sharded)
        if program is not None and program.traced < program.microbatches:
            why = extend_traced_steps(program, trace, spec.coordinate(rank)["pp"])
            if why is not None:  # not proven: every micro-batch traced, and said
                note = (f"rank {rank}: tracing all {program.microbatches} micro-batches (the "
                        f"steady state over {program.traced} could not be proven to repeat: "
                        f"{why})")
                warnings.warn(note, stacklevel=2)
                if progress is not None:
                    progress(note)
                analysed, layouts, groups_ = trace_rank(rank, shortened=False)
                analysed.facts["pipeline_traced_microbatches"] = None
                analysed.facts["pipeline_not_repeated"] = why
                return analysed, layouts, groups_
        if program is not None:
            facts["pipeline_traced_microbatches"] = program.traced
        facts["mesh"] = spec.as_dict()
        facts["rank"] = rank
        facts["parallelize"] = None if options.parallelize is None else \
            getattr(options.parallelize, "__name__", str(options.parallelize))
        # the preset's FSDP2 MixedPrecisionPolicy stands in for --amp: the header says so
        facts["fsdp_param_dtype"] = getattr(options.parallelize, "param_dtype", None)
        if pipelined is not None:  # a rank holds its stages: the header also names the model's
            facts["model_parameters"] = pipelined.model_parameters
        orders[rank] = seen.get("order")
        return analyse(trace, facts), seen["layouts"], groups

    # (what each trace makes is frozen before the next; all of it released on return; DTensor's
    # sharding decisions are the same for every rank, made once: fidelity.py, point 4)
    with _collector_kept_to_each_rank() as rank_starts, decisions_shared_by_ranks() as decisions:
        seconds, cpu = {}, {}
        profiles, group_maps, orders = {}, {}, {}

        def trace_timed(rank: int):
            start, start_cpu = time.perf_counter(), time.process_time()
            rank_starts()
            profiles[rank], layouts, group_maps[rank] = trace_rank(rank)
            seconds[rank], cpu[rank] = time.perf_counter() - start, time.process_time() - start_cpu
            return layouts

        if pipelined is None:
            classes = rank_classes(spec, trace_timed(0))
        else:
            # the stages differ in their modules, so each pipeline rank's step is its own: one
            # trace per pipeline coordinate, and the classes of the other dimensions within it
            classes = pipelined.classes(spec, trace_timed)
        if not classes.provable and spec.world_size > 1:
            # said before the long part starts, with what it will cost
            note = (f"cannot prove which ranks run the same step (a parameter's device mesh has no "
                    f"layout over the world's ranks: torch older than 2.9, or a mesh that leaves "
                    f"ranks out): tracing each of the {spec.world_size} ranks, about "
                    f"{seconds[0] * (spec.world_size - 1):.0f} s more (rank 0 took "
                    f"{seconds[0]:.1f} s)")
            warnings.warn(note, stacklevel=2)
            if progress is not None:
                progress(note)
        for rep in classes.representatives:
            if rep not in profiles:
                trace_timed(rep)

        ranks = []
        for rep, members in zip(classes.representatives, classes.members):
            p = profiles[rep]
            p.distributed = DistributedFacts(spec, classes, group_maps[rep], {})  # its collectives
            at_peak = {k: v for k, v in p.memory.at_peak.items() if v}
            t = p.time
            for r in members:
                ranks.append(RankProfile(r, spec.coordinate(r), p.peak_bytes,
                                         p.first_step_peak_bytes, at_peak, rep,
                                         None if t is None else t.seconds,
                                         None if t is None else t.mfu,
                                         None if pipelined is None else pipelined.stages_of(r)))
        ranks.sort(key=lambda r: r.rank)
        top = max(profiles, key=lambda r: (profiles[r].peak_bytes, -r))
        facts = DistributedFacts(spec, classes, group_maps[top], profiles, seconds, cpu)
        if pipelined is not None:
            facts.pipeline = pipelined.report(ranks, profiles, orders)
        return profiles[top], ranks, facts


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


def _sharded_names(model) -> set:
    """Names of the parameters that are shards (a DTensor sharded on some mesh dimension)."""
    from torch.distributed.tensor import DTensor, Replicate

    return {fqn for fqn, p in model.named_parameters(remove_duplicate=False)
            if isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)}


def _short_repr(x, limit: int = 40) -> str:
    """What a value is, in a few words: a tuple by its members' types, else its repr cut short."""
    if isinstance(x, (tuple, list)):
        return f"of {len(x)} ({', '.join(type(v).__name__ for v in x[:4])}" \
            f"{', ...' if len(x) > 4 else ''})"
    r = " ".join(repr(x).split())
    return r if len(r) <= limit else r[:limit - 3] + "..."
