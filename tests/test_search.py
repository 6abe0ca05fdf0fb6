"""tapescope search: the pruned search against brute force over the same space, the winners
re-profiled alone with the same flags, Ray against the local pool, the cache, the CLI.

Kept cheap (issue 35: the file took 162 s): brute force reads the pruned search's traces back
from its cache and traces only what the pruned search did not (each trace is deterministic:
test_top_three_fit_when_profiled_alone re-profiles the top three independently), and one small
in-process search serves the cache, Ray and CLI tests."""

from __future__ import annotations

import json

import pytest
import torch

import tapescope
from tapescope.layout_search import Source, candidate_options, result_dict
from tapescope.layout_search.config import tapescope_command, torchtitan_toml

# one block wide enough that matmuls dominate the step (the bounds are tight), a 32,000-token
# vocabulary: the logits decide what fits a T4 at 4,096 tokens (a trace's cost is its ops, not
# its sizes: one block costs about half of two, and every rule still prunes here)
SPEC = "zoo:llama:n_layers=1,dim=1024,n_heads=8,n_kv_heads=4,ffn_dim=4096,max_seq_len=4096"
SPACE = dict(gpus=4, gpu="t4", global_batch=32, seq=4096, pp=(1,), tp=(1, 2),
             checkpointing=("none", "full"), max_steps=4, gpus_per_node=2)
TOP = 3


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("search") / "cache.jsonl")
    pruned = tapescope.search(SPEC, **SPACE, top=TOP, cache=cache)
    return pruned, tapescope.search(SPEC, **SPACE, brute_force=True, cache=cache)


def _labels(outcomes):
    return [o.candidate.label() for o in outcomes]


def test_pruned_ranking_is_brute_forces(searches):
    pruned, brute = searches
    assert len(pruned.outcomes) < len(brute.outcomes)
    # brute force traced every candidate the pruned search did not
    assert {o.candidate for o in brute.outcomes} == set(_grid(brute).candidates)
    assert sum(not o.cached for o in brute.outcomes) == \
        len(brute.outcomes) - len(pruned.outcomes)
    # the top rows are brute force's (neither lists a candidate whose lighter checkpointing
    # mode fits: that one is faster)
    assert _labels(pruned.ranked[:TOP]) == _labels(brute.ranked[:TOP])
    assert all(o.candidate.checkpointing != "none" for o in brute.dominated) and brute.dominated
    traced = {o.candidate for o in pruned.outcomes}
    dominated = {o.candidate for o in brute.dominated}
    assert [o.candidate.label() for o in pruned.ranked if o.candidate not in dominated] == \
        [o.candidate.label() for o in brute.ranked if o.candidate in traced]


def _grid(r):
    from tapescope.layout_search import candidate_grid

    return candidate_grid(r.space)


def _another_that_fits(x, o) -> bool:
    return o.fits and o.candidate != x.candidate


def _from_each_trace(rule, traces, outcomes, admit=_another_that_fits):
    """(x, o, bound, x alone) for each trace x of `traces` and outcome o of `outcomes` that
    `admit` pairs (by default: another candidate, one that fits) where `rule` bounds o's
    candidate from x's trace alone (a Known of x only); each bound checked at most o's traced
    step on the way."""
    from tapescope.layout_search.bounds import Known

    for x in traces:
        alone = Known()
        alone.add(x)
        for o in outcomes:
            if not admit(x, o):
                continue
            b = rule(o.candidate, alone)
            if b is not None:
                assert b.seconds <= o.step_seconds, (rule.__name__, x.candidate.label(),
                                                     o.candidate.label())
                yield x, o, b, alone


def test_every_bound_holds_on_every_candidate(searches):
    """Each lower bound the rules (layout_search/bounds.py) give any candidate from every
    other candidate brute force traced is at most that candidate's traced step time."""
    from tapescope.layout_search.bounds import BOUNDS, Known, matmul_rate
    from tapescope.options import Options

    _, brute = searches
    known = Known(matmul_rate(Options.create(gpu=SPACE["gpu"]).gpu))
    for o in brute.outcomes:
        known.add(o)
    checked = {rule.__name__: 0 for rule in BOUNDS}
    for o in brute.outcomes:
        for rule in BOUNDS:
            b = rule(o.candidate, known)
            if b is not None and o.fits:
                assert b.seconds <= o.step_seconds, (rule.__name__, o.candidate.label())
                checked[rule.__name__] += 1
    # every rule gave bounds; repeated_kernels and model_flops one to every fitting candidate
    # (another micro-batch size or mode of its layout was traced), same_model_kernels to
    # those whose FSDP / HSDP twin was
    assert checked["repeated_kernels"] == checked["model_flops"] == \
        sum(o.fits for o in brute.outcomes)
    assert checked["same_model_kernels"] >= sum(o.fits and o.candidate.layout.dp_replicate > 1
                                                for o in brute.outcomes) > 0
    assert checked["kernels_and_step_ends"] > 0


def test_step_ends_tighten_the_bound_and_hold(searches):
    """kernels_and_step_ends (bounds.step_ends: the optimizer's kernels and the waits for
    FSDP2's first all-gather and last reduction) from each single trace on each other candidate
    of its layout, one pair at a time: at most the traced step, on a smaller micro-batch too,
    and above repeated_kernels' floor from the same trace by at least the optimizer's kernels."""
    from tapescope.layout_search.bounds import kernels_and_step_ends, repeated_kernels

    _, brute = searches
    for x in brute.outcomes:
        assert len(x.step_ends) == len(x.kernel_seconds) and all(e > 0 for e in x.step_ends)
    smaller, gains = 0, []
    for x, o, b, alone in _from_each_trace(kernels_and_step_ends, brute.outcomes,
                                           brute.outcomes):
        smaller += o.candidate.micro_batch < x.candidate.micro_batch
        gains.append(b.seconds - repeated_kernels(o.candidate, alone).seconds)
    assert smaller > 0 and gains and min(gains) > 0


