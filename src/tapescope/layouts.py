"""Which (PP, FSDP, TP) layout of N GPUs trains a model best: `tapescope fit SPEC --gpus 64 --gpu h100`.

The sensible layouts of N GPUs, as torchtitan users pick them: tensor parallelism inside a node
(TP degree a power of two up to the GPUs of a node, dividing N), FSDP over the rest; with
`--pp 1,2,4`, the same for each pipeline degree (1F1B, one micro-batch per sample, the step time
the schedule's with its bubble); with `--cp 1,2,4`, the same for each context-parallel degree
(without a pipeline: the sequence split over the CP ranks, FSDP over FSDP x CP, torch's ring
attention; distributed/presets.py). Each is
profiled with the preset parallelisation (distributed/presets.py) at the model's per-rank batch;
a row gives the highest rank's peak, whether it fits the GPU (the caching allocator's predicted
reserved memory plus the CUDA context against the GPU's memory), the step time, MFU and the
tokens per second of the whole job. With a budget (`fit --gpus N --budget 40GiB`), a layout fits when its
peak per rank is within the budget, as `fit` compares one device's peak.

The batch given is each data-parallel rank's: the TP ranks of a group share one batch (and the
CP ranks one batch of the full sequence), so the global batch is that batch times the
data-parallel degree (FSDP x replicas), and differs between layouts. Step times are therefore not comparable across rows; throughput (tokens, else samples,
per second of the whole job) is, and `best_layout` picks the fitting layout with the most.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import TapescopeError
from .distributed.presets import Layout, preset_parallelize

__all__ = ["LayoutRow", "best_layout", "candidate_layouts", "check_inputs", "fit_layouts",
           "layout_options"]


@dataclass
class LayoutRow:
    layout: Layout
    batch_per_rank: int | None = None    # samples of each data-parallel rank's batch
    peak_bytes: int | None = None        # highest rank, steady state
    reserved_bytes: int | None = None    # what nvidia-smi would show on that rank (None: OOM)
    oom: bool = False                    # the allocator's replay ran out of the GPU's memory
    fits: bool | None = None
    step_seconds: float | None = None
    mfu: float | None = None
    tokens_per_second: float | None = None
    note: str = ""
    error_band: str | None = None        # the throughput's measured error (analysis.time_band)

    @property
    def global_batch(self) -> int | None:
        """Samples of one step of the whole job: every data-parallel rank takes its own batch."""
        if self.batch_per_rank is None:
            return None
        return self.batch_per_rank * self.layout.fsdp * self.layout.dp_replicate

    @property
    def samples_per_second(self) -> float | None:
        if self.global_batch is None or not self.step_seconds:
            return None
        return self.global_batch / self.step_seconds

    def to_dict(self) -> dict:
        return {"pp": self.layout.pp, "fsdp": self.layout.fsdp, "tp": self.layout.tp,
                "cp": self.layout.cp,
                "dp_replicate": self.layout.dp_replicate, "batch_per_rank": self.batch_per_rank,
                "global_batch": self.global_batch, "peak_bytes": self.peak_bytes,
                "nvidia_smi_bytes": self.reserved_bytes, "oom": self.oom, "fits": self.fits,
                "step_seconds": self.step_seconds, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second,
                "samples_per_second": self.samples_per_second, "note": self.note,
                "error_band": self.error_band}


def best_layout(rows: list[LayoutRow]) -> LayoutRow | None:
    """The fitting layout with the most throughput of the whole job (tokens per second where
    the model takes tokens, else samples): the global batch differs between layouts, so the
    step time alone would favour the one that does the least work."""
    timed = [r for r in rows if r.fits and r.step_seconds]
    if not timed:
        return None
    return max(timed, key=lambda r: r.tokens_per_second or r.samples_per_second or 0.0)


def candidate_layouts(gpus: int, gpus_per_node: int = 8, pp_degrees=(1,),
                      cp_degrees=(1,)) -> list[Layout]:
    """For each pipeline degree and context-parallel degree dividing `gpus` (CP without a
    pipeline: distributed/presets.py): TP a power of two up to a node's GPUs dividing what is
    left, FSDP over the rest."""
    if gpus < 1:
        raise TapescopeError("--gpus must be at least 1")
    out = []
    for pp in pp_degrees:
        for cp in cp_degrees:
            if pp < 1 or cp < 1:
                raise TapescopeError(f"a degree must be at least 1, got {min(pp, cp)}")
            if gpus % (pp * cp) or pp > 1 and cp > 1:
                continue
            rest, tp = gpus // (pp * cp), 1
            while tp <= min(rest, gpus_per_node):
                if rest % tp == 0:
                    out.append(Layout(fsdp=rest // tp, tp=tp, pp=pp, cp=cp))
                tp *= 2
    if not out:
        raise TapescopeError(f"no pipeline degree of {list(pp_degrees)} and context-parallel "
                             f"degree of {list(cp_degrees)} divides {gpus} GPUs")
    return out


def _first_input(workload):
    """The first stage's first input, which every layout reads the same way (with or without a
    pipeline; a pipeline's target is the last input, never this one)."""
    return workload.args[0] if workload.args else None


