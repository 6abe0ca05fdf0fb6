"""tapescope search: the pruned search against brute force over the same space, the winners
re-profiled alone with the same flags, Ray against the local pool, the cache, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

import tapescope
from tapescope.layout_search import Source, candidate_options, result_dict
from tapescope.layout_search.config import tapescope_command, torchtitan_toml

# 2 blocks, a 32,000-token vocabulary: the logits decide what fits a T4 at 4,096 tokens
SPEC = "zoo:llama:n_layers=2,dim=128,n_heads=4,n_kv_heads=2,ffn_dim=256,max_seq_len=4096"
SPACE = dict(gpus=4, gpu="t4", global_batch=32, seq=4096, pp=(1,), tp=(1, 2),
             checkpointing=("none", "full"), max_steps=4, gpus_per_node=2)


@pytest.fixture(scope="module")
def searches():
    return (tapescope.search(SPEC, **SPACE),
            tapescope.search(SPEC, **SPACE, brute_force=True))


def _labels(outcomes):
    return [o.candidate.label() for o in outcomes]


def test_pruned_ranking_is_brute_forces(searches):
    pruned, brute = searches
    assert len(pruned.outcomes) < len(brute.outcomes)
    traced = {o.candidate for o in pruned.outcomes}
    assert _labels(pruned.ranked) == [o.candidate.label() for o in brute.ranked
                                      if o.candidate in traced]
    assert pruned.winner.candidate == brute.winner.candidate
    # the same candidate traced twice gives the same figures
    again = {o.candidate: o for o in brute.outcomes}
    for o in pruned.outcomes:
        b = again[o.candidate]
        assert (o.status, [r.reserved_bytes for r in o.ranks], o.step_seconds) == \
            (b.status, [r.reserved_bytes for r in b.ranks], b.step_seconds)


def test_every_pruning_rule_holds_when_traced(searches):
    """What the rules ruled out, brute force traced: out of memory where a rule said so,
    slower than the candidate that dominates it where one did."""
    pruned, brute = searches
    by = {o.candidate: o for o in brute.outcomes}
    label = {o.candidate.label(): o for o in brute.outcomes}
    reasons = {why.split(":")[0] for _, why in pruned.pruned}
    assert {"out of memory", "dominated"} <= reasons | {"out of memory"} and pruned.pruned
    assert any("one-micro-batch step" in why for _, why in pruned.pruned)
    for c, why in pruned.pruned:
        b = by[c]
        if why.startswith("out of memory"):
            assert b.status == "oom", (c.label(), why)
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


SMALL = dict(gpus=2, gpu="h100", global_batch=4, seq=128, pp=(1, 2), tp=(1,),
             checkpointing=("none",), max_steps=4)
SMALL_SPEC = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128"


def _table(r):
    return [(o.candidate, o.status, o.tokens_per_second, tuple(x.reserved_bytes for x in o.ranks))
            for o in r.ranked + r.rejected]


def test_cache_resumes(tmp_path):
    cache = tmp_path / "search.jsonl"
    first = tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache))
    lines = cache.read_text().splitlines()
    assert len(lines) >= len(first.outcomes)
    again = tapescope.search(SMALL_SPEC, **SMALL, cache=str(cache))
    assert all(o.cached for o in again.outcomes)
    assert _table(again) == _table(first)
    assert len(cache.read_text().splitlines()) == len(lines)   # nothing traced twice


def test_ray_returns_the_local_pools_table():
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'tapescope[cluster]')")
    local = tapescope.search(SMALL_SPEC, **SMALL, workers=2)
    on_ray = tapescope.search(SMALL_SPEC, **SMALL, ray="local", workers=2)
    assert "Ray" in on_ray.workers and "local processes" in local.workers
    assert _table(on_ray) == _table(local)


def test_cli_search_json_and_progress(tmp_path):
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["search", SMALL_SPEC, "--gpus", "2", "--global-batch", "4",
                                 "--seq", "128", "--pp", "1", "--tp", "1", "--checkpointing",
                                 "none", "--workers", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "search: " in r.output and "done" in r.output   # a plain progress line per candidate
    d = json.loads(out.read_text())
    assert d["winner"]["tapescope"].startswith("tapescope profile " + SMALL_SPEC)
    assert d["ranked"][0]["label"] == d["winner"]["label"]


def test_cli_search_nothing_fits_exits_1():
    from typer.testing import CliRunner

    from tapescope.cli import app

    r = CliRunner().invoke(app, ["search", SPEC, "--gpus", "1", "--gpu", "t4", "--global-batch",
                                 "64", "--seq", "4096", "--checkpointing", "none", "--max-steps",
                                 "1", "-q"])
    assert r.exit_code == 1, r.output
    assert "No candidate fits" in r.output and "Traceback" not in r.output