def test_each_trace_bounds_every_size_and_twin(searches):
    """Each single trace's bound on each other candidate, one pair at a time (not only the
    largest of them): from a larger micro-batch of the same layout (scaled by
    bounds._per_micro_batch_share) and from another data-parallel split of the same model
    split, at most the traced step; and both transfers happen."""
    from tapescope.layout_search.bounds import repeated_kernels, same_model_kernels

    _, brute = searches
    kinds = set()
    for rule in (repeated_kernels, same_model_kernels):
        for x, o, _, _ in _from_each_trace(rule, brute.outcomes, brute.outcomes):
            kinds.add((rule.__name__, o.candidate.micro_batch < x.candidate.micro_batch))
    assert {("repeated_kernels", True), ("same_model_kernels", False),
            ("same_model_kernels", True)} <= kinds, kinds



def test_block_figures_ignore_the_data_parallel_split(searches):
    """What twin_pipeline_chain rests on, measured: a block's kernels (Outcome.block_seconds)
    are the same whatever the FSDP / HSDP split (FSDP2 gathers a block whole; its own kernels
    are left out), at the same TP degree, micro-batch and mode, on every rank class."""
    _, brute = searches
    by: dict = {}
    for o in brute.outcomes:
        c = o.candidate
        if c.steps == 1 and o.block_seconds:
            by.setdefault((c.layout.tp, c.micro_batch, c.checkpointing), []).append(o)
    compared = 0
    for group in by.values():
        first = [x for block in group[0].block_seconds[0] for x in block]
        for o in group:
            for figures in o.block_seconds:
                assert [x for block in figures for x in block] == \
                    pytest.approx(first, rel=1e-9), o.candidate.label()
        compared += len({o.candidate.layout for o in group}) > 1
    assert compared > 0, sorted(by)

# the brute-force check of pipelined_model_kernels: a pipelined layout (PP 2 x FSDP 2, one block
# a stage) beside its unpipelined twin (FSDP 4), both checkpointing modes, and a pipelined
# micro-batch smaller than the twin opener's (8 candidates, every one traced)
PIPE = dict(gpus=4, gpu="h100", global_batch=8, seq=128, pp=(1, 2), tp=(1,),
            checkpointing=("none", "full"), max_steps=4, gpus_per_node=4)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """The pruned search (its cache lines in trace order), then brute force from its cache."""
    cache = tmp_path_factory.mktemp("pipelined") / "search.jsonl"
    pruned = tapescope.search(SMALL_SPEC, **PIPE, top=2, cache=str(cache))
    order = [(c["pp"], c["steps"]) for c in (json.loads(line)["outcome"]["candidate"]
                                             for line in cache.read_text().splitlines())]
    return pruned, tapescope.search(SMALL_SPEC, **PIPE, brute_force=True, cache=str(cache)), \
        order


def test_pipelined_bound_holds_on_every_candidate(pipelined):
    """Every rule's bound on every candidate, from all of brute force's traces together and
    from each trace alone, is at most its traced step; pipelined_model_kernels bounds every
    pipelined candidate (the same micro-batch as the twin's opener and a smaller one, both
    modes)."""
    from tapescope.layout_search.bounds import BOUNDS, Known, pipelined_model_kernels

    _, brute, _ = pipelined
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    assert piped and all(o.fits for o in brute.outcomes)
    assert {o.candidate.micro_batch for o in piped} == {1, 2}
    everything = Known()
    for o in brute.outcomes:
        everything.add(o)
    for o in brute.outcomes:
        for rule in BOUNDS:
            b = rule(o.candidate, everything)
            if b is not None:
                assert b.seconds <= o.step_seconds, (rule.__name__, o.candidate.label())
    for x, o, b, _ in _from_each_trace(pipelined_model_kernels, brute.outcomes, piped):
        assert b.seconds > 0, (x.candidate.label(), o.candidate.label())
    bounded = [o for o in piped if pipelined_model_kernels(o.candidate, everything)]
    assert bounded == piped


def test_pipeline_stages_run_the_models_kernels(pipelined):
    """The proof's middle step, measured: at the same micro-batch size and mode, the stages'
    model kernels (FSDP2's own and the waits left out) per micro-batch, summed over the
    stages, are at least the unpipelined twin's per micro-batch."""
    _, brute, _ = pipelined
    by = {o.candidate: o for o in brute.outcomes}
    pairs = 0
    for o in brute.outcomes:
        c = o.candidate
        if c.layout.pp == 1:
            continue
        twin = next((x for x in by if x.layout.pp == 1 and x.steps == 1
                     and x.micro_batch == c.micro_batch and x.checkpointing == c.checkpointing),
                    None)
        if twin is None:
            continue
        stages = sum(own + again - dp for _, _, _, _, dp, own, again in o.kernel_seconds)
        (_, _, _, _, dp, own, again), = by[twin].kernel_seconds
        assert len(o.kernel_seconds) == c.layout.pp
        assert stages / c.steps >= own + again - dp > 0, (c.label(), stages / c.steps)
        pairs += 1
    assert pairs == 2



def test_pipeline_chain_holds_from_each_trace(pipelined):
    """pipeline_chain (the bubble: the stages before the slowest run micro-batch 0's forward
    before it and the last micro-batch's backward after it) from each pipelined trace alone,
    on every candidate of its family, is at most the traced step and above the family's
    repeated_kernels bound (micro-batches x the slowest stage's kernels) from the same trace:
    it counts what that bound leaves out. Both modes and both micro-batch sizes transfer.
    (Another data-parallel split of the same pipeline: test_pipeline_chain_across_splits.)"""
    from tapescope.layout_search.bounds import pipeline_chain, repeated_kernels

    _, brute, _ = pipelined
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    assert all(len(o.stage_seconds) == o.candidate.layout.pp for o in piped)
    pairs = set()
    # every pair, a trace with its own candidate too (all fit here)
    for x, o, b, alone in _from_each_trace(pipeline_chain, piped, piped,
                                           admit=lambda x, o: True):
        flat = repeated_kernels(o.candidate, alone)
        assert flat.seconds < b.seconds, (x.candidate.label(), o.candidate.label())
        pairs.add((x.candidate.checkpointing, o.candidate.checkpointing,
                   o.candidate.micro_batch < x.candidate.micro_batch))
    assert {("none", "full", False), ("none", "none", True), ("full", "full", True)} <= pairs, \
        pairs


