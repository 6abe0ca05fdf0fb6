"""One candidate, profiled: every rank class traced with the candidate's own flags, its memory on
the GPU (the caching allocator replayed per rank class), its step time and throughput.

This is what a worker process (or a Ray task) runs, so everything crossing it is picklable: the
model travels as its spec text (`Source`, resolved in the worker: a model-building lambda does not
pickle) and the answer is an `Outcome` of plain values. Nothing here is a formula of another
candidate: a candidate is only ever called fitting after its own trace.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ..errors import TapescopeError
from .space import CHECKPOINTING, Candidate

__all__ = ["Source", "RankMemory", "Outcome", "evaluate", "candidate_options"]

FITS, OOM, ERROR = "fits", "oom", "error"


@dataclass(frozen=True)
class Source:
    """The workload as the CLI names it: a spec (zoo:llama-70b, hf:..., file.py:fn) and the
    sizes and precision of the step."""

    spec: str
    seq: int | None = None
    gpu: str = "h100"
    amp: str | None = "bf16"
    dtype: str | None = None
    optimizer: str = "adamw"

    def workload(self, batch: int):
        from ..options import Workload
        from ..zoo import resolve

        m = resolve(self.spec, batch=batch, seq=self.seq, inputs=[])
        return Workload(m.build, tuple(m.inputs), dict(m.input_kwargs), m.name), m.loss_fn


@dataclass(frozen=True)
class RankMemory:
    """One rank class's memory on the GPU."""

    ranks: tuple              # the ranks of the class (first: the one traced)
    peak_bytes: int           # tensors alive at the steady step's peak
    reserved_bytes: int | None  # what nvidia-smi would show (None: out of memory)
    capacity: int
    oom_at: str | None = None   # the op (and phase) where the allocator ran out
    top_category: str | None = None  # the largest category at the peak

    @property
    def headroom(self) -> int | None:
        return None if self.reserved_bytes is None else self.capacity - self.reserved_bytes


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    status: str                          # FITS, OOM or ERROR
    ranks: tuple = ()                    # RankMemory per rank class
    step_seconds: float | None = None
    step_band: tuple | None = None       # (low, high) seconds, when the time model gives one
    tokens_per_second: float | None = None
    mfu: float | None = None
    exposed_comm_seconds: float | None = None
    bubble: float | None = None          # pipelined: the largest share of the schedule a rank waits
    reason: str = ""                     # why it does not fit / could not be profiled
    trace_seconds: float = 0.0
    cpu_seconds: float = 0.0             # the worker process's CPU time for this candidate (its
                                         # cost on a shared machine, where wall time is the load's)
    # what later candidates' lower bounds are made of (layout_search/bounds.py): per traced rank
    # class, the seconds of the compute stream's kernels in forward and backward (those the
    # step runs once and, apart, those activation checkpointing recomputes; the collectives;
    # FSDP2's own kernels among them; own and recomputed again without the waits for
    # collectives, 0 in a cache written before them: bounds.stream_floors); and the job's
    # matmul FLOPs over the step (all ranks; the same split). () where the step was not timed
    # from the kernel model (compiled, or priced by a calibration file)
    kernel_seconds: tuple = ()
    matmul_flops: tuple = ()
    cached: bool = field(default=False, compare=False)
    # per traced rank class, seconds the compute stream provably spends once per step outside
    # kernel_seconds' forward and backward: the optimizer's kernels and the waits for FSDP2's
    # first all-gather and last reduction (bounds.step_ends; () in a cache written before it)
    step_ends: tuple = ()
    # a pipelined step timed by its schedule: per pipeline rank (stage), the compute stream's
    # kernels alone in its first forward action, its last backward action (own, recomputed) and
    # all its actions (own, recomputed): bounds.action_floors, for bounds.pipeline_chain.
    # () otherwise, and in a cache written before them
    stage_seconds: tuple = ()
    # an unpipelined one-micro-batch step: per traced rank class, per transformer block (in the
    # model's order), the compute stream's kernels alone it runs for the block in forward and
    # backward (own, recomputed): bounds.block_floors, for bounds.twin_pipeline_chain. ()
    # otherwise, and in a cache written before them
    block_seconds: tuple = ()
    # an unpipelined one-micro-batch step: per traced rank class, the compute stream's kernels
    # alone it runs outside the blocks in forward and backward, by the pipeline stage that would
    # run them (bounds.edge_floors: the first stage's modules, the last stage's, the loss as a
    # pipeline's last stage computes it), for bounds.twin_pipeline_ends. () otherwise, and in a
    # cache written before them
    edge_seconds: tuple = ()
    # the same step: per traced rank class, its optimizer's compute-stream kernels alone and the
    # table of parameter shards they run over, by stage part (bounds.optimizer_floors), for
    # bounds.twin_pipeline_ends. () otherwise, and in a cache written before them
    optimizer_seconds: tuple = ()
    # an unpipelined step with FSDP2: (the GPU's key, per traced rank class (its rank, a
    # bounds.FsdpStretches or None: FSDP2's collectives' unpadded bytes and the kernels around
    # the waits they cause, for re-pricing on another split's groups: bounds.replicated_twin)).
    # () otherwise, and in a cache written before them
    fsdp_stretches: tuple = ()
    # an unpipelined step: per traced rank class, per transformer block (in the model's order)
    # and then the head after them (final norm, output layer, loss), the bytes of the storages
    # its first forward made that are still alive when the backward begins
    # (memory_floors.saved_block_bytes, for memory_floors.activations_in_flight). () otherwise,
    # and in a cache written before them
    saved_bytes: tuple = ()

    @property
    def fits(self) -> bool:
        return self.status == FITS

    @property
    def worst(self) -> RankMemory | None:
        """The rank class with the least headroom (or the one out of memory)."""
        if not self.ranks:
            return None
        return max(self.ranks, key=lambda r: (r.reserved_bytes is None, r.reserved_bytes or 0,
                                              r.peak_bytes))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["candidate"] = self.candidate.to_dict()
        d["label"] = self.candidate.label()
        for r in d["ranks"]:
            r["ranks"] = list(r["ranks"])
            r["headroom_bytes"] = None if r["reserved_bytes"] is None else \
                r["capacity"] - r["reserved_bytes"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Outcome":
        from ..distributed.presets import Layout

        c = dict(d["candidate"])
        layout = Layout(**{k: c.pop(k) for k in ("fsdp", "tp", "dp_replicate", "pp")},
                        cp=c.pop("cp", 1))
        ranks = tuple(RankMemory(**{**{k: v for k, v in r.items() if k != "headroom_bytes"},
                                    "ranks": tuple(r["ranks"])}) for r in d["ranks"])
        kept = {k: v for k, v in d.items() if k in cls.__dataclass_fields__
                and k not in ("candidate", "ranks", "cached", "step_band", "kernel_seconds",
                              "matmul_flops", "step_ends", "stage_seconds",
                              "block_seconds", "edge_seconds", "optimizer_seconds",
                              "fsdp_stretches", "saved_bytes")}
        band = tuple(d["step_band"]) if d.get("step_band") else None
        return cls(Candidate(layout, **c), ranks=ranks, step_band=band, cached=True,
                   kernel_seconds=tuple((*x, 0.0, 0.0, 0.0, 0.0, 0.0)[:7]
                                      for x in d.get("kernel_seconds", ())),
                   matmul_flops=tuple(d.get("matmul_flops", ())),
                   step_ends=tuple(d.get("step_ends", ())),
                   stage_seconds=tuple(tuple(x) for x in d.get("stage_seconds", ())),
                   block_seconds=tuple(tuple(tuple(b) for b in x)
                                       for x in d.get("block_seconds", ())),
                   edge_seconds=tuple(tuple(x) for x in d.get("edge_seconds", ())),
                   optimizer_seconds=tuple((x[0], tuple(tuple(e) for e in x[1]))
                                           for x in d.get("optimizer_seconds", ())),
                   fsdp_stretches=_stretches_from(d.get("fsdp_stretches", ())),
                   saved_bytes=tuple(tuple(x) for x in d.get("saved_bytes", ())), **kept)


def _stretches_from(d) -> tuple:
    """Outcome.fsdp_stretches from its JSON."""
    from .bounds import FsdpStretches

    if not d:
        return ()
    gpu, classes = d
    return (gpu, tuple((rank, FsdpStretches.from_dict(f) if f else None)
                       for rank, f in classes))


def _block_fqns(module) -> list[str]:
    from ..capture.model import transformer_blocks

    names = {id(m): n for n, m in module.named_modules()}
    return [names[id(b)] for b in transformer_blocks(module)]


def _parallelize(candidate: Candidate, mp_dtype):
    """parallelize(model, mesh) in torchtitan's order (models/llama3/parallelize.py): tensor
    parallelism, then the checkpointing mode on every block of what this rank holds, then FSDP
    (checkpointing first would hide the blocks' submodules from the TP plan's paths).
    tapescope's checkpointing option does not combine with a mesh: a distributed step
    checkpoints in its parallelize, as torchtitan's does."""
    from dataclasses import replace

    from ..checkpointing.policy import UnitPolicy, apply_policies
    from ..distributed.presets import preset_parallelize, tp_plan_for

    mode = CHECKPOINTING[candidate.checkpointing]
    layout = candidate.layout
    data = replace(layout, tp=1, pp=1)  # the preset's FSDP / replicate part alone
    preset = preset_parallelize(data, mp_dtype) if data.parallelised else None

    # the rank's transformer blocks as its copy of the model names them: what the outcome's
    # per-block figures are read by (bounds.block_floors), found here at no cost where a
    # second build of the model would cost ~10% of a 70B candidate
    blocks: list = []
    edges: list = []   # the first and the last stage's own modules (_edge_fqns)

    def parallelize(model, mesh):
        if layout.tp > 1:
            _, plan = tp_plan_for(model)
            plan(model, mesh["tp"])
        blocks[:] = _block_fqns(model)
        edges[:] = _edge_fqns(model, blocks)
        if mode is not None:
            how, save = mode
            apply_policies(model, [UnitPolicy(f, how, save) for f in blocks])
        return preset(model, mesh) if preset is not None else model

    parallelize.__name__ = candidate.label()
    parallelize.blocks = blocks
    parallelize.edges = edges
    parallelize.layout = layout  # a preset's: capture/float8.py asks whether FSDP shards
    if preset is not None and hasattr(preset, "train_context"):  # CP: presets.py
        parallelize.train_context = preset.train_context
    return parallelize


def candidate_options(source: Source, candidate: Candidate):
    """(Workload, Options) that profile `candidate` exactly as `profile` would with the flags
    of layout_search/config.py's command line."""
    from ..options import Options, resolve_dtype
    from ..values.mesh import mesh_spec

    layout = candidate.layout
    pipelined = layout.pp > 1
    # a pipeline splits the rank's batch into its micro-batches; otherwise one micro-batch is
    # traced per accumulation step
    workload, loss = source.workload(candidate.rank_batch if pipelined else candidate.micro_batch)
    sharded = layout.shard_degree > 1 or layout.dp_replicate > 1
    mp = resolve_dtype(source.amp) if sharded and source.amp else None
    single = layout.world_size == 1
    options = Options.create(
        loss_fn=loss, optimizer=None if source.optimizer == "none" else source.optimizer,
        device="cuda", gpu=source.gpu, dtype=source.dtype,
        amp=None if mp is not None else source.amp,
        accumulate=1 if pipelined else candidate.steps,
        mesh=None if single else mesh_spec(layout.mesh),
        parallelize=None if single else _parallelize(candidate, mp),
        pipeline={"schedule": candidate.schedule, "microbatches": candidate.steps}
        if pipelined else None,
        checkpointing=_single_device_policies(workload, candidate) if single else (),
        compile=True if candidate.compile else None, float8=candidate.float8)
    return workload, options


def _edge_fqns(module, blocks: list) -> tuple:
    """(first, last): the fqns of the modules a pipeline's default split puts on its first
    stage alone and on its last alone (distributed/pipeline.py's edge_modules); () where that
    split's blocks are not `blocks` (the per-block figures' own), or it finds none."""
    from ..distributed.pipeline import edge_modules

    try:
        split, first, last = edge_modules(module)
    except TapescopeError:
        return ()
    return (tuple(first), tuple(last)) if split == list(blocks) else ()


def _pipeline_loss_kernels(loss_fn, target):
    """A function of the logits (shape, dtype, device) -> the kernel-launching ops, as
    (name, inputs' and outputs' (shape, dtype), sorted), that a pipeline's last stage runs for
    its loss: distributed/pipeline.py's pipeline_loss of the same loss_fn, on fake tensors like
    the logits and one micro-batch of the target (bounds.edge_floors compares them with the
    loss ops of an unpipelined trace, which may come from other code: the model's own forward
    given its targets). Forward only: the same forward ops at the same shapes record the same
    autograd nodes, whose backward ops are then the same too."""
    from ..analysis.op_classes import launches_kernel
    from ..capture.records import op_name
    from ..distributed.pipeline import pipeline_loss
    from ..torch_compat import FakeTensorMode, TorchDispatchMode

    loss = pipeline_loss(loss_fn)
    # the workload's target: a tensor, or a capture.model.Spec (its shape and dtype)
    target_shape = tuple(target.shape) if hasattr(target, "shape") and \
        isinstance(getattr(target, "dtype", None), torch.dtype) else None

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made = _tensor_kinds(out)
            if launches_kernel(func) and made:   # (prim.device: no tensor, no kernel)
                self.ops.append((op_name(func), _tensor_kinds((args, kwargs)), made))
            return out

    def kernels(shape: tuple, dtype, device) -> list | None:
        if target_shape is None:
            return None
        try:
            with FakeTensorMode(), Kernels() as seen:
                logits = torch.empty(shape, dtype=dtype, device=device)
                tgt = torch.empty(target_shape, dtype=target.dtype, device=device)
                loss(logits, tgt)
        except Exception:  # noqa: BLE001 - a loss that does not run so: nothing is counted
            return None
        return sorted(seen.ops)

    return kernels


def _tensor_kinds(value) -> tuple:
    """(shape, dtype) of each tensor in `value` (nested), sorted."""
    from ..torch_compat import tree_leaves

    return tuple(sorted((tuple(int(d) for d in t.shape), str(t.dtype))
                        for t in tree_leaves(value) if isinstance(t, torch.Tensor)))


def _single_device_policies(workload, candidate):
    mode = CHECKPOINTING[candidate.checkpointing]
    if mode is None:
        return ()
    from ..capture.model import model_of
    from ..checkpointing.policy import UnitPolicy

    return tuple(UnitPolicy(f, mode[0], mode[1]) for f in _block_fqns(model_of(workload.model)))


def evaluate(source: Source, candidate: Candidate, global_tokens: int) -> Outcome:
    """Profile `candidate`; `global_tokens`: tokens of one optimizer step of the whole job."""
    from ..api import profile_workload
    from ..capture.model import model_of

    start, cpu = time.perf_counter(), time.process_time()
    try:
        workload, options = candidate_options(source, candidate)
        p = profile_workload(workload, options)
        # a pipeline's twin (bounds.twin_pipeline_chain) says what each block costs, and
        # (bounds.twin_pipeline_ends) what its first and last stage run besides
        blocks = edges = ()
        if candidate.layout.pp == 1 and candidate.steps == 1:
            if options.parallelize is not None:
                blocks, edges = options.parallelize.blocks, options.parallelize.edges
            else:
                model = model_of(workload.model)
                blocks = _block_fqns(model)
                edges = _edge_fqns(model, blocks)
        out = _outcome(p, candidate, global_tokens, source.amp or source.dtype, blocks,
                       (*edges, _pipeline_loss_kernels(options.loss_fn, workload.args[-1]))
                       if edges and workload.args else ())
        # what each block keeps for its backward (a pipeline's memory floor): the block names
        # a parallelize found cost nothing; a one-GPU candidate's were built above or not at all
        saved_by = blocks or (options.parallelize.blocks if candidate.layout.pp == 1 and
                              options.parallelize is not None else ())
        if saved_by:
            from .memory_floors import saved_block_bytes

            out = replace(out, saved_bytes=tuple(saved_block_bytes(q, saved_by)
                                                 for q in _traced(p)))
    except TapescopeError as e:
        out = Outcome(candidate, ERROR, reason=str(e).split("\n")[0])
    return Outcome(**{**{f: getattr(out, f) for f in out.__dataclass_fields__},
                      "trace_seconds": time.perf_counter() - start,
                      "cpu_seconds": time.process_time() - cpu})


def _rank_memory(q, ranks: tuple) -> RankMemory:
    cm = q.cuda_memory
    at_peak = q.memory.at_peak
    top = max(at_peak, key=at_peak.get) if at_peak else None
    return RankMemory(ranks, q.peak_bytes, None if cm.oom else cm.nvidia_smi, cm.capacity,
                      cm.oom_at if cm.oom else None, top)


def _outcome(p, candidate: Candidate, global_tokens: int, compute_dtype,
             blocks=(), edges=()) -> Outcome:
    dist = p.distributed
    if dist is None:
        ranks = (_rank_memory(p, (0,)),)
    else:
        ranks = tuple(_rank_memory(q, _class_of(r, dist.classes.members))
                      for r, q in sorted(dist.profiles.items()))
    kernels = _bound_figures(p, ranks, blocks, edges)
    oom = [r for r in ranks if r.reserved_bytes is None]
    if oom:
        r = oom[0]
        return Outcome(candidate, OOM, ranks, **kernels, reason=(
            f"rank {r.ranks[0]} (and {len(r.ranks) - 1} like it) runs out of "
            f"{_gib(r.capacity)} at {r.oom_at}; largest at its peak: {r.top_category}"))
    t = p.time
    pipelined = dist.pipeline if dist is not None else None
    # every traced rank's own step: the job's step waits for the slowest (its collectives hold
    # the others); a pipeline's is the schedule's, bubble included
    timed = [(len(r.ranks), q.time) for r, q in zip(ranks, _traced(p)) if q.time is not None]
    seconds = bubble = None
    if pipelined is not None and pipelined.time is not None:
        seconds = pipelined.time.seconds
        bubble = max(pipelined.time.bubble.values(), default=0.0)
    elif timed:
        seconds = max(rt.seconds for _, rt in timed)
    mfu = _mfu(p, ranks, seconds, compute_dtype)
    # the time model's error band (analysis.time_band.TimeBand: its mechanisms' uncertainty and
    # the spread of its error on the calibration runs of this kind) as (low, high) seconds
    tb = getattr(t, "band", None) if t is not None else None
    band = ((seconds * (1 + tb.low), seconds * (1 + tb.high))
            if tb is not None and tb.low is not None and seconds else None)
    return Outcome(candidate, FITS, ranks, seconds, band,
                   global_tokens / seconds if seconds else None, mfu,
                   max((rt.exposed_comm for _, rt in timed), default=None), bubble,
                   "" if seconds else "no step time for this step (its time model is missing)",
                   **kernels)


def _bound_figures(p, ranks, blocks=(), edges=()) -> dict:
    """Outcome's kernel_seconds and matmul_flops: per traced rank class, (own, recomputed)
    seconds the compute stream is provably busy or idle in forward and backward, the busiest
    NCCL stream's collectives there (own, recomputed), and FSDP2's own kernels among the
    compute stream's (layout_search/bounds.py, stream_floors); the job's matmul FLOPs (own,
    recomputed). With them the other figures the bounds read (step_ends, fsdp_stretches,
    stage_seconds, block_seconds, edge_seconds, optimizer_seconds: each field's comment).
    Empty where a rank's time is not the eager kernel model's."""
    from ..analysis.op_classes import op_class
    from .bounds import (block_floors, edge_floors, fsdp_stretches, optimizer_floors,
                         step_ends, stream_floors)

    def both_ends(q, counted):
        return step_ends(q, counted), fsdp_stretches(q, counted)

    seconds, ends, stretches, flops = [], [], [], [0, 0]
    pipelined = p.distributed.pipeline if p.distributed is not None else None
    for r, q in zip(ranks, _traced(p)):
        t = q.time
        if t is None or t.calibration or q.compiled is not None or \
                len(t.op_seconds) != len(q.ops):
            return {}
        for op in q.ops:
            if op.flops and op_class(op.record.func) == "matmul":
                flops[op.recompute] += len(r.ranks) * op.total_flops
        *figures, once = stream_floors(q, waits=pipelined is None, ends=both_ends)
        once, stretch = once if isinstance(once, tuple) else (once, None)
        seconds.append(tuple(figures))
        ends.append(once)
        stretches.append((r.ranks[0], stretch))
    out = {"kernel_seconds": tuple(seconds), "matmul_flops": tuple(flops),
           "step_ends": tuple(ends)}
    if any(f is not None for _, f in stretches):
        out["fsdp_stretches"] = (p.gpu.key, tuple(stretches))
    if pipelined is not None and pipelined.time is not None:
        out["stage_seconds"] = _stage_figures(p.distributed, pipelined.plan)
    if blocks:
        out["block_seconds"] = tuple(block_floors(q, blocks) for q in _traced(p))
    if blocks and edges:
        out["edge_seconds"] = tuple(edge_floors(q, blocks, *edges) for q in _traced(p))
        out["optimizer_seconds"] = tuple(optimizer_floors(q, blocks, *edges[:2])
                                         for q in _traced(p))
    return out


def _stage_figures(dist, plan) -> tuple:
    """bounds.action_floors of each pipeline rank, in pipeline order, from the trace that
    stands for the lowest rank of its coordinate (the one the schedule's time reads:
    PipelinePlan.report); () where a coordinate has no actions."""
    from .bounds import action_floors

    lowest: dict = {}
    for r in range(plan.mesh.world_size):
        lowest.setdefault(plan.mesh.coordinate(r)["pp"], r)
    figures = []
    for s in range(plan.pp):
        rep = next(rep for rep, m in zip(dist.classes.representatives, dist.classes.members)
                   if lowest[s] in m)
        floors = action_floors(dist.profiles[rep])
        if not floors:
            return ()
        figures.append(floors)
    return tuple(figures)


def _mfu(p, ranks, seconds, compute_dtype) -> float | None:
    """The job's model FLOPs utilisation: every rank's FLOPs less what checkpointing
    recomputes, over the job's step at the dense peak of the dtype the matmuls run in (the
    mixed-precision dtype, else the parameters'), the same peak for every candidate."""
    from ..analysis.kernel_cost import TENSOR_CORE
    from ..options import resolve_dtype

    dtype = resolve_dtype(compute_dtype) if compute_dtype else None
    peak = p.gpu.peak(TENSOR_CORE.get(dtype or torch.float32, "fp32")) if p.gpu else None
    if not seconds or not peak:
        return None
    work = sum(len(r.ranks) * (q.flops["total"] - q.recompute_flops)
               for r, q in zip(ranks, _traced(p)))
    return work / sum(len(r.ranks) for r in ranks) / seconds / peak


def _traced(p) -> list:
    """The Profile of each traced rank, in rank order (the profile itself on one device)."""
    if p.distributed is None:
        return [p]
    return [q for _, q in sorted(p.distributed.profiles.items())]


def _class_of(rank: int, members) -> tuple:
    for m in members:
        if rank in m:
            return (rank, *sorted(set(m) - {rank}))
    return (rank,)


def _gib(n: int) -> str:
    from ..report.text import fmt_bytes

    return fmt_bytes(n)
