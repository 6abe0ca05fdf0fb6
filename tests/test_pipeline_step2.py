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


def _profile(mesh, par, schedule, inputs=dm.PIPELINE_INPUTS, microbatches=None):
    pipeline = _pipeline(schedule) if microbatches is None else \
        {"schedule": schedule, "microbatches": microbatches}
    return tapescope.profile(dm.pipeline_llama, *inputs, mesh=mesh, parallelize=par,
                             pipeline=pipeline)


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


@pytest.mark.parametrize("mesh,par,microbatches", [
    ({"pp": 2}, None, 16),               # 8 of 16 micro-batches traced, the rest stood for
    ({"pp": 2, "dp_shard": 2}, dm.fsdp_stage, None),   # FSDP2's reduce-scattered gradients
], ids=["1f1b-16-shortened", "1f1b-fsdp"])
def test_a_reused_step_2_is_the_traced_step_2(monkeypatch, mesh, par, microbatches):
    inputs = dm.PIPELINE_INPUTS if microbatches is None else \
        (tapescope.spec((microbatches, 32), dtype=torch.long, high=512),) * 2
    reused = _profile(mesh, par, "1f1b", inputs, microbatches)
    assert {q.trace.step2 for q in reused.distributed.profiles.values()} == {"reused"}
    monkeypatch.setattr(PipelineStep, "step2_from_step1", False)
    traced = _profile(mesh, par, "1f1b", inputs, microbatches)
    assert {q.trace.step2 for q in traced.distributed.profiles.values()} == {"traced"}
    assert _summary(reused) == _summary(traced)
    assert reused.distributed.pipeline.time.seconds == traced.distributed.pipeline.time.seconds

