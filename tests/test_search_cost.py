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


def test_a_jobs_profile_reads_its_ranks_analyses_once():
    """The Profile a distributed profile returns is its highest-peak rank's trace with the job's
    facts added: its step time is that rank's, not run again (at 70B a second run of the time
    model cost up to a second a candidate); the kernels the time model and the search's bounds
    price are found once per rank, each priced as the kernel model prices that op alone."""
    from tapescope.analysis.kernel_cost import on_gpu
    from tapescope.analysis.op_classes import launches_kernel
    from tapescope.analysis.timing import estimate_step_time, kernel_seconds
    from tapescope.api import profile_workload
    from tapescope.layout_search.evaluate import candidate_options

    source = Source(SPEC, seq=128, gpu="h100")
    workload, options = candidate_options(source, Candidate(Layout(fsdp=2, tp=2)))
    p = profile_workload(workload, options)
    top = next(q for q in p.distributed.profiles.values() if q.trace is p.trace)
    assert p.time is top.time
    # the same step time as the time model finding each op's kernel itself
    comm = {c.op: c.seconds for c in top.collectives}
    streams = {c.op: c.stream for c in top.collectives}
    assert estimate_step_time(top.ops, top.trace, top.gpu, comm, streams).seconds == \
        top.time.seconds
    storages = top.trace.storages
    launching = [launches_kernel(op.record.func) and on_gpu(op, storages) for op in top.ops]
    assert [k is not None for k in top.kernels] == launching and any(launching)
    assert list(top.kernel_prices) == [kernel_seconds(op, top.gpu, storages)[0] if k else 0.0
                                       for op, k in zip(top.ops, launching)]
