"""Lower bounds on a candidate's step time, from traces already made: branch and bound.

A candidate whose step provably takes longer than the search's k-th best so far cannot enter the
top k, so it is not traced (runner.py lists it as pruned with its bound). The step a bound is
on is the one the search ranks by: what the candidate's own trace would give
(evaluate._outcome: its slowest rank's step on analysis/timing.py's eager model, a pipeline's
on distributed/pipeline.py's schedule_time), so each proof runs over that model's arithmetic,
not over a measured GPU step. Each bound is a small rule over what earlier traces measured,
never a guess at the candidate's own figures: the Outcome fields evaluate._bound_figures reads
off each traced rank with the figure functions below (kernel_seconds: stream_floors;
step_ends; stage_seconds: action_floors; block_seconds: block_floors; edge_seconds:
edge_floors; optimizer_seconds: optimizer_floors; fsdp_stretches) and matmul_flops. A trace
whose time is not the eager kernel model's (compiled, calibrated) gives none.

- `repeated_kernels`: the time model runs a rank's compute-stream kernels one after another
  (analysis/timing.py: the step lasts at least until the compute stream is done; a kernel
  slowed by a collective only takes longer), and every micro-batch of one size runs the same
  forward and backward kernels, priced the same: the model's ops at the same shapes, and
  FSDP2's per-micro-batch hooks (its all-gathers' copy-out; tapescope never turns gradient
  sync off, so every micro-batch reduces its gradients the same way); a later micro-batch adds
  gradient accumulation, and removes no kernel. So a candidate's step is at least its
  micro-batches times one micro-batch's forward and backward compute-stream seconds on its
  slowest rank, read off any trace of the same layout and schedule (fit or out of memory: an
  out-of-memory trace is a whole trace, only its allocator replay ran out), or the same step
  with less recompute (a heavier mode runs the lighter one's kernels and more: checkpointing's
  own handling adds ~1% on a 70B TP 8 step; the recomputed kernels count only from the same
  mode). From a larger micro-batch size, scaled (_per_micro_batch_share): a whole fraction of
  it costs each kernel at least that fraction. Each kernel counts at its price
  alone (overlapped by a collective it only runs slower), plus the compute stream's waits
  that no schedule hides: the stretch from the kernel that wrote a collective's input to the
  first kernel that reads its output lasts at least the collective's seconds (a tensor-parallel
  step's all-gathers and reduce-scatters between its matmuls; stream_floors below). And the
  step lasts at least the micro-batches times one micro-batch's collectives on its busiest
  NCCL stream (one process group's collectives run one after another; FSDP2 gathers and
  reduces again every micro-batch).
- `same_model_kernels`: the same from a trace of another data-parallel split of the same TP /
  CP / PP split (an HSDP layout from its FSDP twin, FSDP 8 x TP 2 from FSDP 4 x TP 2): the
  model's kernels and the waits between them only; FSDP2's own kernels and the collectives
  are left out.
- `pipelined_model_kernels`: a pipelined candidate from an unpipelined trace of the same TP /
  CP split (its proof is the rule's docstring): its stages together run the model's kernels on
  every micro-batch, and the slowest rank at least the average of the pp ranks.
- `model_flops`: sharding splits the matmuls and never removes one (TP and PP split a matmul's
  rows, columns or layers over ranks; data parallelism splits the batch), so the job's matmul
  FLOPs are at least those of a purely data-parallel trace per sample times the global batch,
  and the slowest rank does at least the average share. No kernel runs matmul FLOPs faster than
  the GPU's peak x its matmul ceiling x its sustained clock (analysis/kernel_cost.py: tile
  utilisation and fill are at most 1).
- `kernels_and_step_ends` (appended below): `repeated_kernels`' floor plus what the step runs
  once (Outcome.step_ends, `step_ends`): the optimizer's kernels and the waits for FSDP2's
  first all-gather and last reduction, which the windows of `stream_floors` cannot place.
- `pipeline_chain`: a GPipe / 1F1B pipeline's bubble, from a trace of the same pipeline (any
  data-parallel split): stage s's first forward waits for micro-batch 0's forwards through
  the stages before it, and its last backward's gradient still goes back through them, so
  step >= sum_{j<s} F_j + W_s + sum_{j<s} B_j (the proof is the rule's docstring).
- `twin_pipeline_chain`: the same chain before any trace of the pipeline, from the
  unpipelined twin's per-block kernels split as the pipeline splits its blocks.
- `twin_pipeline_ends` (appended below): that chain with what the first and the last stage run
  besides their blocks (the embedding; the final norm, the output layer and the loss: the
  twin's kernels by module, `edge_floors`), and a chain that ends on the stage's own rank:
  its start plus its whole eager step, the loss's forward and its share of the twin's
  optimizer kernels in it (`optimizer_floors`).
- `replicated_twin` (appended below): an HSDP candidate (or any unpipelined split whose shard
  degree divides the trace's) from its FSDP twin's trace: `same_model_kernels`' floor plus the
  optimizer's kernels (floors scaled to the larger shard) and the waits FSDP2's collectives
  cause at the step's two ends and between micro-batches, each collective re-priced on the
  candidate's own groups from the twin's unpadded bytes (Outcome.fsdp_stretches; the proof is
  the rule's docstring).

tests/test_search.py checks each rule against brute force: every candidate's traced step is at
least each bound the rules give it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

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
    # (layout, schedule, compile, float8) -> [Outcome]
    by_micro_batch: dict = field(default_factory=dict)
    # the same with the layout's data-parallel degrees left out (_same_model_kernels) -> [Outcome]
    by_model_split: dict = field(default_factory=dict)
    # unpipelined one-micro-batch traces by what a pipeline of them shares (_pipeline_twin)
    by_pipeline_twin: dict = field(default_factory=dict)
    # "own" -> matmul FLOPs per sample; a checkpointing mode -> its recomputed ones per sample
    flops_per_sample: dict = field(default_factory=dict)

    def add(self, o) -> None:
        c = o.candidate
        if o.kernel_seconds:
            self.by_micro_batch.setdefault(_same_kernels(c), []).append(o)
            self.by_model_split.setdefault(_same_model_kernels(c), []).append(o)
            if c.layout.pp == 1 and c.steps == 1:
                self.by_pipeline_twin.setdefault(_pipeline_twin(c), []).append(o)
        # a purely data-parallel trace: per sample, the model's whole matmul work (a CP rank
        # does its share of a sample's)
        if o.matmul_flops and c.layout.tp == 1 and c.layout.pp == 1 and c.layout.cp == 1 \
                and not c.compile:
            dp = c.layout.fsdp * c.layout.dp_replicate
            own, again = (f / (c.rank_batch * dp) for f in o.matmul_flops)
            self.flops_per_sample["own"] = max(self.flops_per_sample.get("own", 0.0), own)
            self.flops_per_sample[c.checkpointing] = again


def _same_kernels(c: Candidate) -> tuple:
    """What decides a rank's kernels and collectives of one micro-batch but its size and its
    checkpointing mode (repeated_kernels scales the one and orders the other): the whole layout
    (FSDP2's own kernels and the collectives follow every degree), the schedule, compile and
    float8."""
    return (c.layout, c.schedule, c.compile, c.float8)


def _same_model_kernels(c: Candidate) -> tuple:
    """What decides the model's own kernels on a rank, FSDP2's left out: the TP, CP and PP
    split and whether the parameters are sharded or replicated at all (then FSDP2's mixed
    precision computes in bf16 instead of autocast: evaluate.candidate_options). The FSDP and
    HSDP degrees decide how many samples a rank takes per step, not the ops of one
    micro-batch: FSDP2 all-gathers the parameters whole before the module runs. With float8,
    whether FSDP shards at all decides too (float8 all-gather, capture/float8.py: the weights'
    casts leave the model's forward)."""
    sharded = c.layout.shard_degree > 1 or c.layout.dp_replicate > 1
    float8_gather = c.float8 is not None and c.layout.fsdp > 1
    return (replace(c.layout, fsdp=1, dp_replicate=1), sharded, float8_gather, c.schedule,
            c.compile, c.float8)


def _pipeline_twin(c: Candidate) -> tuple:
    """What decides the model's own kernels on a rank whatever the pipeline degree and the
    data-parallel degrees (pipelined_model_kernels): `_same_model_kernels`' key with PP left
    out too, and the schedule (a pipeline's; None without)."""
    layout, sharded, float8_gather, _, compiled, float8 = _same_model_kernels(c)
    return (replace(layout, pp=1), sharded, float8_gather, compiled, float8)


def _per_micro_batch_share(c: Candidate, x: Candidate) -> float | None:
    """How many of `x`'s micro-batches `c`'s step provably runs the work of, as far as the
    compute-stream floor goes (None: no transfer). A micro-batch a whole fraction 1 / j of x's
    runs the same ops at the batch dimension divided by j, and every kernel price in
    analysis/kernel_cost.py (max(FLOPs / rate, bytes / bandwidth) + a launch, the FLOPs' fill
    and a GEMM's tile waves rounding up) is subadditive over a whole multiple of the size, as is
    a collective's (latency + bytes / bandwidth) and so a wait window's stretch max(collective,
    kernels between): one micro-batch of m / j costs at least 1 / j of one of m. A later
    micro-batch adds gradient accumulation (outside FSDP2, an add per gradient on the compute
    stream), so x's per-micro-batch average holds for c only when c runs as many micro-batches
    or more. (A larger micro-batch than x's has fewer micro-batches in a step of the same
    samples: no transfer.)"""
    m, mx = c.micro_batch, x.micro_batch
    if m > mx or mx % m or c.steps < x.steps:
        return None
    return c.steps * m / mx / x.steps


def _transferable(c: Candidate, index: dict, key):
    """The traces `index` holds under `key(c)` whose per-micro-batch figures transfer to `c`:
    checkpointing as light or lighter (a heavier mode runs the lighter one's kernels and more:
    checkpointing's own handling adds ~1% on a 70B TP 8 step; the recomputed kernels count only
    from the same mode) and a micro-batch `_per_micro_batch_share` scales; each as (the trace,
    whether it is c's mode, the share). The rules reading them filter their own figures."""
    for x in index.get(key(c), ()):
        xc = x.candidate
        if RECOMPUTE_ORDER.index(xc.checkpointing) > RECOMPUTE_ORDER.index(c.checkpointing):
            continue
        share = _per_micro_batch_share(c, xc)
        if share is not None:
            yield x, xc.checkpointing == c.checkpointing, share


def repeated_kernels(c: Candidate, known: Known) -> Bound | None:
    """The module docstring's first rule: c's micro-batches x one micro-batch's compute-stream
    kernels and waits (or its busiest NCCL stream's collectives), from a trace of the same
    layout and schedule."""
    best = None
    for x, same_mode, share in _transferable(c, known.by_micro_batch, _same_kernels):
        seconds = max(share * max(own + (again if same_mode else 0.0),
                                  comm + (comm_again if same_mode else 0.0))
                      for own, again, comm, comm_again, *_ in x.kernel_seconds)
        if best is None or seconds > best.seconds:
            what = "one micro-batch's" if x.candidate.micro_batch == c.micro_batch else \
                f"micro-batch {x.candidate.micro_batch}'s"
            best = Bound(seconds, f"{c.steps} x {what} forward and backward kernels, scaled, "
                                  f"as traced in {x.candidate.label()}")
    return best


def same_model_kernels(c: Candidate, known: Known) -> Bound | None:
    """`repeated_kernels` from a trace of another data-parallel split of the same model split
    (an HSDP layout from its FSDP twin, FSDP 8 x TP 2 from FSDP 4 x TP 2): the model's kernels
    and the waits between them only, FSDP2's own kernels left out (its copy-out reads the
    all-gather buffer, padded to a multiple of the shard degree) and the collectives too (their
    groups differ)."""
    best = None
    for x, same_mode, share in _transferable(c, known.by_model_split, _same_model_kernels):
        if x.candidate.layout == c.layout:
            continue   # repeated_kernels reads c's own layout, FSDP2's kernels included
        seconds = max(share * (own - data_parallel + (again if same_mode else 0.0))
                      for own, again, _, _, data_parallel, *_ in x.kernel_seconds)
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"{c.steps} x micro-batch {x.candidate.micro_batch}'s model "
                                  f"kernels, scaled, as traced in {x.candidate.label()}")
    return best


def pipelined_model_kernels(c: Candidate, known: Known) -> Bound | None:
    """A pipelined candidate's step is at least (its micro-batches / pp) x one micro-batch's
    model kernels, waits left out, on the unpipelined layout of the same TP / CP split,
    checkpointing as light or lighter, one micro-batch as large or larger (scaled).

    Why. (1) The pipelined step lasts at least each pipeline rank's own compute-stream kernels:
    distributed/pipeline.py's schedule_time runs a rank's actions one after another, each as
    long as the time model's seconds of its ops (action_seconds), and adds the rest of the
    rank's step after them, so the step is at least the rank's whole eager step (timing.py: its
    in-order compute stream), and each op's seconds there are at least its kernel's price alone
    (a collective beside it only slows it). So the step is at least the average over the pp
    ranks of their kernels. (2) Those ranks together hold every block, the embedding and the
    output once (pipeline.py's block_range splits the blocks; with several stages a rank, its
    stages), each parallelised as the unpipelined model is (the same TP plan, checkpointing
    and FSDP2 over the stage: evaluate.candidate_options), and run each micro-batch through
    all of them: per micro-batch, the same ops at the same shapes (the micro-batch's samples,
    the TP degree's shards; FSDP2 gathers each block whole before it runs, so the FSDP degree
    changes none of the model's ops, as for `same_model_kernels`), plus what a pipeline adds
    (stage boundaries, sends, the schedule's loss scaling). (3) timing.py prices an op's kernel
    from the op alone (kernel_cost.kernel_of: its function, its inputs' and outputs' shapes,
    dtypes and bytes, whether it runs on the GPU; the GPU's figures): not from its rank, its
    neighbours or how many ops the trace holds, so a stage's kernel costs what the same kernel
    costs in the whole model. Summing (1) and (2): pp x step >= micro-batches x the model's
    kernels of one micro-batch.

    What the twin's figure leaves out, each of which could exceed what the pipeline runs:
    the compute stream's waits for collectives (stream_floors' windows: a pipeline's own
    collectives differ), FSDP2's own kernels (their sizes follow the shard degree's padding),
    the collectives, and gradient accumulation: only a twin with one micro-batch is read (an
    unpipelined layout's opener, its largest micro-batch), whose forward and backward
    accumulate nothing. Recomputed kernels count from a twin of the same mode only (a lighter
    mode's own kernels are a heavier one's: `repeated_kernels`). A larger micro-batch scales
    down by the whole fraction (`_per_micro_batch_share`'s subadditivity). The twin's rank
    classes may differ: the least of them is read. A bubble would add to this and is not
    counted."""
    if c.layout.pp == 1:
        return None
    best = None
    for x, same_mode, scale in _unpipelined_twins(c, known):
        xc = x.candidate
        per_micro_batch = min(max(0.0, own - data_parallel + (again if same_mode else 0.0))
                              for _, _, _, _, data_parallel, own, again in x.kernel_seconds)
        seconds = c.steps / c.layout.pp * scale * per_micro_batch
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"{c.steps} micro-batches / {c.layout.pp} stages x micro-batch "
                                  f"{xc.micro_batch}'s model kernels, scaled, as traced in "
                                  f"{xc.label()}")
    return best


