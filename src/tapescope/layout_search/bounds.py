"""Lower bounds on a candidate's step time, from traces already made: branch and bound.

A candidate whose step provably takes longer than the search's k-th best so far cannot enter the
top k, so it is not traced (runner.py lists it as pruned with its bound). Each bound is a small
rule over what earlier traces measured (Outcome.kernel_seconds, Outcome.matmul_flops), never a
guess at the candidate's own figures:

- `repeated_kernels`: the time model runs a rank's compute-stream kernels one after another
  (analysis/timing.py: the step lasts at least until the compute stream is done; a kernel
  slowed by a collective only takes longer), and every micro-batch of one size runs the same
  forward and backward kernels, priced the same: the model's ops at the same shapes, and
  FSDP2's per-micro-batch hooks (its all-gathers' copy-out; tapescope never turns gradient
  sync off, so every micro-batch reduces its gradients the same way); a later micro-batch adds
  gradient accumulation, and removes no kernel. So a candidate's step is at least its
  micro-batches times one micro-batch's forward and backward compute-stream seconds on its
  slowest rank, read off any trace of the same layout, schedule and micro-batch size: its
  one-micro-batch screen, or the same step with less recompute (a heavier mode runs the
  lighter one's kernels and more: checkpointing's own handling adds ~1% on a 70B TP 8 step;
  the recomputed kernels count only from the same mode).
- `model_flops`: sharding splits the matmuls and never removes one (TP and PP split a matmul's
  rows, columns or layers over ranks; data parallelism splits the batch), so the job's matmul
  FLOPs are at least those of a purely data-parallel trace per sample times the global batch,
  and the slowest rank does at least the average share. No kernel runs matmul FLOPs faster than
  the GPU's peak x its matmul ceiling x its sustained clock (analysis/kernel_cost.py: tile
  utilisation and fill are at most 1).

tests/test_search.py checks each rule against brute force: every candidate's traced step is at
least each bound the rules give it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .space import RECOMPUTE_ORDER, Candidate

__all__ = ["Bound", "Known", "lower_bound", "BOUNDS"]


@dataclass(frozen=True)
class Bound:
    seconds: float
    reason: str   # what proves it


@dataclass
class Known:
    """What the traces so far measured, indexed for the rules."""

    matmul_rate: float | None = None   # FLOP/s no matmul kernel exceeds on this GPU
    # (layout, schedule, compile, micro-batch, float8) -> [Outcome]
    by_micro_batch: dict = field(default_factory=dict)
    flops_per_sample: dict = field(default_factory=dict)  # "own" / mode -> matmul FLOPs per sample

    def add(self, o) -> None:
        c = o.candidate
        if o.kernel_seconds:
            self.by_micro_batch.setdefault(_same_kernels(c), []).append(o)
        # a purely data-parallel trace: per sample, the model's whole matmul work (a CP rank
        # does its share of a sample's)
        if o.matmul_flops and c.layout.tp == 1 and c.layout.pp == 1 and c.layout.cp == 1 \
                and not c.compile:
            dp = c.layout.fsdp * c.layout.dp_replicate
            own, again = (f / (c.rank_batch * dp) for f in o.matmul_flops)
            self.flops_per_sample["own"] = max(self.flops_per_sample.get("own", 0.0), own)
            self.flops_per_sample[c.checkpointing] = again


def _same_kernels(c: Candidate) -> tuple:
    return (c.layout, c.schedule, c.compile, c.micro_batch, c.float8)


def repeated_kernels(c: Candidate, known: Known) -> Bound | None:
    best = None
    for x in known.by_micro_batch.get(_same_kernels(c), ()):
        same_mode = x.candidate.checkpointing == c.checkpointing
        if RECOMPUTE_ORDER.index(x.candidate.checkpointing) > \
                RECOMPUTE_ORDER.index(c.checkpointing):
            continue   # checkpointing adds kernels of its own (~1% on a 70B step): never less
        seconds = max(c.steps * (own + (again if same_mode else 0.0)) / x.candidate.steps
                      for own, again in x.kernel_seconds)
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"{c.steps} x one micro-batch's forward and backward kernels, "
                                  f"as traced in {x.candidate.label()}")
    return best


def model_flops(c: Candidate, known: Known) -> Bound | None:
    own = known.flops_per_sample.get("own")
    if not own or not known.matmul_rate:
        return None
    again = known.flops_per_sample.get(c.checkpointing, 0.0)
    samples = c.rank_batch * c.layout.fsdp * c.layout.dp_replicate
    seconds = (own + again) * samples / c.layout.world_size / known.matmul_rate
    return Bound(seconds, "the model's matmul FLOPs, shared evenly, at the GPU's matmul ceiling")


BOUNDS = (repeated_kernels, model_flops)


def lower_bound(c: Candidate, known: Known) -> Bound | None:
    """The largest bound the rules give `c` (None: no rule applies yet)."""
    bounds = [b for rule in BOUNDS if (b := rule(c, known)) is not None]
    return max(bounds, key=lambda b: b.seconds, default=None)


def matmul_rate(gpu) -> float | None:
    """The most matmul FLOP/s any kernel gets on `gpu` (a devices.gpus.GPU) in the kernel
    model (analysis/kernel_cost.py): the best of its dtypes' peak x matmul ceiling (tensor
    cores) or the matmul prior's share (fp32), at its sustained clock."""
    from ..devices.efficiency import efficiency_for, matmul_ceiling, sustained_clock

    rates = []
    for dtype in ("bf16", "fp16", "fp8"):
        peak = gpu.peak(dtype)
        if peak:
            precision = "fp8" if dtype == "fp8" else "16-bit"
            rates.append(peak * matmul_ceiling(gpu.key, dtype) * sustained_clock(gpu, precision))
    if gpu.peak("fp32"):
        rates.append(gpu.peak("fp32") * efficiency_for("matmul", gpu.key).compute
                     * sustained_clock(gpu))
    return max(rates, default=None)
