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
    flops_per_sample: dict = field(default_factory=dict)  # "own" / mode -> matmul FLOPs per sample

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


def repeated_kernels(c: Candidate, known: Known) -> Bound | None:
    best = None
    for x in known.by_micro_batch.get(_same_kernels(c), ()):
        same_mode = x.candidate.checkpointing == c.checkpointing
        if RECOMPUTE_ORDER.index(x.candidate.checkpointing) > \
                RECOMPUTE_ORDER.index(c.checkpointing):
            continue   # checkpointing adds kernels of its own (~1% on a 70B step): never less
        share = _per_micro_batch_share(c, x.candidate)
        if share is None:
            continue
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
    for x in known.by_model_split.get(_same_model_kernels(c), ()):
        if x.candidate.layout == c.layout or RECOMPUTE_ORDER.index(x.candidate.checkpointing) > \
                RECOMPUTE_ORDER.index(c.checkpointing):
            continue
        share = _per_micro_batch_share(c, x.candidate)
        if share is None:
            continue
        same_mode = x.candidate.checkpointing == c.checkpointing
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
    for x in known.by_model_split.get(_same_model_kernels(c), ()):
        xc = x.candidate
        if not x.stage_seconds or \
                RECOMPUTE_ORDER.index(xc.checkpointing) > RECOMPUTE_ORDER.index(c.checkpointing):
            continue
        share = _per_micro_batch_share(c, xc)
        if share is None:
            continue
        same_mode = xc.checkpointing == c.checkpointing
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
    `twin_pipeline_chain`): the unpipelined layouts of its TP / CP split, checkpointing as light
    or lighter, a micro-batch as large or larger that its own divides; each as (the trace, same
    checkpointing mode, its micro-batch / the trace's)."""
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
    index_of = {fqn: i for i, fqn in enumerate(blocks)}
    block_of: dict = {}   # module -> block index (None: none)

    def block(module):
        if module not in block_of:
            parts = (module or "").split(".")
            block_of[module] = next((index_of[".".join(parts[:k])]
                                     for k in range(1, len(parts) + 1)
                                     if ".".join(parts[:k]) in index_of), None)
        return block_of[module]

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


def stream_floors(q, waits: bool = True) -> tuple:
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
    stages they depend on), not this stream model's."""
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
    pending: list = []        # (collective position, P, its output storages)
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
    comm = on_stream.get((busiest, False), 0.0)
    # with the same mode's recomputed collectives: the busiest stream counting them
    both = max((on_stream.get((s, False), 0.0) + on_stream.get((s, True), 0.0)
                for s in streams), default=0.0)
    return own, again, comm, both - comm, data_parallel, *alone, step_ends(q, counted)


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