def model_flops(c: Candidate, known: Known) -> Bound | None:
    """The module docstring's `model_flops`: the job's matmul FLOPs (per sample, from a purely
    data-parallel trace; recomputed ones only from a trace of c's mode), shared evenly over its
    ranks, at the fastest matmul rate any kernel gets on the GPU (Known.matmul_rate)."""
    own = known.flops_per_sample.get("own")
    if not own or not known.matmul_rate:
        return None
    again = known.flops_per_sample.get(c.checkpointing, 0.0)
    samples = c.rank_batch * c.layout.fsdp * c.layout.dp_replicate
    seconds = (own + again) * samples / c.layout.world_size / known.matmul_rate
    return Bound(seconds, "the model's matmul FLOPs, shared evenly, at the GPU's matmul ceiling")


def pipeline_chain(c: Candidate, known: Known) -> Bound | None:
    """A pipelined candidate of a one-stage-a-rank schedule (GPipe, 1F1B) from a trace of the
    same pipeline (its own layout or another data-parallel split): step >= max over stages s of
    sum_{j<s} F_j + W_s + sum_{j<s} B_j, where F_j is stage j's first forward action, B_j its
    last backward action (recompute included) and W_s every action of stage s, each as the
    kernels alone of the trace's actions (Outcome.stage_seconds), scaled.

    Why, on distributed/pipeline.py's schedule_time, which gives a pipelined candidate's step
    (evaluate._outcome): with one stage a rank, pipeline rank s runs stage s's actions in the
    order its trace ran them (traced_order: the i-th forward is micro-batch i, so is the i-th
    backward); each action starts when the rank's previous action is done and its input is
    there (a forward after stage s - 1's forward of the same micro-batch, a backward after
    stage s + 1's backward of it, the last stage's after its own forward), plus p2p >= 0
    seconds from another rank, and lasts action_seconds: the time model's seconds of its ops,
    each compute-stream kernel's at least its price alone (timing.py only stretches one). The
    step is the last rank's end, its schedule plus the rest of its step (>= 0). (1) GPipe and
    1F1B both start every stage with micro-batch 0's forward (1F1B's warm-up is
    num_stages - s >= 1 forwards): stage s's first action waits for stage s - 1's, which
    waited for stage s - 2's, ..., so it starts no earlier than sum_{j<s} F_j(micro-batch 0).
    (2) From there rank s runs its actions one after another: it ends its last no earlier than
    that start plus W_s. (3) Both end every stage with the last micro-batch's backward (GPipe
    runs the backwards in micro-batch order, 1F1B's cool-down too), whose gradient stage
    s - 1's backward of that micro-batch waits for, then stage s - 2's, ..., down to stage 0:
    rank 0 ends no earlier than (1) + (2) + sum_{j<s} B_j(the last micro-batch). Every s gives
    a bound; the largest is taken. The rank's first forward and last backward are positions
    every candidate of the family has, so what only they run (FSDP2's unshard before the
    first forward, the last backward's gradient accumulation and reduce-scatter copy-in) is in
    the candidate's too.

    From traces of the same model split (the family's own, or another data-parallel split of
    the same PP / TP / CP split and schedule, as `same_model_kernels` reads: the same stages
    and the same TP per stage; FSDP2's own kernels are left out of the figures, as their sizes
    follow the shard degree, and FSDP2 gathers a block whole, so its degree changes none of
    the model's ops; each stage as the lowest rank of its pipeline coordinate, as
    schedule_time reads them); checkpointing as light or lighter (a heavier mode
    runs the lighter one's forward kernels and more in backward; the recomputed kernels count
    only from the same mode); a micro-batch a whole fraction 1 / k of the trace's, each
    action's kernels then at least 1 / k of the trace's (their prices are subadditive over a
    whole multiple of the size, as `_per_micro_batch_share` says) and W_s the trace's scaled
    as `repeated_kernels` scales a step's (with at least the trace's micro-batches: a later
    micro-batch only adds gradient accumulation).

    Where it fails, so it is not applied: schedules with several stages a rank (interleaved
    1F1B, looped BFS, the zero-bubble and V schedules): a rank's first action still waits for
    the stages before it, but its last need not be a backward that the others wait for after
    it (a weight backward waits for nobody, a V schedule's last stage is on rank 0), and the
    stages of a rank interleave; a step not timed by the schedule (no GPU: no figures)."""
    if c.layout.pp == 1 or c.schedule not in ("gpipe", "1f1b"):
        return None
    best = None
    for x, same_mode, share in _transferable(c, known.by_model_split, _same_model_kernels):
        if not x.stage_seconds:
            continue   # an unpipelined trace of the family: no stages
        xc = x.candidate
        scale = c.micro_batch / xc.micro_batch
        chain = seconds = 0.0
        for first_forward, last_own, last_again, own, again in x.stage_seconds:
            seconds = max(seconds, chain + share * (own + (again if same_mode else 0.0)))
            chain += scale * (first_forward + last_own + (last_again if same_mode else 0.0))
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"the pipeline's critical chain (stages before the slowest: "
                                  f"micro-batch 0's forward, the last one's backward), scaled, "
                                  f"as traced in {xc.label()}")
    return best