def _batch(workload) -> int | None:
    """Samples of one rank's batch: the leading size of the first input."""
    shape = getattr(_first_input(workload), "shape", None)
    return int(shape[0]) if shape else None


def _tokens(workload) -> int:
    """Tokens of one rank's batch: the elements of the first input when it is integer (token
    ids), else none (the comparison is by samples). Only the first input, so that a label or a
    pipeline's target is never counted as tokens (a classifier given `--input 4,16 --input
    4:int64` showed tokens/s of its labels)."""
    import torch

    x = _first_input(workload)
    dtype = getattr(x, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return 0
    n = 1
    for s in x.shape:
        n *= s
    return n


def check_inputs(workload, options, layouts: list[Layout]) -> None:
    """The inputs mean one thing in every layout of a comparison, checked once before any layout
    is traced (each row had failed on its own, pipelined rows one way and the others another).
    A pipelined layout reads them as torch's pipeline schedule takes them: the first stage's
    inputs, then the loss's target (distributed/pipeline.py); a layout without a pipeline passes
    them all to the model's forward, so a comparison of both needs a forward that takes the
    target too (the zoo's models: `forward(tokens, targets=None)`)."""
    import inspect

    piped = [x for x in layouts if x.pp > 1]
    if not piped:
        return
    given = len(workload.args)
    pp = ",".join(str(d) for d in dict.fromkeys(x.pp for x in layouts))
    if workload.kwargs or given < 2:
        raise TapescopeError(
            f"--pp {pp}: a pipelined layout takes the first stage's inputs and then the loss's "
            f"target, positionally; {workload.display_name} was given {given} input"
            f"{'s' * (given != 1)}{' and keyword inputs' if workload.kwargs else ''}: add the "
            f"target as the last --input (e.g. --input 4,128:int64 --input 4,128:int64 for "
            f"token ids and next tokens), or drop --pp")
    if len(piped) == len(layouts):
        return
    from .capture.model import built_for

    forward = built_for(workload.model, options).forward
    try:
        inspect.signature(forward).bind(*workload.args)
    except TypeError:
        name = f"{type(forward.__self__).__name__}.forward{inspect.signature(forward)}"
        raise TapescopeError(
            f"--pp {pp} compares layouts with and without a pipeline on the same {given} "
            f"inputs: a pipeline's first stage takes all but the last (the loss's target), a "
            f"layout without one passes all {given} to {name}, which does not take them; give "
            f"forward a parameter for the target that it may ignore (as the zoo's models take "
            f"`targets=None`), or compare pipelined layouts only (--pp "
            f"{','.join(str(x.pp) for x in dict.fromkeys(piped))})") from None
    except ValueError:  # a builtin forward: no signature to check
        return


def layout_options(options, layout: Layout, schedule: str = "1f1b"):
    """The options one layout is profiled with: the layout's mesh, the preset parallelisation
    (TP, then FSDP2 on every block and the root; FSDP2's mixed precision standing in for
    autocast when the layout shards) and its pipeline. A checkpointing plan in `options` is
    applied to the model before the preset (capture/session.py), as `profile --fsdp N
    --checkpoint plan.json` applies it."""
    mp = options.amp  # FSDP2's mixed precision stands in for autocast
    sharded = layout.shard_degree > 1 or layout.dp_replicate > 1
    return options.but(amp=None if sharded else mp, mesh=_mesh_spec(layout),
                       parallelize=preset_parallelize(layout, mp) if layout.parallelised
                       else None,
                       pipeline=_pipeline(layout, schedule))


def fit_layouts(workload, options, gpus: int, budget: int | None = None, progress=None,
                stage=None, pp_degrees=(1,), schedule: str = "1f1b",
                cp_degrees=(1,)) -> list[LayoutRow]:
    """Profile every candidate layout of `gpus` GPUs of `options.gpu` (device cuda); `budget`
    (bytes per rank) replaces the GPU's memory in the verdict. `progress(step, phase)` is told of
    each traced phase, `stage(message)` of each layout begun. pp_degrees: the pipeline degrees
    to try (each with `schedule`, one micro-batch per sample of the batch); cp_degrees: the
    context-parallel degrees to try."""
    from .api import profile_workload
    from .devices.gpus import interconnect

    if options.device.type != "cuda" or options.gpu is None:
        raise TapescopeError("fit --gpus compares layouts on a GPU: give --gpu (h100, a100, ...)")
    rows = []
    tokens = _tokens(workload)
    layouts = candidate_layouts(gpus, interconnect(options.gpu).gpus_per_node, pp_degrees,
                                cp_degrees)
    check_inputs(workload, options, layouts)
    for i, layout in enumerate(layouts):
        row = LayoutRow(layout, batch_per_rank=_batch(workload))
        rows.append(row)
        if layout.pp > 1 and options.checkpointing:
            # Options.create refuses a plan with a pipeline (its stages are split from the
            # model after the plan would wrap it): say so in the row, the others go on
            row.note = ("a checkpointing plan with a pipeline is not supported yet (checkpoint "
                        "each stage in your own parallelize function)")
            continue
        if stage is not None:
            stage(f"layout {layout} ({i + 1} of {len(layouts)})")
        opts = layout_options(options, layout, schedule)
        try:
            p = profile_workload(workload, opts, progress)
        except TapescopeError as e:
            row.note = str(e).split(";")[0]
            continue
        cm, t = p.cuda_memory, p.time
        row.peak_bytes = p.peak_bytes
        # out of memory, the replay stops at the GPU's capacity: that is no figure to show
        row.oom = cm is not None and cm.oom
        row.reserved_bytes = cm.nvidia_smi if cm is not None and not cm.oom else None
        if budget is not None:
            row.fits = p.peak_bytes <= budget
        else:
            row.fits = None if cm is None else not cm.oom
        pipelined = p.distributed.pipeline if p.distributed is not None else None
        if pipelined is not None and pipelined.time is not None:
            # the stages run together: the schedule's time, bubble included (the highest
            # rank's FLOPs over it for MFU)
            row.step_seconds = pipelined.time.seconds
            row.mfu = t.mfu * t.seconds / row.step_seconds if t is not None else None
        elif t is not None:
            row.step_seconds, row.mfu = t.seconds, t.mfu
        if t is not None and t.band is not None:
            row.error_band = t.band.rate_text()
        if row.step_seconds and tokens:
            # every data-parallel replica (FSDP rank group) processes its own batch
            row.tokens_per_second = tokens * layout.fsdp * layout.dp_replicate / row.step_seconds
    return rows


def _pipeline(layout: Layout, schedule: str):
    if layout.pp == 1:
        return None
    from .values.pipeline import pipeline_spec

    return pipeline_spec(schedule)


def _mesh_spec(layout: Layout):
    from .values.mesh import mesh_spec

    return mesh_spec(layout.mesh)