def test_pipeline_chain_by_hand(pipelined):
    """The chain read off one candidate's own figures by hand (stage 0's first forward and
    last backward, then all of stage 1's actions) is at most the schedule's step; and the
    actions' kernels, read per action (bounds.action_floors, through the schedule's action
    segments), add up to the rank's forward and backward kernels read op by op
    (stream_floors over the whole trace), FSDP2's own left out of both: every kernel of the
    step is in some action."""
    _, brute, _ = pipelined
    o = next(o for o in brute.outcomes if o.candidate.layout.pp == 2 and
             o.candidate.checkpointing == "full" and o.candidate.micro_batch == 1)
    (f0, b0, b0_again, _, _), (_, _, _, w1, w1_again) = o.stage_seconds
    assert f0 + b0 + b0_again + w1 + w1_again <= o.step_seconds
    for (*_, own, again), (*_, fsdp, own_alone, again_alone) in zip(o.stage_seconds,
                                                                    o.kernel_seconds):
        assert own == pytest.approx(own_alone - fsdp, rel=1e-9) and again > 0 and fsdp > 0
        assert again == pytest.approx(again_alone, rel=1e-9)



def test_pipeline_chain_across_splits():
    """pipeline_chain from a trace of another data-parallel split of the same pipeline
    (PP 2 x FSDP 4 and PP 2 x HSDP 2 x FSDP 2, FSDP2's own kernels left out of the figures),
    each trace alone on each candidate of the other layout: at most its traced step, and
    given from the same micro-batch size and from a larger one; the stages' figures are the
    same in both splits at the same micro-batch (FSDP2 gathers a block whole)."""
    from tapescope.layout_search.bounds import pipeline_chain

    r = tapescope.search(SMALL_SPEC, gpus=8, gpu="h100", global_batch=16, seq=128, pp=(2,),
                         tp=(1,), checkpointing=("none",), max_steps=4, gpus_per_node=2,
                         brute_force=True)
    assert {o.candidate.layout.dp_replicate for o in r.outcomes} == {1, 2}

    def other_split(x, o) -> bool:
        return o.candidate.layout != x.candidate.layout

    given = set()
    for x, o, b, _ in _from_each_trace(pipeline_chain, r.outcomes, r.outcomes,
                                       admit=other_split):
        assert b.seconds > 0, (x.candidate.label(), o.candidate.label())
        given.add(o.candidate.micro_batch < x.candidate.micro_batch)
    for x in r.outcomes:
        for o in r.outcomes:
            if other_split(x, o) and o.candidate.micro_batch == x.candidate.micro_batch:
                assert [v for stage in o.stage_seconds for v in stage] == pytest.approx(
                    [v for stage in x.stage_seconds for v in stage], rel=1e-9)
    assert given == {False, True}

def test_twin_pipeline_chain_holds_from_each_twin(pipelined):
    """twin_pipeline_chain from each one-micro-batch unpipelined trace alone (the twin's
    blocks) bounds every pipelined candidate at most at its traced step, both modes and both
    micro-batch sizes; and the proof's middle step measured: at the same micro-batch and
    mode, the blocks a stage holds cost in the twin at most what the stage's first forward and
    last backward cost in the pipeline, and both blocks cost the same (equal blocks)."""
    from tapescope.layout_search.bounds import twin_pipeline_chain

    _, brute, _ = pipelined
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    twins = [o for o in brute.outcomes if o.candidate.layout.pp == 1 and o.candidate.steps == 1]
    assert twins and all(len(o.block_seconds) == len(o.ranks) for o in twins)
    bounded, pairs = set(), 0
    for x, o, b, _ in _from_each_trace(twin_pipeline_chain, twins, piped):
        assert b.seconds > 0, (x.candidate.label(), o.candidate.label())
        bounded.add(o.candidate)
    for x in twins:
        (first, second), = x.block_seconds
        assert first == pytest.approx(second, rel=1e-12) and min(first) >= 0 and first[0] > 0
        assert (first[2] > 0) == (x.candidate.checkpointing != "none")
        for o in piped:
            c = o.candidate
            if (c.micro_batch, c.checkpointing) != (x.candidate.micro_batch,
                                                    x.candidate.checkpointing):
                continue
            # one block a stage here
            for (forward, own, again), (f0, b_own, b_again, _, _) in zip(x.block_seconds[0],
                                                                         o.stage_seconds):
                assert forward <= f0 and own + again <= b_own + b_again, c.label()
                pairs += 1
    assert bounded == {o.candidate for o in piped} and pairs == 4

def test_pipelines_traced_after_their_twins(pipelined):
    """The pruned search traces a pipelined candidate only after the one-micro-batch
    unpipelined candidates it traces (their kernels bound the pipeline)."""
    _, _, order = pipelined
    twins = [i for i, (pp, steps) in enumerate(order) if pp == 1 and steps == 1]
    piped = [i for i, (pp, _) in enumerate(order) if pp > 1]
    assert twins and piped and max(twins) < min(piped), order