def _unpipelined_twins(c: Candidate, known: Known):
    """The traces a pipelined candidate's twin rules read (`pipelined_model_kernels`,
    `twin_pipeline_chain`, `twin_pipeline_ends`): one-micro-batch traces of the unpipelined
    layouts of its TP / CP split, checkpointing as light or lighter, a micro-batch as large or
    larger that its own divides; each as (the trace, same checkpointing mode, its micro-batch /
    the trace's)."""
    for x in known.by_pipeline_twin.get(_pipeline_twin(c), ()):
        xc = x.candidate
        if RECOMPUTE_ORDER.index(xc.checkpointing) > RECOMPUTE_ORDER.index(c.checkpointing) \
                or c.micro_batch > xc.micro_batch or xc.micro_batch % c.micro_batch:
            continue
        yield x, xc.checkpointing == c.checkpointing, c.micro_batch / xc.micro_batch


def twin_pipeline_chain(c: Candidate, known: Known) -> Bound | None:
    """`pipeline_chain` for a pipelined family not traced yet, from the unpipelined twin's
    blocks (the traces `pipelined_model_kernels` reads: one micro-batch, the same TP / CP
    split, checkpointing as light or lighter, a micro-batch as large or larger, scaled):
    step >= max over stages s of sum_{j<s} (F_j + B_j) + m (F_s + B_s), with F_j and B_j the
    twin's forward and backward kernels (FSDP2's own left out; recompute from the same mode
    only) of the blocks stage j holds (pipeline.py's block_range: the blocks evenly, the
    earlier stages one fewer), m the candidate's micro-batches.

    Why: pipeline_chain's (1)-(3) with F_j, B_j any lower bounds on stage j's first forward
    and last backward, and W_s >= m (F_s + B_s) when F_s, B_s bound every forward and backward
    of stage s: each action of stage s runs each of its blocks once on one micro-batch, and a
    block's forward and backward ops are the twin's at the same shapes (the same TP plan,
    checkpointing and mixed precision; FSDP2 gathers a block whole, so its degree changes none
    of them: `pipelined_model_kernels`' (2)), each priced from the op alone (its (3)). A
    block's ops are read off the twin by module: a forward op's (a recomputed one's too) is
    its module's, a backward op's the module of the forward op whose autograd node runs it
    (Op.forward_op); ops of no block (the embedding, the output layer, the loss, the model's
    own code between blocks, AccumulateGrad) are left out, as are FSDP2's own kernels (their
    sizes follow the shard degree), the collectives and the waits for them. Only the blocks
    are counted because only their stage is known from the split alone; with stages of equal
    blocks the bound is (m + pp - 1) / pp x the blocks' kernels a micro-batch, against
    `pipelined_model_kernels`' m / pp x the whole model's. The twin's rank classes may differ:
    each block's figures are the least of them."""
    if c.layout.pp == 1 or c.schedule not in ("gpipe", "1f1b"):
        return None
    best = None
    for x, same_mode, scale in _unpipelined_twins(c, known):
        xc = x.candidate
        if not x.block_seconds:
            continue
        blocks = [tuple(min(figures) for figures in zip(*per_class))
                  for per_class in zip(*x.block_seconds)]
        n = len(blocks)
        if n < c.layout.pp:
            continue
        chain = seconds = 0.0
        for s in range(c.layout.pp):
            held = [blocks[b] for b in range(s * n // c.layout.pp, (s + 1) * n // c.layout.pp)]
            forward = scale * sum(f for f, _, _ in held)
            backward = scale * sum(own + (again if same_mode else 0.0) for _, own, again in held)
            seconds = max(seconds, chain + c.steps * (forward + backward))
            chain += forward + backward
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"the pipeline's critical chain over its stages' blocks, "
                                  f"micro-batch {xc.micro_batch}'s scaled, as traced in "
                                  f"{xc.label()}")
    return best


BOUNDS = (repeated_kernels, same_model_kernels, pipelined_model_kernels, model_flops,
          pipeline_chain, twin_pipeline_chain)


def enclosing(table: dict):
    """A function of a module's fqn: the value `table` (fqn -> value) gives its outermost
    enclosing module (itself included), None where none is in it; cached per module, as the
    figures below ask it once per op."""
    found: dict = {}

    def lookup(module):
        if module not in found:
            parts = (module or "").split(".")
            found[module] = next((table[".".join(parts[:k])] for k in range(1, len(parts) + 1)
                                  if ".".join(parts[:k]) in table), None)
        return found[module]

    return lookup


def block_floors(q, blocks: list) -> tuple:
    """((forward, backward's own, backward's recomputed), ...): for each block (fqns, in the
    model's order: evaluate's transformer blocks), seconds of the compute stream's kernels alone
    that a one-micro-batch step runs for it in forward and backward (q: the rank's Profile,
    timed by the eager model), as twin_pipeline_chain reads them: a forward op (recomputed
    too) by its module, a backward op by the module of its forward op; FSDP2's own kernels,
    the collectives and other streams' ops left out."""
    from ..capture.records import BACKWARD, FORWARD

    comm = {c.op for c in q.collectives}
    module_of_op = {op.index: op.module for op in q.ops}
    block = enclosing({fqn: i for i, fqn in enumerate(blocks)})   # module -> block index

    figures = [[0.0, 0.0, 0.0] for _ in blocks]
    kernels, prices = q.kernels, q.kernel_prices
    for i, op in enumerate(q.ops):
        if op.phase not in (FORWARD, BACKWARD) or op.index in comm or op.record.stream or \
                op.record.name.startswith("fsdp.") or kernels[i] is None:
            continue
        forward = op.phase == FORWARD or op.recompute
        b = block(op.module if forward else module_of_op.get(op.forward_op))
        if b is None:
            continue
        column = 0 if op.phase == FORWARD else 2 if op.recompute else 1
        figures[b][column] += prices[i] * op.runs
    return tuple(tuple(f) for f in figures)


def action_floors(q) -> tuple:
    """(first forward, last backward's own, last backward's recomputed, all actions' own, all
    actions' recomputed): seconds of the compute stream's kernels alone in a pipelined rank's
    compute actions (each forward and backward its schedule ran, distributed/pipeline.py's
    action_segments: a repeated block's once per run), as pipeline_chain reads them (q: the
    rank's Profile, timed by the eager model). Each kernel at its price alone: the schedule's
    action lasts at least that (action_seconds sums the time model's seconds of its ops).
    FSDP2's own kernels are left out (pipeline_chain reads other data-parallel splits too)."""
    from ..distributed.pipeline import action_segments

    comm = {c.op for c in q.collectives}
    position = {op.record.index: i for i, op in enumerate(q.ops)}
    kernels, prices = q.kernels, q.kernel_prices
    actions = []   # (phase, own, recomputed)
    for seg, _ in action_segments(q):
        own = again = 0.0
        for i in seg.ops:
            k = position.get(i)
            op = None if k is None else q.ops[k]
            if op is None or op.index in comm or op.record.stream or \
                    op.record.name.startswith("fsdp.") or kernels[k] is None:
                continue
            t = prices[k]
            if op.recompute:
                again += t
            else:
                own += t
        actions.append((seg.phase, own, again))
    forwards = [a for a in actions if a[0] == "forward"]
    backwards = [a for a in actions if a[0] != "forward"]
    if not forwards or not backwards:
        return ()
    return (forwards[0][1] + forwards[0][2], backwards[-1][1], backwards[-1][2],
            sum(a[1] for a in actions), sum(a[2] for a in actions))


def stream_floors(q, waits: bool = True, ends=None) -> tuple:
    """(own, recomputed, collectives, recomputed collectives, FSDP2's own, own kernels alone,
    recomputed kernels alone, the step's ends): seconds a rank's compute stream
    provably spends in one step's forward and backward, and the busiest NCCL stream's
    collectives there (q: its Profile, timed by analysis/timing.py's eager model), as a sum that
    holds for every micro-batch running the same ops, whatever the collectives around them.

    Each kernel at its price alone (kernel_cost; a kernel overlapped by a collective is only
    slower). Plus the waits no schedule hides: a collective C whose input was last written by
    compute-stream kernel P, read first by compute-stream kernel Q. The time model starts C no
    earlier than P ends, and Q no earlier than C ends, and the compute stream runs in order, so
    from P's end to Q's start it runs only the kernels issued between them and idles for the
    rest: that stretch lasts at least max(C's seconds, their kernels' seconds). Windows that do
    not overlap add up (a tensor-parallel step's all-gathers and reduce-scatters between its
    matmuls and norms; an FSDP all-gather's input comes from its copy-in stream: no window).
    A window counts as recomputed when C is a recomputed op (another mode would not run it).
    A mode with more recompute runs the same ops with more between: each window's stretch
    only grows, so a lighter mode's own floor bounds the heavier mode's step too.

    The collectives: one process group's run on its NCCL stream one after another, each for at
    least its seconds on the interconnect, and the step lasts until they are done (timing.py:
    a collective's end closes its phase); every micro-batch repeats its forward's and
    backward's collectives (FSDP2 gathers again after resharding and reduces every
    micro-batch's gradients: tapescope never turns gradient sync off).

    The sixth and seventh figures leave the waits out (pipelined_model_kernels reads them).
    The eighth: step_ends (what the step runs once: the optimizer's kernels and the waits at
    the step's two ends), outside the windows counted here; 0 with waits=False.

    waits=False: the kernels alone, for a pipelined step, whose time is the schedule's
    (distributed/pipeline.py: each rank's actions as long as its trace says, waiting on the
    stages they depend on), not this stream model's.
    ends: what gives the eighth figure from (q, the windows counted) (default step_ends; the
    search's figures add fsdp_stretches, which must not overlap them either)."""
    from ..capture.records import BACKWARD, FORWARD

    comm = {c.op: c.seconds for c in q.collectives}
    on_stream: dict = {}      # (NCCL stream, recomputed) -> collective seconds in fwd / bwd
    for c in q.collectives:
        op = q.ops[c.op] if c.op < len(q.ops) and q.ops[c.op].index == c.op else None
        if op is not None and op.phase in (FORWARD, BACKWARD):
            key = (c.stream, op.recompute)
            on_stream[key] = on_stream.get(key, 0.0) + c.seconds * op.runs
    kernels, prices = q.kernels, q.kernel_prices
    price: dict = {}          # position -> seconds alone, compute-stream kernels in fwd / bwd
    writer: dict = {}         # storage -> position of the compute kernel that last wrote it
    pending: list = []        # (P, its output storages not yet read, seconds, recomputed)
    windows: list = []        # (P, Q, collective seconds, recomputed)
    for i, op in enumerate(q.ops):
        if op.index in comm:
            ps = [writer.get(r.storage) for r in op.inputs]
            ps = [x for x in ps if x is not None]
            outs = {r.storage for r in op.outputs}
            for w in pending:   # a later collective's write decides when its readers start
                w[1].difference_update(outs)
            if op.phase in (FORWARD, BACKWARD) and ps and \
                    q.ops[max(ps)].phase in (FORWARD, BACKWARD):
                pending.append((max(ps), {r.storage for r in op.outputs},
                                comm[op.index] * op.runs, op.recompute))
            for r in op.outputs:
                writer.pop(r.storage, None)
            continue
        kernel = kernels[i] is not None
        if not kernel or op.record.stream:
            if kernel:
                for r in op.outputs:
                    writer.pop(r.storage, None)
            continue
        if op.phase in (FORWARD, BACKWARD):
            price[i] = prices[i] * op.runs
            reads = {r.storage for r in op.inputs}
            for w in [w for w in pending if w[1] & reads]:
                pending.remove(w)
                windows.append((w[0], i, w[2], w[3]))
        else:
            pending.clear()   # a window leaving forward and backward does not count
        for r in op.outputs:
            writer[r.storage] = i
    own = sum(t for i, t in price.items() if not q.ops[i].recompute)
    # FSDP2's own kernels on the compute stream (its copy-out into the unsharded parameters):
    # their sizes follow the shard degree's padding, the model's do not
    data_parallel = sum(t for i, t in price.items() if not q.ops[i].recompute
                        and q.ops[i].record.name.startswith("fsdp."))
    again = sum(t for i, t in price.items() if q.ops[i].recompute)
    positions = list(price)   # ascending
    running = [0.0]
    for i in positions:
        running.append(running[-1] + price[i])
    alone = (own, again)
    if not waits:
        return own, again, 0.0, 0.0, data_parallel, *alone, 0.0
    last = -1
    counted = []              # (P, Q) of the windows counted
    for p, qi, seconds, recomputed in sorted(windows, key=lambda w: (w[1], w[0])):
        if p < last:
            continue   # overlaps a window already counted
        between = running[bisect.bisect_left(positions, qi)] - \
            running[bisect.bisect_right(positions, p)]
        idle = max(0.0, seconds - between)
        if recomputed:
            again += idle
        else:
            own += idle
        last = qi
        counted.append((p, qi))
    streams = {s for s, _ in on_stream}
    busiest = max(streams, key=lambda s: on_stream.get((s, False), 0.0), default=None)
    collectives = on_stream.get((busiest, False), 0.0)
    # with the same mode's recomputed collectives: the busiest stream counting them
    both = max((on_stream.get((s, False), 0.0) + on_stream.get((s, True), 0.0)
                for s in streams), default=0.0)
    return own, again, collectives, both - collectives, data_parallel, *alone, \
        (ends or step_ends)(q, counted)


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


# ---- the step's two ends: FSDP2's first all-gather, its last reduction, the optimizer ----------

def step_ends(q, counted=()) -> float:
    """Seconds the compute stream provably spends once per step outside the forward and
    backward figures of `stream_floors`: the optimizer's kernels, and the waits at the step's
    two ends for collectives that move parameters or gradients (FSDP2's), whose sizes do not
    depend on the micro-batch (q: a rank's Profile timed by analysis/timing.py's eager model;
    counted: (P, Q) of the windows stream_floors counted, which these must not overlap).

    Why each part holds (analysis/timing.py's schedule):
    - the optimizer's compute-stream kernels run after the backward's on the in-order compute
      stream, each at least its price alone, and they update the parameters' shards: the same
      ops at the same shapes for every micro-batch size, count and checkpointing mode of one
      layout.
    - a chain: the time model starts a side-stream op (FSDP2's copy-in and reduce-scatter
      streams) no earlier than the previous op of its stream, the ops that wrote its inputs and
      the ops its events mark end; a collective no earlier than the previous collective of its
      NCCL stream, the side stream it is issued on, its inputs' writers and its events; a
      compute kernel no earlier than its inputs' writers and its events. So along a chain of
      such ops from compute kernel P (or from the step's start) to compute kernel Q, Q starts
      no earlier than P's end plus every chained op's seconds (a collective's alone, a side
      kernel's price), and the compute stream, in order, runs only the kernels issued between
      P and Q in that stretch: it lasts at least max(chain, those kernels), the same argument
      as stream_floors' windows, through the copy-in stream, the NCCL stream's order and the
      events FSDP2 records, which stream_floors' windows do not follow.
    - the head: the step's first forward kernels wait for FSDP2's first all-gather (nothing
      before it can hide it): from the step's start to the first compute kernel a chain
      reaches; the tail: from the kernel that wrote the last reduce-scatter's input (FSDP2's
      chunk_cat) to the optimizer's first kernel that waits for the reduced gradients.
    Only chains of parameter-sized ops count (an `fsdp.` op, or an op whose every input was
    written by such an op or is a parameter's, gradient's or optimizer state's storage): FSDP2
    gathers parameters and reduces gradients, the same bytes whatever the micro-batch, so a
    smaller micro-batch of the same layout waits as long, while the kernels between shrink
    (kernel_cost prices a kernel from its FLOPs and bytes, both non-decreasing with the batch:
    max(FLOPs / rate, bytes / bandwidth) + a launch, the fill term capped, a GEMM's tile waves
    rounding up), so its idle there is at least this trace's. The kernels between the tail's
    P and Q are the last micro-batch's after its final reduce-scatter copy-in and the
    optimizer's before its first read: FSDP2 accumulates a later micro-batch's reduced
    gradients on its reduce-scatter stream, so they do not change with the micro-batch count.
    Not when the last micro-batch stands for several proven repeats (`runs` > 1: the time
    model runs its ops that many times as long, and another candidate's trace may repeat it
    fewer times).
    A window that overlaps one stream_floors counted is not counted (its idle is in the
    figure already)."""
    from ..capture.records import BACKWARD, FORWARD, OPTIMIZER

    START = -1
    owner, kernels, prices = q.trace.storage_owner, q.kernels, q.kernel_prices
    comm = {c.op: (c.seconds, c.stream) for c in q.collectives}
    price: dict = {}          # position -> seconds alone, every compute-stream kernel
    total = [0.0]             # the compute stream's kernels so far
    before: dict = {}         # position -> the compute stream's kernels before it
    position: dict = {}       # record index -> position, compute-stream kernels
    writer: dict = {}         # storage -> ("c", position) or ("n", record index)
    sized: set = set()        # writers (as in `writer`) of parameter-sized tensors
    reach: dict = {}          # record index -> {P (position or START): longest chain to its end}
    alias: dict = {}          # record index of an op launching nothing -> what its end waits for
    last_side: dict = {}      # stream -> record index of its last op
    last_nccl: dict = {}      # NCCL stream -> record index of its last collective
    last_compute = None       # position of the compute stream's last kernel
    held: dict = {}           # stream -> marks of its no-kernel ops, for its next kernel
    backward = False          # a backward kernel ran: the first forward is over
    last_forward = max((i for i, op in enumerate(q.ops) if op.phase == FORWARD), default=-1)
    head = tail = 0.0

    def refs(marks) -> list:
        out = []
        for m in marks:
            out.extend([("c", position[m])] if m in position else alias.get(m, [("n", m)]))
        return out

    def chains(preds) -> dict:
        """{P: longest chain} over the predecessors: a compute kernel starts a chain, a
        parameter-sized side op or collective extends its own, other ops give none (leaving
        an edge out only shortens a chain). The step's start and the 3 latest P are kept."""
        out: dict = {}
        for kind, x in preds:
            if kind == "c":
                out[x] = max(out.get(x, 0.0), 0.0)
            elif x in reach:
                for p, t in reach[x].items():
                    out[p] = max(out.get(p, 0.0), t)
        if len(out) > 4:
            keep = {START, *sorted(p for p in out if p != START)[-3:]}
            out = {p: t for p, t in out.items() if p in keep}
        return out

    def parameter_sized(op) -> bool:
        if op.record.name.startswith("fsdp."):
            return True
        written = {r.storage for r in op.outputs}   # a collective's output buffer is an argument
        return all(r.storage in owner or r.storage in written or writer.get(r.storage) in sized
                   for r in op.inputs)

    def between(p, i) -> float:
        return before[i] - (0.0 if p == START else before[p] + price[p])

    def extend(op, preds, seconds) -> None:
        rec = op.record
        if parameter_sized(op):
            sized.add(("n", rec.index))
            reach[rec.index] = {p: t + seconds
                                for p, t in (chains(preds) or {START: 0.0}).items()}
        for r in op.outputs:
            writer[r.storage] = ("n", rec.index)

    for i, op in enumerate(q.ops):
        rec = op.record
        stream = rec.stream
        if op.index in comm:
            seconds, nccl = comm[op.index]
            preds = [writer[r.storage] for r in op.inputs if r.storage in writer]
            preds += refs((*held.pop(stream, ()), *rec.waits))
            if nccl in last_nccl:
                preds.append(("n", last_nccl[nccl]))
            if stream and stream in last_side:
                preds.append(("n", last_side[stream]))
            extend(op, preds, seconds * op.runs)
            last_nccl[nccl] = rec.index
            if stream:
                last_side[stream] = rec.index
            continue
        if kernels[i] is None:
            # its end: its stream's last kernel and its events (timing.py holds them for the
            # stream's next kernel)
            base = [("c", last_compute)] if not stream and last_compute is not None else \
                [("n", last_side[stream])] if stream in last_side else []
            alias[rec.index] = base + refs(rec.waits)
            if rec.waits:
                held.setdefault(stream, []).extend(rec.waits)
            continue
        seconds = prices[i] * op.runs
        preds = [writer[r.storage] for r in op.inputs if r.storage in writer]
        preds += refs((*held.pop(stream, ()), *rec.waits))
        if stream:
            if stream in last_side:
                preds.append(("n", last_side[stream]))
            extend(op, preds, seconds)
            last_side[stream] = rec.index
            continue
        # a compute-stream kernel: the chains that reach it close windows
        before[i] = total[0]
        backward = backward or op.phase == BACKWARD
        for p, t in chains([w for w in preds if w[0] == "n"]).items():
            if p == START and op.phase == FORWARD and not backward and \
                    all(cp >= i for cp, _ in counted):
                head = max(head, t - between(START, i))
            elif p != START and op.phase == OPTIMIZER and last_forward < p and \
                    q.ops[p].phase == BACKWARD and q.ops[p].runs == 1 and \
                    all(cq <= p for _, cq in counted):
                tail = max(tail, t - between(p, i))
        price[i] = seconds
        total[0] += seconds
        position[rec.index] = i
        last_compute = i
        if rec.name.startswith("fsdp."):
            sized.add(("c", i))   # FSDP2's copy-in of gradients (chunk_cat), copy-out
        for r in op.outputs:
            writer[r.storage] = ("c", i)
    optimizer = sum(t for i, t in price.items() if q.ops[i].phase == OPTIMIZER)
    return optimizer + max(0.0, head) + max(0.0, tail)


def kernels_and_step_ends(c: Candidate, known: Known) -> Bound | None:
    """`repeated_kernels`' floor plus what the step runs once (step_ends: the optimizer's
    kernels, the waits for FSDP2's first all-gather and its last reduction), from a trace of
    the same layout and schedule in the same checkpointing mode at a micro-batch as large or
    larger (a whole multiple: `_per_micro_batch_share`). The two parts lie on disjoint
    stretches of the compute stream (step_ends leaves out a window that overlaps one of
    stream_floors'); the step's ends are the same ops whatever the micro-batch count, their
    collectives move parameters and gradients (the same bytes at any micro-batch size) and
    the kernels between them only shrink with the micro-batch (step_ends' docstring)."""
    best = None
    for x in known.by_micro_batch.get(_same_kernels(c), ()):
        if x.candidate.checkpointing != c.checkpointing or not x.step_ends:
            continue
        share = _per_micro_batch_share(c, x.candidate)
        if share is None:
            continue
        seconds = max(max(share * (own + again) + ends, share * (comm + comm_again))
                      for (own, again, comm, comm_again, *_), ends
                      in zip(x.kernel_seconds, x.step_ends))
        if best is None or seconds > best.seconds:
            what = "one micro-batch's" if x.candidate.micro_batch == c.micro_batch else \
                f"micro-batch {x.candidate.micro_batch}'s"
            best = Bound(seconds, f"{c.steps} x {what} forward and backward kernels, scaled, "
                                  f"the optimizer and the waits at the step's ends, as traced "
                                  f"in {x.candidate.label()}")
    return best


BOUNDS = (*BOUNDS, kernels_and_step_ends)


# ---- a pipeline's first and last stage: what they run besides their blocks ---------------------

def edge_floors(q, blocks: list, first: tuple, last: tuple, loss_kernels=None) -> tuple:
    """(first stage's forward, its backward, last stage's forward, its backward, the loss's
    forward, its backward): seconds of the compute stream's kernels alone that a one-micro-batch
    unpipelined step (q: the rank's Profile, timed by the eager model) runs outside its blocks
    (`blocks`, as block_floors reads them), by the pipeline stage that runs them, as
    twin_pipeline_ends reads them: a forward op of a module in `first` (the modules
    distributed/pipeline.py's split_blocks puts on the first stage alone: the embeddings), or
    in `last` (the last stage's alone: the final norm, the output layer), and a backward op of
    such a forward op (Op.forward_op, as block_floors reads a block's); recomputed ops, FSDP2's
    own kernels, the collectives and other streams' ops left out, as in block_floors.

    The loss: the forward ops after the last stage's modules' last op that are in none of the
    model's modules (the model's own code given its targets, or the loss function's), and the
    backward ops of those that launch a kernel, counted only when those kernels are, op for op
    at the same shapes and dtypes, the ones `loss_kernels(shape, dtype, device)` says a
    pipeline's last stage runs for its loss on logits like the last stage's output (evaluate's
    _pipeline_loss_kernels: pipeline_loss of the same loss_fn): an unpipelined step's loss may
    be other code than the pipeline's. The same forward ops at the same shapes record the same
    autograd nodes, so their backward ops are the same too. 0 for both otherwise. Where the
    last stage's output module hands its logits on through output hooks that launch kernels
    (TP's ColwiseParallel gathering the vocabulary shards: an all-gather and a `cat`, which
    the trace records in no module), the loss is the kernels after the hook's last one,
    checked the same way against `loss_kernels` on that kernel's output; the hook's kernels
    are counted in no part. (The pipeline's last stage runs the same module with the same
    hooks, so its logits are that output: test_search.py's
    test_tp_twin_loss_is_the_pipelines_loss measures it.)"""
    from ..capture.records import BACKWARD, FORWARD

    comm = {c.op for c in q.collectives}
    storages, kernels, prices = q.trace.storages, q.kernels, q.kernel_prices
    parts = {**{b: "block" for b in blocks}, **{f: "first" for f in first},
             **{f: "last" for f in last}}
    where = enclosing(parts)   # module -> "block" / "first" / "last" / None

    def kernel(op) -> bool:
        return op.phase in (FORWARD, BACKWARD) and op.index not in comm and \
            not op.record.stream and not op.record.name.startswith("fsdp.") and \
            not op.recompute and kernels[op.index] is not None

    last_output = max((i for i, op in enumerate(q.ops) if op.phase == FORWARD and
                       not op.recompute and where(op.module) == "last" and op.outputs),
                      default=None)
    loss = [op for op in q.ops[last_output + 1:] if op.phase == FORWARD and not op.recompute
            and where(op.module) is None and kernel(op)] if last_output is not None else []
    counted = set()
    # the logits: the last stage's module's output, or, where the module's output hooks run
    # kernels after its last op (a TP plan's ColwiseParallel with Replicate outputs: an
    # all-gather of the vocabulary shards and the `cat` joining them, recorded in no module),
    # the output of one of those kernels; the loss is then the kernels after it, and the
    # hook's own are counted in no part (a floor may leave kernels out)
    splits = [(q.ops[last_output].outputs[0] if last_output is not None else None, loss)]
    splits += [(op.outputs[0], loss[i + 1:]) for i, op in enumerate(loss) if op.outputs]
    for logits, rest in splits if loss and loss_kernels is not None else ():
        if not rest or not 0 <= logits.storage < len(storages):
            continue
        expected = loss_kernels(tuple(int(d) for d in logits.shape), logits.dtype,
                                storages[logits.storage].device)
        seen = sorted((op.record.name, _kinds(op.inputs), _kinds(op.outputs)) for op in rest)
        if expected == seen:
            counted = {op.index for op in rest}
            break
    figures = {part: [0.0, 0.0] for part in ("first", "last", "loss")}
    for op in q.ops:
        if not kernel(op):
            continue
        forward = op.phase == FORWARD
        origin = op if forward else \
            q.ops[op.forward_op] if op.forward_op is not None else None
        if origin is None:
            continue
        part = "loss" if origin.index in counted else where(origin.module)
        if part in figures:
            figures[part][0 if forward else 1] += prices[op.index] * op.runs
    return (*figures["first"], *figures["last"], *figures["loss"])


def _kinds(refs) -> tuple:
    """(shape, dtype) of each tensor, sorted: as evaluate's _tensor_kinds writes a fake run's."""
    return tuple(sorted((tuple(int(d) for d in r.shape), str(r.dtype)) for r in refs))


def twin_pipeline_ends(c: Candidate, known: Known) -> Bound | None:
    """`twin_pipeline_chain` with what the first and the last stage run besides their blocks
    (Outcome.edge_seconds, edge_floors: the embedding on the first; the final norm, the output
    layer and the loss on the last), and a second chain that ends on the stage's own rank: step
    >= max over stages s of
      (i)  sum_{j<s} (F_j + B_j) + m (F_s + B_s)
      (ii) sum_{j<s} F_j + m (F_s + B_s) + m L   (L: the loss's forward, on the last stage only)
    with F_j, B_j the twin's forward and backward kernels of the blocks stage j holds
    (block_range, as twin_pipeline_chain) plus, on stage 0, the first stage's modules' and, on
    the last, the last stage's modules' and the loss's backward; from the same twins (one
    micro-batch, the same TP / CP split, checkpointing as light or lighter, a micro-batch as
    large or larger, scaled), the least of the twin's rank classes figure by figure.

    Why, on distributed/pipeline.py's schedule_time (a pipelined candidate's step): the
    first stage's forward action runs the stage module's forward (split_blocks: its blocks
    and the modules before the block list), its backward action that module's backward; the
    last stage's forward runs its blocks and the modules after the list, and its backward
    action (`backward_one_chunk`, stage_backward from the loss) the loss's backward and that
    module's. Each op is the twin's at the twin's shapes, priced from the op alone
    (`pipelined_model_kernels`' (2) and (3)), and the loss's are the ops pipeline_loss runs
    (edge_floors checks them op for op), so F_j and B_j bound every forward and backward
    action of stage j, and (i) is pipeline_chain's (1)-(3) over them (rank 0 ends with the
    last micro-batch's backward; the rest of its step only adds). (ii): rank s's first action
    starts no earlier than sum_{j<s} F_j (micro-batch 0's forwards through the stages before
    it, p2p >= 0); from there it runs its actions one after another, so it ends them no
    earlier than that start plus their seconds A_s, and then schedule_time adds the rest of
    its step, max(0, T_s - A_s), T_s the rank's own eager step (timing.py): the step is at
    least start + T_s. T_s is at least the rank's compute-stream kernels, each at its price
    alone (the stream runs them in order; a kernel a collective overlaps only runs longer):
    its actions' m (F_s + B_s); on the last stage, the loss's forward of every micro-batch,
    which torch's schedule computes between the stage's forward and backward actions
    (`_maybe_compute_loss`, outside both); and the optimizer's kernels over the stage's
    parameter shards (Outcome.optimizer_seconds; _stage_optimizer's proof). FSDP2's own
    kernels and its waits, gradient accumulation and the p2p transfers are left out.

    Only the one-stage-a-rank schedules, as pipeline_chain."""
    if c.layout.pp == 1 or c.schedule not in ("gpipe", "1f1b"):
        return None
    best = None
    pp, m = c.layout.pp, c.steps
    for x, same_mode, scale in _unpipelined_twins(c, known):
        if not x.block_seconds or not x.edge_seconds:
            continue
        blocks = [tuple(min(figures) for figures in zip(*per_class))
                  for per_class in zip(*x.block_seconds)]
        n = len(blocks)
        if n < pp:
            continue
        first_f, first_b, last_f, last_b, loss_f, loss_b = \
            (scale * min(v) for v in zip(*x.edge_seconds))
        forwards = backwards = seconds = 0.0
        for s in range(pp):
            span = range(s * n // pp, (s + 1) * n // pp)
            held = [blocks[b] for b in span]
            parts = {*span, *((-1,) if s == 0 else ()), *((-2,) if s == pp - 1 else ())}
            optimizer = min((_stage_optimizer(f, parts, c.layout.shard_degree,
                                              x.candidate.layout.shard_degree)
                             for f in x.optimizer_seconds), default=0.0)
            forward = scale * sum(f for f, _, _ in held)
            backward = scale * sum(own + (again if same_mode else 0.0) for _, own, again in held)
            if s == 0:
                forward, backward = forward + first_f, backward + first_b
            if s == pp - 1:
                forward, backward = forward + last_f, backward + last_b + loss_b
            work = m * (forward + backward)
            seconds = max(seconds, forwards + backwards + work,
                          forwards + work + optimizer + (m * loss_f if s == pp - 1 else 0.0))
            forwards += forward
            backwards += backward
        if best is None or seconds > best.seconds:
            best = Bound(seconds, f"the pipeline's critical chain over its stages' blocks, "
                                  f"embedding, output layer and loss, micro-batch "
                                  f"{x.candidate.micro_batch}'s scaled, as traced in "
                                  f"{x.candidate.label()}")
    return best


def optimizer_floors(q, blocks: list, first: tuple, last: tuple) -> tuple:
    """(seconds, ((where, rows, rest, count), ...)): the compute stream's optimizer kernels
    alone of an unpipelined step (q: the rank's Profile, timed by the eager model) that run
    over one table of parameter shards, each tensor list of the kernel the same table, and the
    table: each parameter's local shard as (its stage part: -1 a module of `first`, -2 of
    `last`, i block i, None other; its rows; the elements of a row; how many such), counts
    divided by their greatest common divisor. A tensor is a parameter's when the trace says
    so (its gradient and optimizer state too: Trace.storage_owner), or when a foreach kernel
    made it as the j-th output from the j-th tensor of its first list (AdamW's sqrt of its
    second moments); the first list's tensors each of a storage of its own (FSDP2's reduced
    gradients are views of one buffer, owned by its first parameter); a later list's j-th
    tensor is the first list's j-th parameter's when it has its shape (foreach lists are
    index-aligned). A kernel over other tensors or another table is left out (the CPU step
    counters launch none). twin_pipeline_ends reads it."""
    from math import gcd

    from ..capture.records import OPTIMIZER

    comm = {c.op for c in q.collectives}
    owner, kernels, prices = q.trace.storage_owner, q.kernels, q.kernel_prices
    # a parameter's fqn -> its stage part (a parameter's name is never a module's)
    part = enclosing({**{b: i for i, b in enumerate(blocks)}, **dict.fromkeys(first, -1),
                      **dict.fromkeys(last, -2)})
    shard_of: dict = {}   # storage -> (where, rows, rest) of the parameter shard it stands for

    def shard(r):
        if r.storage not in shard_of and r.storage in owner:
            shape = [int(d) for d in r.shape]
            fqn = owner[r.storage]
            if shape and shape[0]:
                elements = 1
                for d in shape:
                    elements *= d
                shard_of[r.storage] = (part(fqn), shape[0], elements // shape[0])
        return shard_of.get(r.storage)

    base, seconds = None, 0.0
    for i, op in enumerate(q.ops):
        if op.phase != OPTIMIZER or op.index in comm or op.record.stream or kernels[i] is None:
            continue
        lists = [a for a in op.record.args if isinstance(a, (list, tuple)) and a
                 and all(hasattr(t, "storage") for t in a)]
        if not lists:
            continue   # a single-tensor optimizer's kernel (foreach=False): no table
        # foreach lists are index-aligned: the j-th tensor of a later list, of the first's
        # shape, is the same parameter's (its gradient, its state)
        # (views of one buffer, FSDP2's reduced gradients, share a storage, whose owner is
        # the first's: the first list must be tensors of their own)
        if len({t.storage for t in lists[0]}) < len(lists[0]):
            continue
        first_list = [(shard(t), tuple(t.shape)) for t in lists[0]]
        keys = [[k for k, _ in first_list]] + \
            [[k if len(a) == len(first_list) and tuple(t.shape) == shape else None
              for t, (k, shape) in zip(a, first_list)] + [None] * (len(a) - len(first_list))
             for a in lists[1:]]
        if any(k is None for a in keys for k in a) or \
                len(op.inputs) != sum(len(a) for a in lists):
            continue
        if len(op.outputs) == len(keys[0]):   # the j-th output of the j-th first-list tensor
            for out, key in zip(op.outputs, keys[0]):
                shard_of.setdefault(out.storage, key)
        table: dict = {}
        for key in (k for a in keys for k in a):
            table[key] = table.get(key, 0) + 1
        common = 0
        for n in table.values():
            common = gcd(common, n)
        table = tuple(sorted(((*k, n // common) for k, n in table.items()),
                             key=lambda e: (e[0] is None, e[0] or 0, e[1:])))
        if base is None or table == base:
            base = table
            seconds += prices[i] * op.runs
    return (seconds, base or ())


def _stage_optimizer(figure, stage_parts: set, shard: int, twin_shard: int) -> float:
    """A pipeline rank's optimizer kernels, at least, from a twin's optimizer_floors figure:
    each kernel at the share of the twin's elements its stage's shards hold, at most 1.

    Why: the rank runs the same optimizer over its stage's parameters' shards (the same
    optimizer code, their dtype: the same kernels, each over its elements; torch groups a
    foreach call's tensors by device and dtype, and a twin kernel over another table is left
    out), and kernel_cost prices a kernel as max(FLOPs / (rate x fill), bytes / bandwidth) +
    a launch, the fill min(1, FLOPs / saturation): with FLOPs and bytes both a share a <= 1 of
    another's (a foreach kernel's are per element), each term is at least a times the other's.
    A shard: FSDP2 splits dim 0 into the shard degree's torch.chunk chunks, the lowest rank
    (the one schedule_time reads) holding ceil(rows / degree); a twin shard of r rows came
    from rows >= (r - 1) x twin degree + 1 (each rank's chunk is at most ceil), so the rank's
    shard has at least ceil(((r - 1) x twin degree + 1) / degree) rows of the same width (TP
    splits both alike: the same TP plan)."""
    seconds, table = figure
    if not table:
        return 0.0
    total = held = 0
    for where, rows, rest, count in table:
        total += count * rows * rest
        if where in stage_parts:
            held += count * -(-((rows - 1) * twin_shard + 1) // shard) * rest
    return seconds * min(1.0, held / total) if total else 0.0


BOUNDS = (*BOUNDS, twin_pipeline_ends)


# ---- another FSDP split of the same model from its twin: FSDP2's own waits re-priced ----------

@dataclass(frozen=True)
class FsdpStretches:
    """What one rank's trace with FSDP2 says about the waits FSDP2's collectives put on its
    compute stream, in a form another data-parallel split of the same model re-prices on its
    own groups (replicated_twin; made by fsdp_stretches). Kernel groups are tuples of (price
    alone x runs, floor): a floor is what the kernel does with one row less of every shard,
    (name, op class, FLOPs, bytes, dtype), or None where its tensors are not all shards."""

    shard_degree: int        # the twin's FSDP2 shard group
    optimizer: tuple         # the optimizer's compute-stream kernels
    copy_in: tuple           # the copy-in stream's shard copies before the first all-gather
    gathered: int            # the first all-gather's unpadded bytes (0: not provable)
    head: tuple              # kernels issued before its first reader: (fixed, shard-sized) s
    reduced: int             # the last reduce-scatter's unpadded bytes (0: not provable)
    post_reduce: tuple       # its post-reduce kernels the optimizer's gradient read waits for
    tail: tuple              # kernels between its chunk_cat and that read: (backward fixed,
                             # backward shard-sized, optimizer) s
    one_stream: bool         # FSDP2's all-gathers and reduce-scatters share one NCCL stream
    # kernels between the first micro-batch's last chunk_cat and the next forward's first
    # kernel when that kernel waits for the post-reduce stream (fixed, shard-sized) s; () not
    boundary: tuple = ()

    @classmethod
    def from_dict(cls, d: dict) -> "FsdpStretches":
        def kernels(x):
            return tuple((t, tuple(f) if f else None) for t, f in x)
        return cls(d["shard_degree"], kernels(d["optimizer"]), kernels(d["copy_in"]),
                   d["gathered"], tuple(d["head"]), d["reduced"], kernels(d["post_reduce"]),
                   tuple(d["tail"]), bool(d["one_stream"]), tuple(d.get("boundary", ())))


def _kernel_floor(op, k, shard_shapes) -> tuple | None:
    """(name, op class, FLOPs, bytes, dtype) of `op`'s kernel `k` (analysis.kernel_cost.Kernel)
    with one row less of each of its tensors, when every tensor has a shard's shape (more than
    one row) and the kernel is elementwise (its FLOPs and bytes are sums over its tensors'
    elements): what it does at least on a rank whose shards hold r x (these rows - 1) rows or
    more, times r."""
    from ..analysis.op_classes import op_class

    refs = (*op.inputs, *op.outputs)
    if not refs or op_class(op.record.func) in ("matmul", "attention", "convolution") or \
            any(r.shape not in shard_shapes or r.shape[0] < 2 for r in refs):
        return None
    factor = min(1 - 1 / r.shape[0] for r in refs)
    return (k.name, k.op_class, int(k.flops * factor), int(k.bytes * factor),
            str(k.dtype).removeprefix("torch."))


def fsdp_stretches(q, counted=()) -> FsdpStretches | None:
    """FsdpStretches of a rank's trace with FSDP2 (q: its Profile, timed by the eager model;
    counted: stream_floors' windows), None without FSDP2's collectives:

    - the head: the step's first FSDP2 all-gather (its input written by
      `fsdp.all_gather_copy_in`), the copy-in stream's kernels before it that read only
      parameter shards (`_foreach_copy_`), its unpadded bytes (the outputs of
      `fsdp.split_with_sizes_copy`, which drops the padding: the first compute kernel to read
      the gathered buffer) and the compute kernels issued before that reader.
    - the tail: the step's last FSDP2 reduce-scatter (its input written by `fsdp.chunk_cat`,
      P), its unpadded bytes (chunk_cat's inputs, the unsharded gradients, at the reduced
      dtype), the optimizer's first compute kernel Q that reads what it or a side-stream op
      after it (FSDP2's post-reduce cast, view or accumulation) wrote, those side-stream
      kernels on the stream of the last of them Q reads, and the compute kernels between P and
      Q: the backward's and the optimizer's apart.
    - the boundary between micro-batches (with two or more, _boundary_wait).
    "Shard-sized" compute kernels touch a parameter's, gradient's or optimizer state's storage
    (their sizes follow the shard), the others are the model's and FSDP2's copy-out and
    chunk_cat of whole parameters. A head or tail whose stretch overlaps a window
    stream_floors counted is left out (bytes 0): its idle is in kernel_seconds already."""
    from ..capture.records import FORWARD, OPTIMIZER

    owner, kernels, prices = q.trace.storage_owner, q.kernels, q.kernel_prices
    comm = {c.op: c for c in q.collectives}
    writer: dict = {}      # storage -> position of the op that last wrote it
    price: dict = {}       # position -> seconds x runs, compute-stream kernels
    side: dict = {}        # position -> seconds x runs, side-stream kernels
    shard_sized: set = set()
    shard_shapes = {r.shape for op in q.ops for r in (*op.inputs, *op.outputs)
                    if r.storage in owner and r.shape}
    gather = reduce = None  # (position, Collective, position of its input's fsdp writer)
    for i, op in enumerate(q.ops):
        rec = op.record
        if op.index in comm:
            c = comm[op.index]
            src = {q.ops[w].record.name.split(".")[1]: w
                   for w in (writer.get(r.storage) for r in op.inputs) if w is not None
                   and q.ops[w].record.name.startswith("fsdp.")}
            if c.kind == "all_gather" and "all_gather_copy_in" in src and \
                    gather is None and op.phase == FORWARD:
                gather = (i, c, src["all_gather_copy_in"])
            elif c.kind == "reduce_scatter" and "chunk_cat" in src:
                reduce = (i, c, src["chunk_cat"])
        elif kernels[i] is not None:
            seconds = prices[i] * op.runs
            (side if rec.stream else price)[i] = seconds
            if any(r.storage in owner for r in (*op.inputs, *op.outputs)):
                shard_sized.add(i)
        for r in op.outputs:
            writer[r.storage] = i
    if gather is None or reduce is None:
        return None
    g_at, g, g_src = gather
    r_at, rs, p = reduce
    if g.group_size != rs.group_size or g.group_size < 2:
        return None

    def kernel_group(positions) -> tuple:
        return tuple((price[i] if i in price else side[i],
                      _kernel_floor(q.ops[i], kernels[i], shard_shapes)) for i in positions)

    # the head: the gathered buffer's first compute-stream reader drops the padding
    out = {r.storage for r in q.ops[g_at].outputs}
    q_head = next((i for i in sorted(price) if i > g_at and
                   out & {r.storage for r in q.ops[i].inputs}), None)
    if q_head is None or not q.ops[q_head].record.name.startswith("fsdp.split_with_sizes_copy"):
        return None
    gathered = sum(r.nbytes for r in q.ops[q_head].outputs)
    stream = q.ops[g_src].record.stream
    copy_in = [i for i in side if i < g_src and q.ops[i].record.stream == stream and
               q.ops[i].inputs and all(r.storage in owner for r in q.ops[i].inputs
                                       if r.storage not in {o.storage for o in q.ops[i].outputs})]
    head = tuple(sum(t for i, t in price.items() if i < q_head and (i in shard_sized) == s)
                 for s in (False, True))
    if any(cp < q_head for cp, _ in counted):
        gathered = 0
    # the tail: the optimizer's first kernel reading what the last reduce-scatter wrote
    tainted = {r.storage: None for r in q.ops[r_at].outputs}   # storage -> side kernel wrote it
    q_tail = None
    for i in range(r_at + 1, len(q.ops)):
        op = q.ops[i]
        reads = {r.storage for r in op.inputs} & set(tainted)
        if i in price:
            if op.phase == OPTIMIZER and reads:
                q_tail = i
                break
        elif reads and op.record.stream:
            tainted.update({r.storage: i if i in side else tainted[next(iter(reads))]
                            for r in op.outputs})
    chunk = q.ops[p]
    written = {r.storage for r in chunk.outputs}
    numel = sum(r.numel for r in chunk.inputs if r.storage not in written)
    reduced = numel * next(r.dtype.itemsize for r in q.ops[r_at].inputs if r.storage in written)
    post = []
    if q_tail is not None:
        last = max((tainted[r.storage] for r in q.ops[q_tail].inputs
                    if tainted.get(r.storage) is not None), default=None)
        if last is not None:
            post = [i for i in side if r_at < i <= last and i in tainted.values() and
                    q.ops[i].record.stream == q.ops[last].record.stream]
    if q_tail is None or any(cq > p for _, cq in counted):
        reduced, post = 0, []
        q_tail = p + 1 if q_tail is None else q_tail
    between = [(i, t) for i, t in price.items() if p < i < q_tail]
    tail = (*(sum(t for i, t in between if q.ops[i].phase != OPTIMIZER and
                  (i in shard_sized) == s) for s in (False, True)),
            sum(t for i, t in between if q.ops[i].phase == OPTIMIZER))
    optimizer = [i for i in price if q.ops[i].phase == OPTIMIZER]
    return FsdpStretches(g.group_size, kernel_group(optimizer), kernel_group(copy_in), gathered,
                         head, reduced, kernel_group(post), tail, g.stream == rs.stream,
                         _boundary_wait(q, price, shard_sized, comm, counted))


def _boundary_wait(q, price, shard_sized, comm, counted) -> tuple:
    """(fixed, shard-sized) seconds of the compute kernels between the first micro-batch's last
    FSDP2 chunk_cat P and the second micro-batch's first compute kernel K, when K waits (its
    own events or those its stream's no-kernel ops since the last kernel hold for it) for an
    op of the post-reduce stream after that reduce-scatter (FSDP2's finalize_backward waits on
    the post-reduce events; with replicas they follow the all-reduce); () with one
    micro-batch, without such a wait, or when a window stream_floors counted overlaps P..K."""
    from ..capture.records import FORWARD

    backward_seen = False
    last = None   # (position of the reduce-scatter, P) of the latest FSDP2 reduce-scatter
    writer: dict = {}
    held: list = []
    for i, op in enumerate(q.ops):
        rec = op.record
        if op.index in comm and comm[op.index].kind == "reduce_scatter":
            ps = [writer[r.storage] for r in op.inputs if r.storage in writer
                  and q.ops[writer[r.storage]].record.name.startswith("fsdp.chunk_cat")]
            if ps:
                last = (i, ps[0])
        backward_seen = backward_seen or op.phase != FORWARD
        if i not in price:
            if not rec.stream:
                held.extend(rec.waits)
            for r in op.outputs:
                writer[r.storage] = i
            continue
        if backward_seen and op.phase == FORWARD and last is not None:
            r_at, p = last
            tainted = {r.storage for r in q.ops[r_at].outputs}
            post = set()
            for j in range(r_at + 1, i):
                o = q.ops[j]
                if o.record.stream and {r.storage for r in o.inputs} & tainted:
                    tainted |= {r.storage for r in o.outputs}
                    post.add(o.record.index)
            if post & {*held, *rec.waits} and not any(cp < i and cq > p for cp, cq in counted):
                between = [(j, t) for j, t in price.items() if p < j < i]
                return tuple(sum(t for j, t in between if (j in shard_sized) == s)
                             for s in (False, True))
            return ()
        held = []
        for r in op.outputs:
            writer[r.storage] = i
    return ()


def _group(layout, rank: int, dims: tuple) -> tuple:
    """The global ranks of `rank`'s group over the mesh dimensions `dims` of `layout`'s mesh
    (init_device_mesh's row-major layout: values/mesh.py)."""
    from itertools import product

    from ..values.mesh import mesh_spec

    spec = mesh_spec(layout.mesh)
    mine = spec.coordinate(rank)
    stride, strides = 1, {}
    for name, size in zip(reversed(spec.names), reversed(spec.sizes)):
        strides[name] = stride
        stride *= size
    varying = [(strides[n], size) for n, size in zip(spec.names, spec.sizes) if n in dims]
    base = rank - sum(mine[n] * strides[n] for n in spec.names if n in dims)
    return tuple(sorted(base + sum(i * st for i, (st, _) in zip(index, varying))
                        for index in product(*(range(size) for _, size in varying))))


def _at_least(kernels, ratio: int, gpu) -> float:
    """Seconds a rank holding shards `ratio` times the twin's runs these kernels for at least:
    each at its price in the twin (a larger shard costs no less: kernel_cost never prices
    more FLOPs or bytes lower) or its floor's work times `ratio`, priced, whichever is more."""
    import torch

    from ..analysis.kernel_cost import Kernel, kernel_time

    total = 0.0
    for seconds, floor in kernels:
        if floor is not None and ratio > 1:
            name, cls, flops, nbytes, dtype = floor
            k = Kernel(name, cls, ratio * flops, ratio * nbytes, getattr(torch, dtype))
            seconds = max(seconds, kernel_time(k, gpu)[0])
        total += seconds
    return total


def replicated_twin(c: Candidate, known: Known) -> Bound | None:
    """An unpipelined candidate from a trace of another data-parallel split of the same model
    split whose shard degree its own divides (an HSDP layout from its FSDP twin: HSDP 2 x FSDP
    2 x TP 2 from FSDP 4 x TP 2): `same_model_kernels`' floor, plus the optimizer's kernels,
    plus the waits FSDP2's collectives put on the compute stream, each collective re-priced on
    the candidate's own groups (analysis/collectives.py's collective_seconds, as the
    candidate's trace prices it) from the twin's unpadded bytes (Outcome.fsdp_stretches).

    Why, on analysis/timing.py's schedule (the chains of `step_ends`: a side-stream op starts
    after its stream's previous op, its inputs' writers and its events; a collective after its
    NCCL stream's previous collective too; a compute kernel after its inputs' writers and its
    events; the compute stream in order). The candidate runs the twin's ops with three
    differences, read off FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    foreach_reduce): its collectives run on its own groups; a parameter of d rows has
    ceil(d / s) of them at shard coordinate 0 (the rank read here, in both layouts), so with
    s dividing the twin's s_x (r = s_x / s) a shard has at most r times the twin's rows and
    at least r x (the twin's - 1), while a whole padded parameter (copy-out, chunk_cat:
    s ceil(d / s) <= s_x ceil(d / s_x) rows) is no larger; and with replicas, foreach_reduce
    all-reduces the reduce-scatter's output in place on the all-reduce stream after the
    reduce-scatter stream (wait_stream) and runs every post-reduce op (the cast, the views,
    the accumulation of a later micro-batch) there after it. kernel_cost's prices never fall
    as FLOPs and bytes grow and are subadditive over a whole multiple (`_per_micro_batch_share`),
    so a shard-sized kernel costs at least the twin's and its floor's work times r
    (_at_least), and at most r times the twin's; a collective's price grows with its bytes,
    so the unpadded bytes give a floor. Then, on the compute stream, in stretches that overlap
    neither each other nor the windows `stream_floors` counted (checked on the twin):
    - the head: the first forward's first reader of the first all-gather starts after the
      copy-in stream's shard copies (from the step's start, in order) and the all-gather:
      idle >= copies + all-gather - the kernels issued before that reader.
    - the tail: the optimizer's first kernel Q that reads the last reduce-scatter's gradients
      (FSDP2 reduces the root's in the backward's final callback, after every block's backward
      and recompute) starts after its chunk_cat P, the reduce-scatter, with replicas the
      all-reduce, and the post-reduce kernels before the last one whose output Q reads (one
      stream, in order): idle >= their sum - the kernels between P and Q.
    - each boundary between micro-batches (steps - 1 of them; tapescope never turns gradient
      sync off): the next forward's first all-gather runs on the reduce-scatter's NCCL stream
      (FSDP2 gathers and reduces on the shard group: checked on the twin) after the last
      reduce-scatter, so its first reader waits for P + reduce-scatter + all-gather; and where
      the twin's next forward's first kernel waits for the post-reduce stream (FSDP2's
      finalize_backward), for P + reduce-scatter + all-reduce. The kernels between are the
      backward's after P and the forward's before that kernel.
    The kernels between are bounded from above (the twin's, the shard-sized ones times r, a
    micro-batch as large or larger), the chains from below: each idle is a floor. The model's
    kernels (its own and TP's waits: `same_model_kernels`, recompute from the same mode only)
    and the optimizer's lie outside these idles, so all add up. Not for pipelines (their step
    is the schedule's)."""
    from ..analysis.collectives import collective_seconds
    from ..devices.gpus import GPUS, interconnect

    if c.layout.pp > 1 or c.layout.shard_degree < 2:
        return None
    best = None
    for x, same_mode, share in _transferable(c, known.by_model_split, _same_model_kernels):
        xc = x.candidate
        if not x.fsdp_stretches or xc.layout.shard_degree % c.layout.shard_degree:
            continue   # no FSDP2 in the trace, or a shard degree c's does not divide
        r = xc.layout.shard_degree // c.layout.shard_degree
        key, classes = x.fsdp_stretches
        gpu = GPUS[key]
        ic = interconnect(gpu)
        seconds = 0.0
        for (own, again, _, _, data_parallel, *_), (rank, f) in zip(x.kernel_seconds, classes):
            shard = _group(c.layout, rank, ("dp_shard", "cp"))
            if f is None or f.shard_degree != xc.layout.shard_degree or shard[0] != rank or \
                    _group(xc.layout, rank, ("dp_shard", "cp"))[0] != rank:
                continue   # a shard's rows compare as said only at shard coordinate 0
            replicas = _group(c.layout, rank, ("dp_replicate",))
            gather = collective_seconds("all_gather", f.gathered, shard, ic)[0]
            scatter = collective_seconds("reduce_scatter", f.reduced, shard, ic)[0]
            reduce = collective_seconds("all_reduce", f.reduced // len(shard), replicas, ic)[0]
            before = f.head[0] + r * f.head[1]
            after = f.tail[0] + r * f.tail[1]
            head = max(0.0, _at_least(f.copy_in, r, gpu) + gather - before) if f.gathered \
                else 0.0
            tail = max(0.0, scatter + reduce + _at_least(f.post_reduce, r, gpu) - after
                       - r * f.tail[2]) if f.reduced else 0.0
            boundary = max(0.0, scatter + gather - after - before) \
                if f.gathered and f.reduced and f.one_stream else 0.0
            if f.boundary and f.reduced:
                boundary = max(boundary, scatter + reduce - f.boundary[0] - r * f.boundary[1])
            model = share * (own - data_parallel + (again if same_mode else 0.0))
            seconds = max(seconds, model + _at_least(f.optimizer, r, gpu) + head + tail
                          + (c.steps - 1) * boundary)
        if seconds and (best is None or seconds > best.seconds):
            best = Bound(seconds, f"{c.steps} x micro-batch {xc.micro_batch}'s model kernels, "
                                  f"scaled, the optimizer and FSDP2's waits re-priced on this "
                                  f"layout's groups, as traced in {xc.label()}")
    return best


BOUNDS = (*BOUNDS, replicated_twin)
