"""A pipelined step's micro-batches traced until the schedule's steady state repeats (issue 35):
the rest are stood for by the last traced block (capture/repeats.py). Truth: the same profile
with every micro-batch traced (the same code path, no shortening) for peaks and op counts, and a
real gloo run of the step (one process per rank, as tests/test_pipeline.py) for the peaks.
"""

import pytest
import torch

import tapescope
import tapescope.distributed.pipeline as pipeline
from tapescope.capture.repeats import Region, repeating_regions
from tapescope.capture.records import Segment, Trace
from tapescope.validate.distributed import RealJob

from . import distributed_models as dm

# micro-batches of each case: 8 traced of 16 on 2 stages; 20 of 24 for the schedules of 4
# stages on 2 ranks (pipeline.traced_microbatches)
CASES = {"1f1b": 16, "gpipe": 16, "interleaved-1f1b": 24, "zbv": 24}


def _inputs(microbatches: int) -> tuple:
    spec = tapescope.spec((microbatches, 32), dtype=torch.long, high=512)
    return spec, spec


def _profile(schedule: str, microbatches: int):
    return tapescope.profile(dm.pipeline_llama, *_inputs(microbatches), mesh={"pp": 2},
                             pipeline={"schedule": schedule, "microbatches": microbatches})


def _summary(p) -> list:
    """Per rank: peaks, and the steady step's ops and FLOPs counted over their runs."""
    out = []
    for r in p.ranks:
        q = p.distributed.profiles[r.traced_as]
        out.append((r.rank, r.peak_bytes, r.first_step_peak_bytes,
                    sum(op.runs for op in q.ops), sum(op.total_flops or 0 for op in q.ops)))
    return out


@pytest.fixture(scope="module")
def every_microbatch():
    shortened = pipeline.traced_microbatches
    pipeline.traced_microbatches = lambda n, *_: n
    try:
        return {s: _summary(_profile(s, n)) for s, n in CASES.items()}
    finally:
        pipeline.traced_microbatches = shortened


def test_the_traced_count_leaves_the_steady_state_room_to_repeat():
    assert pipeline.traced_microbatches(4, 2) == 4           # short steps are traced whole
    assert pipeline.traced_microbatches(16, 2) == 8
    assert pipeline.traced_microbatches(128, 2) == 8
    assert pipeline.traced_microbatches(128, 4) == 12         # 2 * 4 + 3, = 128 modulo 4
    assert pipeline.traced_microbatches(13, 4) == 13
    assert pipeline.traced_microbatches(32, 4, multi=True) == 20   # 4 x 4 + 3, = 32 modulo 4


@pytest.mark.parametrize("schedule", list(CASES))
def test_a_shortened_step_has_the_peaks_and_ops_of_every_micro_batch_traced(
        every_microbatch, schedule):
    p = _profile(schedule, CASES[schedule])
    assert _summary(p) == every_microbatch[schedule]
    traced = {r: q.distributed.pipeline_traced_microbatches for r, q in
              p.distributed.profiles.items()}
    if schedule in ("1f1b", "gpipe"):
        # (GPipe's first stage: its last forward's sends differ from the others', so its last
        # backward frees what no repeated forward made: the copies go in before that backward)
        assert traced == {0: 8, 1: 8}
    elif schedule == "interleaved-1f1b":
        assert traced == {0: 20, 1: 20}
    else:
        # a V of 4 stages. Rank 0 makes its two stages' receive buffers in one run of 2 x 20
        # (a run of k x m setup ops stands for k per micro-batch); rank 1's blocks free what no
        # repeated block made: traced whole, and said
        assert traced == {0: 20, 1: None}
        assert "made before its region" in p.distributed.profiles[1].distributed.\
            pipeline_not_repeated


REAL_MICROBATCHES = 12
REAL_PIPELINE = {"schedule": "1f1b", "microbatches": REAL_MICROBATCHES}
# run with the other modules' real jobs of 2 ranks, in one spawn of processes (conftest.real_runs)
REAL_JOBS = {"1f1b": [RealJob(dm.pipeline_llama, _inputs(REAL_MICROBATCHES), {"pp": 2}, None,
                              pipeline=REAL_PIPELINE)]}


def test_a_shortened_1f1b_step_matches_its_real_gloo_processes(real_runs):
    """12 micro-batches, 8 traced: each rank's first and steady peaks equal the real rank's
    allocator peak (above it only by what gloo's thread freed late, as tests/test_pipeline.py)."""
    n, pipe = REAL_MICROBATCHES, REAL_PIPELINE
    real = real_runs[(__name__, "1f1b")][0]
    p = tapescope.profile(dm.pipeline_llama, *_inputs(n), mesh={"pp": 2}, pipeline=pipe)
    assert all(q.distributed.pipeline_traced_microbatches == 8
               for q in p.distributed.profiles.values())
    for ours, theirs in zip(p.ranks, real):
        for step, pred in ((1, ours.first_step_peak_bytes), (2, ours.peak_bytes)):
            # the first step peaks in AdamW's first update, where the CPU kernel wraps the
            # Python `sqrt / bias_correction` number in an 8- and a 4-byte tensor (the 12 bytes
            # of scalars every single-device truth allows, docs/validation.md; the same in
            # tests/test_pipeline.py's checkpointed case)
            late = theirs.late_frees.get(step, 0) + (12 if step == 1 else 0)
            assert pred <= theirs.peaks[step] <= pred + late, \
                (ours.rank, step, pred, theirs.peaks, theirs.late_frees)


def test_regions_are_found_by_the_shortest_period_with_an_action():
    trace = Trace()
    phases = ["other"] + ["forward", "other"] * 4 + ["backward"] * 3 + ["optimizer"]
    for i, ph in enumerate(phases):
        trace.segments.append(Segment(1, ph, ph, range(i, i + 1), range(i, i)))
    trace.ops = [None] * len(phases)
    regions = repeating_regions(trace, list(range(len(phases))))
    # from the left: [other, forward] four times, then the backwards
    assert regions == [Region(0, 2, 4), Region(9, 1, 3)]
