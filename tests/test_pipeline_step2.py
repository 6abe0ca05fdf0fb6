"""A pipelined step's step 2 built from step 1's records (capture/first_step.py, issue 35).

Truth: the same profile with step 2 traced in full (the same capture, the reuse switched off):
step 2's ops and its allocations and frees, in order and by size, must be the traced step 2's,
and so its peak, FLOPs and time. Against the real gloo processes: tests/test_pipeline.py (its
`test_step_2_is_reused_where_proven_and_keeps_the_real_peak`, beside the real runs it makes).
"""

from bisect import bisect_right

import pytest
import torch

import tapescope
from tapescope.analysis.steps import step_views
from tapescope.distributed.pipeline import PipelineStep

from . import distributed_models as dm
from .test_pipeline import _pipeline


def _profile(mesh, par, schedule, inputs=dm.PIPELINE_INPUTS, microbatches=None, **where):
    pipeline = _pipeline(schedule) if microbatches is None else \
        {"schedule": schedule, "microbatches": microbatches}
    return tapescope.profile(dm.pipeline_llama, *inputs, mesh=mesh, parallelize=par,
                             pipeline=pipeline, **where)


def _step2(trace) -> tuple:
    """Step 2 as a program: its ops (function, shapes) and its events (the ops before each, +1 /
    -1, bytes), storage ids left out; and the bytes alive when it starts."""
    view = step_views(trace)[2]
    ops = [(trace.ops[i].func, [t.shape for t in trace.ops[i].tensor_outputs()],
            [t.shape for t in trace.ops[i].tensor_inputs()]) for i in view.ops]
    order = sorted(view.ops)   # (a view's ops run in trace order within each segment)
    events = [(bisect_right(order, op), delta, trace.storages[sid].nbytes)
              for op, sid, delta in view.events]
    start = sum(trace.storages[sid].nbytes for sid in view.initial
                if trace.storages[sid].device == trace.device)
    return ops, events, start


def _summary(p) -> dict:
    out = {}
    for rank, q in p.distributed.profiles.items():
        out[rank] = (q.peak_bytes, q.first_step_peak_bytes, sum(op.runs for op in q.ops),
                     sum(op.total_flops or 0 for op in q.ops),
                     None if q.time is None else q.time.seconds, _step2(q.trace))
    return out


def _both(monkeypatch, mesh, par, inputs, microbatches=None, **where):
    """The profile with step 2 built from step 1, and with step 2 traced."""
    reused = _profile(mesh, par, "1f1b", inputs, microbatches, **where)
    assert {q.trace.step2 for q in reused.distributed.profiles.values()} == {"reused"}
    with monkeypatch.context() as m:
        m.setattr(PipelineStep, "step2_from_step1", False)
        traced = _profile(mesh, par, "1f1b", inputs, microbatches, **where)
    assert {q.trace.step2 for q in traced.distributed.profiles.values()} == {"traced"}
    return reused, traced


def test_a_reused_step_2_is_the_traced_step_2(monkeypatch):
    """1F1B on 2 ranks, 16 micro-batches (8 traced, the rest stood for), timed on an H100 (the
    schedule's time reads step 2's compute actions): step 2 is the traced one op for op and
    event for event, and so are the peaks, FLOPs, times and the caching allocator's replay."""
    inputs = (tapescope.spec((16, 32), dtype=torch.long, high=512),) * 2
    reused, traced = _both(monkeypatch, {"pp": 2}, None, inputs, 16, device="cuda", gpu="h100")
    assert _summary(reused) == _summary(traced)
    assert reused.distributed.pipeline.time.to_dict() == traced.distributed.pipeline.time.to_dict()
    assert all(q.cuda_memory == traced.distributed.profiles[r].cuda_memory
               for r, q in reused.distributed.profiles.items())


def test_fsdp2_s_lazy_initialisation_is_all_a_reused_step_2_adds(monkeypatch):
    """1F1B with FSDP2 inside each stage (its gradients reduce-scattered). FSDP2's first unshard
    of each parameter group makes its all-gather outputs and unsharded parameters' views
    (`init_all_gather_outputs`, `init_unsharded_param`): ops of step 1 that later steps skip,
    which a reused step 2 keeps, as the built-in step's does. They run no kernel and allocate
    nothing: the allocations and frees are the traced step 2's, in order and by size, and so
    the peaks, FLOPs and kernel times."""
    from collections import Counter

    from tapescope.analysis.op_classes import launches_kernel

    reused, traced = _both(monkeypatch, {"pp": 2, "dp_shard": 2}, dm.fsdp_stage,
                           dm.PIPELINE_INPUTS)
    for rank, q in reused.distributed.profiles.items():
        t = traced.distributed.profiles[rank]
        assert (q.peak_bytes, q.first_step_peak_bytes) == (t.peak_bytes, t.first_step_peak_bytes)
        assert sum(op.total_flops or 0 for op in q.ops) == sum(op.total_flops or 0 for op in t.ops)
        (q_ops, q_events, q_start), (t_ops, t_events, t_start) = _step2(q.trace), _step2(t.trace)
        assert [e[1:] for e in q_events] == [e[1:] for e in t_events] and q_start == t_start
        assert not Counter(o[0] for o in t_ops) - Counter(o[0] for o in q_ops)
        extra = Counter(o[0] for o in q_ops) - Counter(o[0] for o in t_ops)
        assert extra and not any(launches_kernel(f) for f in extra), extra
