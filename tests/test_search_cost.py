"""What a search candidate costs: `Outcome.cpu_seconds` is the CPU time its profile took in the
process that traced it (on a shared machine the wall time is the load's), checked against the
process's own CPU clock read around the call, and kept through the cache."""

from __future__ import annotations

import time

from tapescope.distributed.presets import Layout
from tapescope.layout_search.evaluate import Outcome, Source, evaluate
from tapescope.layout_search.space import Candidate

SPEC = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128"


def test_a_candidates_cpu_seconds_are_the_process_clocks():
    source = Source(SPEC, seq=128, gpu="h100")
    # a pipelined candidate: two stages, each traced
    c = Candidate(Layout(fsdp=1, tp=1, pp=2), micro_batch=1, steps=2, schedule="1f1b")
    evaluate(source, c, 4 * 128)   # imports and first-call caches out of the measured call
    before = time.process_time()
    o = evaluate(source, c, 4 * 128)
    measured = time.process_time() - before
    assert o.fits and len(o.ranks) == 2
    # the profile is all of the call but building the Outcome: the same clock, within it
    assert 0.9 * measured <= o.cpu_seconds <= measured
    back = Outcome.from_dict(o.to_dict())
    assert back.cpu_seconds == o.cpu_seconds and back.cached