def test_first_ready_holds_pipelines_back():
    """Before any trace the runner offers the unpipelined openers only (no trace: the grid's
    own order), and once its twins resolve, a pipeline's opener too."""
    from tapescope.layout_search.runner import _Grid
    from tapescope.layout_search.space import SearchSpace

    space = SearchSpace(4, 8, 4, (1, 2), (1,), checkpointing=("none", "full"), max_steps=4,
                        n_blocks=2, heads=(4, 2), seq=128)
    grid = _Grid(space, top=2)
    first = grid.update(False)
    assert first and all(c.layout.pp == 1 for c in first), [c.label() for c in first]
    for c in grid.all:
        if c.layout.pp == 1 and c.steps == 1:
            grid.pruned[c] = "resolved for this test"
    assert any(c.layout.pp == 2 for c in grid.update(False))


def test_every_pruning_rule_holds_when_traced(searches):
    """What the rules ruled out, brute force traced: out of memory where a rule said so,
    slower than the candidate that dominates it where one did."""
    pruned, brute = searches
    by = {o.candidate: o for o in brute.outcomes}
    label = {o.candidate.label(): o for o in brute.outcomes}
    reasons = {why.split(":")[0] for _, why in pruned.pruned}
    assert {"out of memory", "dominated", f"cannot enter the top {TOP}"} <= reasons
    assert any("HSDP shards less" in why for _, why in pruned.pruned)
    top = brute.ranked[TOP - 1].step_seconds
    for c, why in pruned.pruned:
        b = by[c]
        if why.startswith("out of memory"):
            assert b.status == "oom", (c.label(), why)
        elif why.startswith("cannot enter"):
            assert b.status == "oom" or b.step_seconds >= pruned.bounds[c] > top, c.label()
        else:
            assert why.startswith("dominated"), why
            winner = label[why.split(": ", 1)[1].split(" fits")[0]]
            assert winner.fits and b.tokens_per_second < winner.tokens_per_second


def test_rejected_name_rank_op_category(searches):
    pruned, _ = searches
    oom = [o for o in pruned.rejected if o.status == "oom"]
    assert oom
    for o in oom:
        r = next(x for x in o.ranks if x.reserved_bytes is None)
        assert f"rank {r.ranks[0]}" in o.reason and r.oom_at and r.oom_at in o.reason
        assert r.top_category in o.reason


def _parallelize_as_written(layout, full_checkpointing: bool):
    """The layout in torch's own calls, as a training script writes it: checkpoint_wrapper
    on every block when asked, then fully_shard on every block and the root."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    assert layout.tp == 1 and layout.pp == 1

    def parallelize(model, mesh):
        if full_checkpointing:
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block,
                                                     checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        dp = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i, block in enumerate(model.layers):
            fully_shard(block, mesh=dp, mp_policy=mp,
                        reshard_after_forward=i < len(model.layers) - 1)
        fully_shard(model, mesh=dp, mp_policy=mp)
        return model
    return parallelize


def test_top_three_fit_when_profiled_alone(searches):
    """Each of the three best, profiled with tapescope.profile and the flags its command line
    gives (layout, micro-batch, accumulation; checkpointing written with torch's own
    checkpoint_wrapper), fits on every rank with the search's figures."""
    from tapescope.zoo import resolve

    pruned, _ = searches
    assert len(pruned.ranked) >= 3
    for o in pruned.ranked[:3]:
        c = o.candidate
        line = tapescope_command(pruned.source, c)
        assert f"--batch {c.micro_batch}" in line and f"--fsdp {c.layout.fsdp}" in line
        m = resolve(SPEC, batch=c.micro_batch, seq=4096)
        p = tapescope.profile(m.build, *m.inputs, gpu="t4", mesh=c.layout.mesh,
                              parallelize=_parallelize_as_written(
                                  c.layout, c.checkpointing == "full"),
                              accumulate=c.steps)
        for q in p.distributed.profiles.values():
            assert not q.cuda_memory.oom
        assert max(q.cuda_memory.nvidia_smi for q in p.distributed.profiles.values()) == \
            o.worst.reserved_bytes


def test_winner_as_torchtitan_config(searches):
    pruned, _ = searches
    import tomllib

    c = pruned.winner.candidate
    t = tomllib.loads(torchtitan_toml(pruned.source, c, 32))
    assert t["parallelism"]["data_parallel_shard_degree"] == c.layout.fsdp
    assert t["parallelism"]["tensor_parallel_degree"] == c.layout.tp
    assert t["training"]["local_batch_size"] * c.layout.fsdp * c.layout.dp_replicate \
        * c.steps == t["training"]["global_batch_size"] == 32
    d = result_dict(pruned)
    json.dumps(d)
    assert d["winner"]["label"] == c.label() and len(d["ranked"]) == len(pruned.ranked)


# the smallest search that still has a pipeline and an accumulating candidate (3 candidates)
SMALL = dict(gpus=2, gpu="h100", global_batch=4, seq=128, pp=(1, 2), tp=(1,),
             checkpointing=("none",), max_steps=2)
SMALL_SPEC = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128"


def _table(r):
    return [(o.candidate, o.status, o.tokens_per_second, tuple(x.reserved_bytes for x in o.ranks))
            for o in r.ranked + r.rejected]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The small search in this process, and its cache file."""
    cache = tmp_path_factory.mktemp("small") / "search.jsonl"
    return tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache)), cache


def test_cache_resumes(small):
    first, cache = small
    assert "this process" in first.workers and len(first.outcomes) >= 3
    assert any(o.candidate.layout.pp > 1 for o in first.ranked)
    lines = cache.read_text().splitlines()
    assert len(lines) >= len(first.outcomes)
    again = tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache))
    assert all(o.cached for o in again.outcomes)
    assert _table(again) == _table(first)
    assert len(cache.read_text().splitlines()) == len(lines)   # nothing traced twice


def test_ray_returns_the_local_pools_table(small):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'tapescope[cluster]')")
    on_ray = tapescope.search(SMALL_SPEC, **SMALL, ray="local", workers=2)
    assert "Ray" in on_ray.workers and not any(o.cached for o in on_ray.outcomes)
    assert _table(on_ray) == _table(small[0])


def test_cli_search_json_and_progress(tmp_path, small):
    """The CLI on two local worker processes (its default pool): the in-process table."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["search", SMALL_SPEC, "--gpus", "2", "--global-batch", "4",
                                 "--seq", "128", "--pp", "1,2", "--tp", "1", "--checkpointing",
                                 "none", "--max-steps", "2", "--workers", "2", "--json",
                                 str(out)])
    assert r.exit_code == 0, r.output
    assert "search: " in r.output and "done" in r.output   # a plain progress line per candidate
    d = json.loads(out.read_text())
    assert d["workers"] == "2 local processes"
    assert d["winner"]["tapescope"].startswith("tapescope profile " + SMALL_SPEC)
    assert d["ranked"][0]["label"] == d["winner"]["label"]
    assert [(o["label"], o["tokens_per_second"]) for o in d["ranked"]] == \
        [(o.candidate.label(), o.tokens_per_second) for o in small[0].ranked]


