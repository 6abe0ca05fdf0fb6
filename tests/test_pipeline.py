"""Pipeline parallelism: each rank's step under torch.distributed.pipelining's own schedules.

Truth: `validate.distributed.run_real_jobs` runs the same pipelined step in one process per rank
(gloo on the CPU, the same split, stages and schedule), and each rank's allocator reports its
peak; tapescope traces every rank in one process with the fake process group. Each rank's first
and steady-state peaks must be equal to the byte.
"""

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.distributed.pipeline import block_range, split_blocks
from tapescope.errors import TapescopeError
from tapescope.validate.distributed import RealJob, run_real_jobs

from . import distributed_models as dm

MICROBATCHES = 4
CASES = {
    2: [("1f1b", {"pp": 2}, None), ("gpipe", {"pp": 2}, None),
        ("interleaved-1f1b", {"pp": 2}, None)],  # stages 0, 2 on rank 0; 1, 3 on rank 1
    4: [("1f1b", {"pp": 2, "dp_shard": 2}, dm.fsdp_stage)],  # 2-D: FSDP2 inside each stage
}


def _pipeline(schedule):
    return {"schedule": schedule, "microbatches": MICROBATCHES}


@pytest.fixture(scope="module")
def real():
    out = {}
    for world, cases in CASES.items():
        jobs = [RealJob(dm.pipeline_llama, dm.PIPELINE_INPUTS, mesh, par,
                        pipeline=_pipeline(schedule)) for schedule, mesh, par in cases]
        for (schedule, _, _), ranks in zip(cases, run_real_jobs(jobs)):
            out[(world, schedule)] = ranks
    return out


@pytest.mark.parametrize("world,schedule", [(w, s) for w, cases in CASES.items()
                                            for s, _, _ in cases])
def test_every_rank_of_a_pipeline_matches_its_real_process(real, world, schedule):
    mesh, par = next((m, p) for s, m, p in CASES[world] if s == schedule)
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh=mesh, parallelize=par,
                          pipeline=_pipeline(schedule))
    assert len(p.ranks) == world
    for ours, theirs in zip(p.ranks, real[(world, schedule)]):
        assert ours.first_step_peak_bytes == theirs.peaks[1], (ours.rank, theirs.peaks)
        assert ours.peak_bytes == theirs.peaks[2], (ours.rank, theirs.peaks)
    assert p.peak_bytes == max(r.peak_bytes for r in p.ranks)


def test_each_pipeline_coordinate_is_traced_and_its_fsdp_peers_share_it():
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh={"pp": 2, "dp_shard": 2},
                          parallelize=dm.fsdp_stage, pipeline=_pipeline("1f1b"))
    assert [r.stages for r in p.ranks] == [(0,), (0,), (1,), (1,)]
    assert [r.traced_as for r in p.ranks] == [0, 0, 2, 2]


def test_interleaved_and_v_schedules_place_stages_as_torch_does():
    from tapescope.values.pipeline import pipeline_spec

    assert pipeline_spec("interleaved-1f1b").stages_of(1, 4) == (1, 5)
    assert pipeline_spec({"schedule": "interleaved-1f1b", "stages_per_rank": 3}).stages_of(
        2, 4) == (2, 6, 10)
    assert pipeline_spec("zbv").stages_of(0, 4) == (0, 7)   # the V: first and last on rank 0
    assert pipeline_spec("ScheduleZBVZeroBubble").schedule == "zbv"


def test_the_default_split_keeps_each_stage_s_blocks_and_the_ends():
    model = dm.pipeline_llama()
    assert [list(block_range(s, 3, 4)) for s in range(3)] == [[0], [1], [2, 3]]
    first, last = split_blocks(model, 0, 2), split_blocks(model, 1, 2)
    assert first.tok_embeddings is model.tok_embeddings and first.output is None
    assert last.tok_embeddings is None and last.norm is model.norm
    assert [b is not None for b in first.layers] == [True, True, False, False]
    assert [b is not None for b in last.layers] == [False, False, True, True]
    assert all(b is not None for b in model.layers)  # the model itself is left as it was
    assert first.layers[0] is model.layers[0]        # blocks are shared, not copied


@pytest.mark.parametrize("kwargs,message", [
    ({"mesh": {"dp": 2}, "pipeline": "1f1b", "parallelize": lambda m, mesh: m}, "'pp' dimension"),
    ({"mesh": {"pp": 2}, "pipeline": "1f2b"}, "unknown pipeline schedule"),
    ({"mesh": {"pp": 4}, "pipeline": {"schedule": "1f1b", "microbatches": 2}},
     "at least as many micro-batches"),
    ({"mesh": {"pp": 2}, "pipeline": "1f1b", "accumulate": 2}, "accumulates over its micro"),
    ({"mesh": {"pp": 2}, "pipeline": {"schedule": "gpipe", "stages_per_rank": 2}},
     "one stage per rank"),
])
def test_bad_pipeline_options_are_refused_with_what_to_do(kwargs, message):
    with pytest.raises(TapescopeError, match=message):
        tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, **kwargs)


def test_a_model_without_a_block_list_needs_its_own_split():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(TapescopeError, match="pipeline split"):
        tapescope.profile(model, torch.randn(4, 8), torch.randn(4, 8), mesh={"pp": 2},
                          pipeline="gpipe")


def test_a_user_split_makes_the_stages():
    def split(model, stage, num_stages):
        return model[stage]   # one Linear per stage

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    p = tapescope.profile(model, torch.randn(4, 8), torch.randn(4, 8), mesh={"pp": 2},
                          pipeline={"schedule": "gpipe", "microbatches": 2, "split": split})
    assert [r.stages for r in p.ranks] == [(0,), (1,)]
    params = {r.rank: p.distributed.profiles[r.traced_as].facts["parameters"] for r in p.ranks}
    assert params == {0: 8 * 16 + 16, 1: 16 * 8 + 8}
