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


def test_tensor_parallel_accumulation_repeats_with_the_vocab_parallel_embeddings_literal(
        monkeypatch):
    """torchtitan's TP plan makes the embedding vocabulary-parallel: each micro-batch zeroes the
    rows of tokens another rank holds (`output[mask] = 0.0`, a scalar tensor made without a
    dispatched op and lifted). Recorded as allocated where it is lifted, each micro-batch frees
    what it allocated, so the third repeats the second (it froze a 16-micro-batch FSDP x TP 70B
    candidate of `tapescope search` at 16 traced micro-batches). Truth: every micro-batch traced."""
    from tapescope.distributed.presets import Layout, preset_parallelize
    from tapescope.zoo import resolve

    m = resolve("zoo:llama:n_layers=1,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128,vocab_size=256",
                batch=1, seq=16, inputs=[])

    def profile():
        return tapescope.profile(m.build, *m.inputs, loss_fn=m.loss_fn, mesh={"tp": 2},
                                 parallelize=preset_parallelize(Layout(tp=2)), accumulate=6)

    p = profile()
    assert {q.facts.get("accumulate_traced") for q in p.distributed.profiles.values()} == {3}
    monkeypatch.setattr(session.CaptureSession, "_may_stop_repeating", lambda self: False)
    full = profile()
    assert _summary(p) == _summary(full)