def test_cli_search_nothing_fits_exits_1():
    from typer.testing import CliRunner

    from tapescope.cli import app

    r = CliRunner().invoke(app, ["search", SPEC, "--gpus", "1", "--gpu", "t4", "--global-batch",
                                 "64", "--seq", "4096", "--checkpointing", "none", "--max-steps",
                                 "1", "--workers", "1", "-q"])
    assert r.exit_code == 1, r.output
    assert "No candidate fits" in r.output and "Traceback" not in r.output


# ---- a stopped search (time limit; Ctrl-C and SIGTERM: tests/test_search_stop.py) ----------------

def _stop_after(monkeypatch, outcomes: list, n: int) -> None:
    """The searches below run out of time once `outcomes` holds n entries: a clock that jumps
    then (the real timer, SIGALRM, is tested in tests/test_search_stop.py)."""
    import tapescope.layout_search as layout_search

    run = layout_search.run_search
    monkeypatch.setattr(layout_search, "run_search", lambda *a, **k: run(
        *a, clock=lambda: 0.0 if len(outcomes) < n else 1e6, **k))


def _figures(o):
    return (o.candidate, o.status, o.step_seconds, o.tokens_per_second, o.ranks)


def test_stopped_search_keeps_its_traces_and_resumes(small, tmp_path, monkeypatch):
    """A real search whose time runs out after two traces: what it traced and ranks is the
    complete search's; the third candidate is listed as not searched, with a bound its own
    trace respects; its --json says so; resumed from its cache, it traces only the third, to
    the complete search's table."""
    import tapescope.layout_search.runner as runner

    full, _ = small
    truth = {o.candidate: o for o in full.outcomes}
    traced = []
    evaluate = runner.evaluate
    monkeypatch.setattr(runner, "evaluate", lambda *a: traced.append(evaluate(*a)) or traced[-1])
    _stop_after(monkeypatch, traced, 2)
    cache = tmp_path / "search.jsonl"
    r = tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache), time_limit=600)
    assert not r.complete and r.stopped == "the time limit (10 min)"
    assert len(traced) == len(r.outcomes) == 2
    assert [_figures(o) for o in r.outcomes] == [_figures(truth[o.candidate]) for o in r.outcomes]
    done = {o.candidate for o in r.outcomes}
    assert _labels(r.ranked) == [o.candidate.label() for o in full.ranked if o.candidate in done]
    (u,) = r.not_searched
    assert {u.candidate} == set(truth) - done and not u.being_traced
    real = truth[u.candidate]
    assert u.bound is None or u.bound.seconds <= real.step_seconds
    assert r.could_beat_best(u) or real.step_seconds >= r.winner.step_seconds
    d = result_dict(r)
    assert d["complete"] is False and d["stopped"]["by"] == r.stopped
    assert d["stopped"]["summary"].endswith("2 traced, 0 ruled out, 1 not searched")
    assert [x["label"] for x in d["not_searched"]] == [u.candidate.label()]
    assert [x["label"] for x in d["ranked"]] == _labels(r.ranked)
    from rich.console import Console

    from tapescope.report.search import render_search

    text = Console(record=True, width=200)
    render_search(r, text)
    shown = text.export_text()
    for line in ("Partial: " + d["stopped"]["summary"], "fastest first, among the traced "
                 "candidates only", "Not searched (1)", f"  {u.candidate.label()}: ",
                 f"Best traced: {r.winner.candidate.label()}"):
        assert line in shown, (line, shown)

    monkeypatch.undo()
    monkeypatch.setattr(runner, "evaluate", lambda *a: traced.append(evaluate(*a)) or traced[-1])
    again = tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache))
    assert again.complete and again.not_searched == [] and len(traced) == 3
    assert _table(again) == _table(full)
    d = result_dict(again)
    assert d["complete"] is True and d["stopped"] is None and d["not_searched"] == []


def test_stopped_search_never_hides_a_faster_candidate(searches, tmp_path, monkeypatch):
    """The pruned search of SPACE stopped after each number of outcomes in turn (read back from
    brute force's traces: no trace here): every candidate it did not search that brute force
    finds faster than its best, or than its TOP-th row, is flagged as one that could be, each
    bound is at most the traced step, the rows it calls exact are brute force's, and the bounds
    prove something (some candidates cannot beat the best)."""
    from dataclasses import replace

    from tapescope.layout_search.runner import Cache

    _, brute = searches
    truth = {o.candidate: o for o in brute.outcomes}
    cache = Cache(str(tmp_path / "brute.jsonl"), brute.source, SPACE["global_batch"] * SPACE["seq"])
    for o in brute.outcomes:
        cache.put(replace(o, cached=False))
    proven = 0
    for n in range(1, len(brute.outcomes)):
        seen = []
        _stop_after(monkeypatch, seen, n)
        r = tapescope.search(SPEC, **SPACE, top=TOP, cache=cache.path, time_limit=600,
                             progress=seen.append)
        if r.complete:
            break
        assert r.not_searched and all(o.cached for o in r.outcomes)
        for u in r.not_searched:
            real = truth[u.candidate]
            if not real.fits:
                continue
            assert u.bound is None or u.bound.seconds <= real.step_seconds, u.candidate.label()
            if r.winner is None or real.step_seconds < r.winner.step_seconds:
                assert r.could_beat_best(u), u.candidate.label()
            if len(r.ranked) < TOP or real.step_seconds < r.ranked[TOP - 1].step_seconds:
                assert r.could_enter_top(u), u.candidate.label()
        proven += sum(not r.could_beat_best(u) for u in r.not_searched)
        # the rows it calls exact are brute force's (none here: until the end, FSDP 4, mb 8
        # with full checkpointing is left, its bound below every step; it runs out of memory,
        # which no bound can know)
        assert _labels(r.ranked[:r.exact_rows]) == _labels(brute.ranked[:r.exact_rows])
        monkeypatch.undo()
    assert n > 2 and proven > 0


