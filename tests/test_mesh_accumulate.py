"""Gradient accumulation on a mesh (issue 35): each rank traces micro-batches until one repeats
the one before it, all-gathers and reduce-scatters included, and counts the rest
(capture/session.py). Truth: the same profile with every micro-batch traced."""

import pytest

import tapescope
import tapescope.capture.session as session

from . import distributed_models as dm


def _profile(**options):
    return tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 4}, parallelize=dm.fsdp,
                             accumulate=16, **options)


def _summary(p) -> tuple:
    ranks = [(r.rank, r.traced_as, r.peak_bytes, r.first_step_peak_bytes) for r in p.ranks]
    ops = {r: sum(op.runs for op in q.ops) for r, q in p.distributed.profiles.items()}
    seconds = {r: None if q.time is None else round(q.time.seconds, 12)
               for r, q in p.distributed.profiles.items()}
    return ranks, ops, seconds


@pytest.mark.parametrize("options", [{}, {"device": "cuda", "gpu": "h100"}])
def test_fsdp_accumulation_counts_repeated_micro_batches_as_tracing_them_all(
        options, monkeypatch):
    p = _profile(**options)
    # the first micro-batch allocates the sharded gradients, the second adds to them, the third
    # repeats the second: the other 13 are counted
    assert {q.facts.get("accumulate_traced") for q in p.distributed.profiles.values()} == {3}
    monkeypatch.setattr(session.CaptureSession, "_may_stop_repeating", lambda self: False)
    full = _profile(**options)
    assert _summary(p) == _summary(full)
