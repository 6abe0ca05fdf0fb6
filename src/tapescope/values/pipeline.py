"""A pipeline-parallel step, as an option: which schedule, how many micro-batches, how the model is
split into stages (`PipelineSpec`), and the schedules tapescope runs (`SCHEDULES`).

The schedules are torch.distributed.pipelining's own; tapescope builds them on each simulated
rank and runs them on fake tensors (distributed/pipeline.py). Each is known here by the name the
CLI takes, with the torch class that runs it and how stages sit on ranks:
- "loop": stage s on rank s % pp (one stage per rank, or several, interleaved);
- "v": two stages per rank, rank r holding stages r and 2*pp - 1 - r (the V shape of ZBV and
  DualPipeV: the first and last stage share rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..errors import TapescopeError

__all__ = ["PipelineSpec", "Schedule", "SCHEDULES", "pipeline_spec"]


@dataclass(frozen=True)
class Schedule:
    torch_class: str        # in torch.distributed.pipelining.schedules
    stages_per_rank: int    # the default; interleaved schedules take another with stages_per_rank
    style: str              # "loop" or "v"
    multi: bool             # a PipelineScheduleMulti: takes a list of stages
    zero_bubble: bool = False


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", 1, "loop", multi=False),
    "1f1b": Schedule("Schedule1F1B", 1, "loop", multi=False),
    "interleaved-1f1b": Schedule("ScheduleInterleaved1F1B", 2, "loop", multi=True),
    "looped-bfs": Schedule("ScheduleLoopedBFS", 2, "loop", multi=True),
    "interleaved-zb": Schedule("ScheduleInterleavedZeroBubble", 2, "loop", multi=True,
                               zero_bubble=True),
    "zbv": Schedule("ScheduleZBVZeroBubble", 2, "v", multi=True, zero_bubble=True),
    "dualpipev": Schedule("ScheduleDualPipeV", 2, "v", multi=True, zero_bubble=True),
}

# what users type for the same schedule (torch's class names, torchtitan's config names)
_ALIASES = {"interleaved1f1b": "interleaved-1f1b", "loopedbfs": "looped-bfs",
            "interleavedzerobubble": "interleaved-zb", "zbvzerobubble": "zbv",
            "zero-bubble-v": "zbv", "dualpipe-v": "dualpipev"}


@dataclass(frozen=True)
class PipelineSpec:
    """schedule: a SCHEDULES name. microbatches: per step (default: one per sample of the batch,
    torchtitan's default micro-batch size of 1). stages_per_rank: for interleaved schedules
    (default: the schedule's). split: `fn(model, stage, num_stages) -> nn.Module`, the stage's
    module (it may change `model`, a copy); default: distributed/pipeline.py's split of the
    model's block list."""

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split: Callable | None = None

    @property
    def kind(self) -> Schedule:
        return SCHEDULES[self.schedule]

    @property
    def local_stages(self) -> int:
        return self.stages_per_rank or self.kind.stages_per_rank

    def num_stages(self, pp: int) -> int:
        return pp * self.local_stages

    def stages_of(self, pp_rank: int, pp: int) -> tuple:
        """The stage indices rank `pp_rank` of `pp` holds, in order."""
        if self.kind.style == "v":
            return (pp_rank, 2 * pp - 1 - pp_rank)
        return tuple(pp_rank + k * pp for k in range(self.local_stages))

    def to_dict(self) -> dict:
        return {"schedule": self.schedule, "microbatches": self.microbatches,
                "stages_per_rank": self.local_stages,
                "split": None if self.split is None else getattr(self.split, "__qualname__",
                                                                  str(self.split))}


def pipeline_spec(value) -> PipelineSpec | None:
    """A PipelineSpec from a PipelineSpec, a dict of its fields, or a schedule name."""
    if value is None or isinstance(value, PipelineSpec):
        spec = value
    elif isinstance(value, str):
        spec = PipelineSpec(schedule=value)
    elif isinstance(value, dict):
        unknown = set(value) - {"schedule", "microbatches", "stages_per_rank", "split"}
        if unknown:
            raise TapescopeError(f"pipeline= takes schedule, microbatches, stages_per_rank and "
                                 f"split; got {sorted(unknown)}")
        spec = PipelineSpec(**value)
    else:
        raise TapescopeError(f"pipeline= takes a schedule name, a dict or a PipelineSpec; got "
                             f"{type(value).__name__}")
    if spec is None:
        return None
    if not isinstance(spec.schedule, str):
        raise TapescopeError(f"pipeline schedule must be a schedule's name ({', '.join(SCHEDULES)}),"
                             f" got {spec.schedule!r}")
    name = spec.schedule.lower().replace("_", "-")
    if name.startswith("schedule"):  # torch's class names: Schedule1F1B, ScheduleZBVZeroBubble
        name = name[len("schedule"):]
    name = _ALIASES.get(name.replace("-", ""), _ALIASES.get(name, name))
    if name not in SCHEDULES:
        raise TapescopeError(f"unknown pipeline schedule {spec.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
    kind = SCHEDULES[name]
    for field_name in ("microbatches", "stages_per_rank"):
        v = getattr(spec, field_name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise TapescopeError(f"pipeline {field_name} must be a whole number >= 1, got {v!r}")
    if spec.stages_per_rank is not None:
        if kind.style == "v" and spec.stages_per_rank != 2:
            raise TapescopeError(f"schedule {name} puts two stages on each rank (a V); "
                                 f"stages_per_rank={spec.stages_per_rank} does not fit it")
        if not kind.multi and spec.stages_per_rank != 1:
            raise TapescopeError(f"schedule {name} runs one stage per rank; use interleaved-1f1b "
                                 f"(or another interleaved schedule) for {spec.stages_per_rank}")
    if spec.split is not None and not callable(spec.split):
        raise TapescopeError("pipeline split must be a function fn(model, stage, num_stages) -> "
                             "the stage's nn.Module")
    return replace(spec, schedule=name)