def test_twin_pipeline_ends_holds_from_each_twin(pipelined):
    """twin_pipeline_ends (the twin's chain with the embedding on the first stage, the final
    norm, the output layer and the loss on the last, and the chain that ends on the stage's
    own rank) from each one-micro-batch unpipelined trace alone: at most every pipelined
    candidate's traced step, both modes and both micro-batch sizes, and above
    twin_pipeline_chain from the same twin (it counts what that one leaves out); the pruned
    search, which applies it, keeps brute force's top rows."""
    from tapescope.layout_search.bounds import twin_pipeline_chain, twin_pipeline_ends

    pruned, brute, _ = pipelined
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    twins = [o for o in brute.outcomes if o.candidate.layout.pp == 1 and o.candidate.steps == 1]
    for x in twins:
        (first_f, first_b, last_f, last_b, loss_f, loss_b), = x.edge_seconds
        # the loss is pipeline_loss's (checked op for op), and each part launches kernels
        assert min(first_f, first_b, last_f, last_b, loss_f, loss_b) > 0, x.candidate.label()
    bounded = set()
    for x, o, b, alone in _from_each_trace(twin_pipeline_ends, twins, piped):
        chain = twin_pipeline_chain(o.candidate, alone)
        assert chain.seconds < b.seconds, (x.candidate.label(), o.candidate.label())
        bounded.add(o.candidate)
    assert bounded == {o.candidate for o in piped}
    assert _labels(pruned.ranked[:2]) == _labels(brute.ranked[:2])


def test_twin_edges_are_the_stages_own(pipelined):
    """The proof's middle step, measured on the pipelined traces at the twin's micro-batch and
    mode: stage 0's first forward and last backward cost at least the twin's block 0 plus the
    first stage's modules, stage 1's at least block 1 plus the last stage's modules and the
    loss's backward (one block a stage here)."""
    _, brute, _ = pipelined
    pairs = 0
    for x in (o for o in brute.outcomes if o.candidate.layout.pp == 1 and
              o.candidate.steps == 1):
        (first_f, first_b, last_f, last_b, _, loss_b), = x.edge_seconds
        edges = ((first_f, first_b), (last_f, last_b + loss_b))
        for o in brute.outcomes:
            c = o.candidate
            if c.layout.pp == 1 or (c.micro_batch, c.checkpointing) != \
                    (x.candidate.micro_batch, x.candidate.checkpointing):
                continue
            for (forward, own, again), (edge_f, edge_b), (f, b_own, b_again, _, _) in \
                    zip(x.block_seconds[0], edges, o.stage_seconds):
                assert forward + edge_f <= f * (1 + 1e-9), c.label()
                assert own + again + edge_b <= (b_own + b_again) * (1 + 1e-9), c.label()
                pairs += 1
    assert pairs == 4


def test_twin_loss_is_the_pipelines_loss():
    """The loss's and the optimizer's figures against a pipelined trace's own: the twin's loss
    forward per micro-batch (the model's own cross-entropy given its targets) equals the
    kernels the pipeline's last rank runs for pipeline_loss between its actions (read op by op
    off its trace); each stage's share of the twin's optimizer kernels is at most what its
    rank's optimizer runs, and the twin's figure holds every optimizer kernel of the twin;
    and a loss_fn whose kernels differ from the twin's loss counts no loss at all."""
    from tapescope.analysis.kernel_cost import on_gpu
    from tapescope.analysis.op_classes import launches_kernel
    from tapescope.analysis.timing import kernel_seconds
    from tapescope.api import profile_workload
    from tapescope.distributed.presets import Layout
    from tapescope.layout_search import Source
    from tapescope.layout_search.bounds import _stage_optimizer, edge_floors
    from tapescope.layout_search.evaluate import _pipeline_loss_kernels, _traced, evaluate
    from tapescope.layout_search.space import Candidate

    source = Source(SMALL_SPEC, 128, "h100")
    twin = evaluate(source, Candidate(Layout(fsdp=2), micro_batch=2), 4 * 128)
    (*_, loss_f, loss_b), = twin.edge_seconds
    c = Candidate(Layout(fsdp=2, pp=2), micro_batch=2, steps=2, schedule="1f1b")
    workload, options = candidate_options(source, c)
    ranks = _traced(profile_workload(workload, options))
    last = ranks[-1]
    storages, comm = last.trace.storages, {x.op for x in last.collectives}
    # pipeline_loss runs outside the stage's actions (torch's _maybe_compute_loss): the rank's
    # kernels of no phase action and no module, its sends, receives and FSDP2's gradient
    # copy-in left out
    between = sum(kernel_seconds(op, last.gpu, storages)[0] * op.runs for op in last.ops
                  if op.phase == "other" and op.module is None and op.index not in comm
                  and not op.record.stream and not op.record.name.startswith("fsdp.")
                  and launches_kernel(op.record.func) and on_gpu(op, storages))
    assert loss_f > 0 and loss_b > 0
    assert between / c.steps == pytest.approx(loss_f, rel=1e-9)

    def optimizer_kernels(q):
        return sum(kernel_seconds(op, q.gpu, q.trace.storages)[0] * op.runs for op in q.ops
                   if op.phase == "optimizer" and not op.record.stream
                   and launches_kernel(op.record.func) and on_gpu(op, q.trace.storages))

    (figure,) = twin.optimizer_seconds
    for stage, (q, parts) in enumerate(zip(ranks, ({0, -1}, {1, -2}))):
        share = _stage_optimizer(figure, parts, c.layout.shard_degree, 2)
        assert 0 < share <= optimizer_kernels(q), stage

    twin_workload, twin_options = candidate_options(source, Candidate(Layout(fsdp=2),
                                                                      micro_batch=2))
    q = _traced(profile_workload(twin_workload, twin_options))[0]
    assert figure[0] == pytest.approx(optimizer_kernels(q), rel=1e-12)
    blocks, edges = twin_options.parallelize.blocks, twin_options.parallelize.edges
    assert edge_floors(q, blocks, *edges, _pipeline_loss_kernels(
        None, twin_workload.args[-1])) == pytest.approx(twin.edge_seconds[0], rel=1e-12)
    other = edge_floors(q, blocks, *edges, _pipeline_loss_kernels(
        lambda out, target: out.float().pow(2).mean(), twin_workload.args[-1]))
    assert other[:4] == pytest.approx(twin.edge_seconds[0][:4], rel=1e-12) and \
        other[4:] == (0.0, 0.0)
def test_replicated_twin_holds_from_each_trace(searches):
    """replicated_twin (an HSDP candidate from its FSDP twin, FSDP2's waits re-priced on the
    candidate's own groups) from each single trace on each other candidate of SPACE, one pair
    at a time: at most the traced step; it bounds HSDP 2 x FSDP 2 from FSDP 4, on a smaller
    micro-batch too, and there it is above same_model_kernels from the same trace by at least
    the twin's optimizer kernels (which a rank of the HSDP, holding twice the shard, runs at
    least as long)."""
    from tapescope.layout_search.bounds import replicated_twin, same_model_kernels

    _, brute = searches
    pairs, smaller = [], 0
    for x, o, b, alone in _from_each_trace(replicated_twin, brute.outcomes, brute.outcomes):
        if o.candidate.layout.dp_replicate > x.candidate.layout.dp_replicate:
            _, classes = x.fsdp_stretches
            optimizer = min(sum(t for t, _ in f.optimizer) for _, f in classes)
            assert b.seconds >= same_model_kernels(o.candidate, alone).seconds + optimizer
            pairs.append(b.seconds / o.step_seconds)
            smaller += o.candidate.micro_batch < x.candidate.micro_batch
    assert pairs and smaller > 0, pairs


def test_replicated_twin_prices_the_candidates_own_collectives(searches):
    """The re-pricing against the candidate's own trace: FSDP 4's figures (its first
    all-gather's and last reduce-scatter's unpadded bytes: this model's dims divide 4, so no
    padding) priced on HSDP 2 x FSDP 2's groups (shard {0, 1}, replicas {0, 2}) give the
    seconds the HSDP trace itself gives its first all-gather, its last reduce-scatter and the
    all-reduce after it; and the HSDP trace's own figures, read the same way, hold the same
    bytes and twice the twin's optimizer kernels (each foreach kernel over a shard twice as
    long)."""
    from tapescope.analysis.collectives import collective_seconds
    from tapescope.api import profile_workload
    from tapescope.devices.gpus import GPUS, interconnect
    from tapescope.layout_search.bounds import _group

    _, brute = searches
    by = {o.candidate.label(): o for o in brute.outcomes}
    twin = by["FSDP 4, mb 2, accumulate 4"]
    hsdp = by["HSDP 2 x FSDP 2, mb 2, accumulate 4"]
    key, ((rank, f),) = twin.fsdp_stretches
    _, ((_, own),) = hsdp.fsdp_stretches
    assert (own.gathered, own.reduced) == (f.gathered, f.reduced) and f.gathered > 0
    assert sum(t for t, _ in own.optimizer) == pytest.approx(
        2 * sum(t for t, _ in f.optimizer), rel=0.01)
    layout = hsdp.candidate.layout
    shard, replicas = _group(layout, rank, ("dp_shard", "cp")), \
        _group(layout, rank, ("dp_replicate",))
    assert (shard, replicas) == ((0, 1), (0, 2))
    ic = interconnect(GPUS[key])
    workload, options = candidate_options(Source(SPEC, SPACE["seq"], SPACE["gpu"]),
                                          hsdp.candidate)
    q = profile_workload(workload, options).distributed.profiles[0]
    fsdp = [c for c in q.collectives if c.stream == q.collectives[0].stream]
    first = next(c for c in fsdp if c.kind == "all_gather")
    last = [c for c in fsdp if c.kind == "reduce_scatter"][-1]
    reduce = [c for c in q.collectives if c.kind == "all_reduce" and c.group_size == 2][-1]
    assert collective_seconds("all_gather", f.gathered, shard, ic)[0] == \
        pytest.approx(first.seconds, rel=1e-12)
    assert collective_seconds("reduce_scatter", f.reduced, shard, ic)[0] == \
        pytest.approx(last.seconds, rel=1e-12)
    assert collective_seconds("all_reduce", f.reduced // 2, replicas, ic)[0] == \
        pytest.approx(reduce.seconds, rel=1e-12)
def test_memory_floors_hold_on_every_pipelined_candidate(pipelined):
    """memory_floors.py on the pipelined space (PP 2 x FSDP 2 against FSDP 4, both modes, two
    micro-batch sizes): from brute force's unpipelined traces, every pipelined candidate has a
    floor with the micro-batches in flight, at most the traced peak live bytes of every rank
    class of its stage (tests/test_memory_floors.py has a space where it prunes)."""
    from tapescope.layout_search.memory_floors import (Twins, activations_in_flight,
                                                       memory_floor, model_parameters)
    from tapescope.values.mesh import mesh_spec

    _, brute, _ = pipelined
    model = model_parameters(Source(SMALL_SPEC, PIPE["seq"], PIPE["gpu"]))
    twins = Twins()
    for o in brute.outcomes:
        twins.add(o)
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    assert piped
    for o in piped:
        c = o.candidate
        assert activations_in_flight(c, model, twins) is not None, c.label()
        f = memory_floor(c, model, twins)
        peaks = [r.peak_bytes for r in o.ranks
                 if mesh_spec(c.layout.mesh).coordinate(r.ranks[0])["pp"] == f.stage]
        assert peaks and 0 < f.bytes <= min(peaks), (c.label(), f.bytes, peaks)



class _BruteForcesTraces:
    """A pool that answers each candidate the search submits with brute force's trace of it (a
    real trace of the same candidate: traces are deterministic), in this process; it keeps the
    order the search asked in, and how many answers the search had not read at each ask."""

    name = "brute force's traces"
    slots = 1

    def __init__(self, brute):
        self.by = {o.candidate: o for o in brute.outcomes}
        self.asked, self.unread, self.answers = [], [], []

    def submit(self, fn, source, c, tokens):
        from concurrent.futures import Future
        from dataclasses import replace

        class Answer(Future):
            read = False

            def result(self, timeout=None):
                self.read = True
                return super().result(timeout)

        self.asked.append(c)
        self.unread.append(sum(not f.read for f in self.answers))
        f = Answer()
        f.set_result(replace(self.by[c], cached=False))
        self.answers.append(f)
        return f

    def close(self, abort=False):
        pass


def test_each_trace_starts_knowing_every_earlier_one(searches):
    """One candidate per free worker, best first by its lower bound, chosen after every
    finished trace was read (the last sittings' runner chose two per worker: on
    search_speed.py's 8 GPUs it traced FSDP 4 x TP 2, mb 1, accumulate 4, bound 1.66 s, beside
    FSDP 8, mb 1, accumulate 2, whose unread trace and the next ones rule it out at 1.60 s).
    Fed brute force's traces, the pruned search reads each answer before it asks again, traces
    what the real search traced and ranks as brute force does; and each candidate it traces
    has, from the traces before it, a bound at most brute force's `top`-th best step, unless
    one of brute force's top rows is traced after it (that one waited behind its family's
    memory order or a pipeline's twins: the only way best first reaches a slower candidate)."""
    from tapescope.layout_search.bounds import Known, lower_bound, matmul_rate
    from tapescope.layout_search.runner import run_search
    from tapescope.options import Options

    pruned, brute = searches
    pool = _BruteForcesTraces(brute)
    r = run_search(pruned.source, pruned.space, pool=pool, top=TOP, seq_tokens=SPACE["seq"])
    assert pool.unread == [0] * len(pool.asked)
    assert _labels(r.ranked[:TOP]) == _labels(brute.ranked[:TOP])
    assert {o.candidate for o in r.outcomes} == {o.candidate for o in pruned.outcomes}
    limit = brute.ranked[TOP - 1].step_seconds
    top_rows = {o.candidate for o in brute.ranked[:TOP]}
    known = Known(matmul_rate(Options.create(gpu=SPACE["gpu"]).gpu))
    for i, c in enumerate(pool.asked):
        b = lower_bound(c, known)
        if b is not None and b.seconds > limit:
            assert top_rows & set(pool.asked[i + 1:]), (c.label(), b.seconds, limit)
        known.add(pool.by[c])


def test_tp_twin_loss_is_the_pipelines_loss():
    """With TP the output layer's hook gathers the vocabulary shards (an all-gather and a
    `cat` in no module) before the loss: the twin's loss figure (edge_floors) is then the
    kernels after the gather, measured against the kernels the pipeline's last rank runs for
    pipeline_loss between its actions (read op by op off its trace, as
    test_twin_loss_is_the_pipelines_loss reads them), and twin_pipeline_ends from the twin
    alone stays at most the pipelined candidate's traced step."""
    from tapescope.analysis.kernel_cost import on_gpu
    from tapescope.analysis.op_classes import launches_kernel
    from tapescope.analysis.timing import kernel_seconds
    from tapescope.api import profile_workload
    from tapescope.distributed.presets import Layout
    from tapescope.layout_search import Source
    from tapescope.layout_search.bounds import Known, twin_pipeline_ends
    from tapescope.layout_search.evaluate import _traced, evaluate
    from tapescope.layout_search.space import Candidate

    source = Source(SMALL_SPEC, 128, "h100")
    twin = evaluate(source, Candidate(Layout(fsdp=2, tp=2), micro_batch=2), 4 * 128)
    (*_, loss_f, loss_b), = twin.edge_seconds
    assert loss_f > 0 and loss_b > 0
    c = Candidate(Layout(fsdp=2, tp=2, pp=2), micro_batch=2, steps=2, schedule="1f1b")
    last = _traced(profile_workload(*candidate_options(source, c)))[-1]
    storages, comm = last.trace.storages, {x.op for x in last.collectives}
    between = sum(kernel_seconds(op, last.gpu, storages)[0] * op.runs for op in last.ops
                  if op.phase == "other" and op.module is None and op.index not in comm
                  and not op.record.stream and not op.record.name.startswith("fsdp.")
                  and launches_kernel(op.record.func) and on_gpu(op, storages))
    assert between / c.steps == pytest.approx(loss_f, rel=1e-9)
    known = Known()
    known.add(twin)
    piped = evaluate(source, c, 8 * 128)
    assert twin_pipeline_ends(c, known).seconds <= piped.step_seconds
