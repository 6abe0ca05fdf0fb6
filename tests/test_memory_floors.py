"""layout_search/memory_floors.py: the floor on a pipelined candidate's per-rank live bytes,
against brute force (every candidate of a reduced space traced: each rank class's peak live
bytes are at least the floor, and the gate rules out only candidates whose trace runs out of
memory), and its bytes derived by hand from the model's shapes.

The space: 8 T4s (14.28 GiB for the allocator), a 4-block Llama whose blocks are almost all
parameters (dim 4,096, FFN 98,304, 32 tokens): PP 2 x FSDP 4 keeps two blocks' unsharded
parameters and gradients on each stage (16.3 GiB), more than a T4 holds, while FSDP 4 x TP 2
fits. A trace's cost is its ops, not its sizes (about 5 CPU s for brute force's 6)."""

from __future__ import annotations

import pytest
import torch

import tapescope
from tapescope.distributed.presets import Layout
from tapescope.layout_search import Source
from tapescope.layout_search.memory_floors import (
    ModelParameters, Twins, _least_tp_chunk, activations_in_flight, allocator_capacity,
    fsdp2_state_across_micro_batches, memory_floor, model_parameters)
from tapescope.layout_search.space import Candidate
from tapescope.values.mesh import mesh_spec

SPEC = "zoo:llama:n_layers=4,dim=4096,n_heads=32,n_kv_heads=8,ffn_dim=98304,vocab_size=256"
SPACE = dict(gpus=8, gpu="t4", global_batch=8, seq=32, pp=(1, 2), tp=(1, 2),
             checkpointing=("none",), max_steps=4, gpus_per_node=8)

# one block's parameters by hand: wq and wo 4,096 x 4,096; wk and wv 1,024 x 4,096 (8 KV heads
# of 128); w1, w3 98,304 x 4,096 and w2 4,096 x 98,304; two RMSNorm weights of 4,096
LINEARS = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 98304 * 4096
NORMS = 2 * 4096
BLOCK = LINEARS + NORMS


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("floors") / "cache.jsonl")
    pruned = tapescope.search(SPEC, **SPACE, top=2, cache=cache)
    return pruned, tapescope.search(SPEC, **SPACE, brute_force=True, cache=cache)


@pytest.fixture(scope="module")
def model():
    return model_parameters(Source(SPEC, 32, "t4"))


def test_floor_bytes_by_hand(model):
    """Component (2) and (3) from the shapes: a stage of PP 2 x FSDP 4 holds 2 of the 4 blocks;
    per element 2 bytes of bf16 unsharded parameter, 4 of fp32 unsharded gradient and 4 / 4 of
    its fp32 shard. With TP 2 every weight (the norms too: the floor does not know the plan)
    counts half."""
    assert [sum(torch.Size(s).numel() for s in b) for b in model.blocks] == [BLOCK] * 4
    fsdp = Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="1f1b")
    f = memory_floor(fsdp, model)
    assert f.bytes == 2 * BLOCK * (2 + 4 + 1) == 17_498_750_976
    tp = Candidate(Layout(fsdp=2, tp=2, pp=2), 1, 4, schedule="1f1b")
    assert memory_floor(tp, model).bytes == 2 * (BLOCK // 2) * (2 + 4 + 2)
    assert "unsharded" in f.reason and f.stage == 0


def test_floor_applies_only_where_proven(model):
    """None: no pipeline, no FSDP2 on the stage, a schedule with several stages a rank or split
    backwards, compile, float8."""
    base = Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="1f1b")
    assert fsdp2_state_across_micro_batches(base, model) is not None
    assert fsdp2_state_across_micro_batches(
        Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="gpipe"), model) is not None
    for c in (Candidate(Layout(fsdp=8), 1, 1),
              Candidate(Layout(tp=2, pp=2, dp_replicate=2), 1, 2, schedule="1f1b"),
              Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="interleaved-1f1b"),
              Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="zbv"),
              Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="1f1b", compile=True),
              Candidate(Layout(fsdp=4, pp=2), 1, 2, schedule="1f1b", float8="tensorwise")):
        assert fsdp2_state_across_micro_batches(c, model) is None, c.label()
    # more stages than blocks: no split to bound
    few = ModelParameters(model.blocks[:1], model.dtype, model.param_dtype, model.reduce_dtype)
    assert fsdp2_state_across_micro_batches(base, few) is None


def test_least_tensor_parallel_chunk():
    """torch.chunk's smallest piece over any one dimension, or the whole when replicated."""
    assert _least_tp_chunk((4096, 1024), 2) == 2048 * 1024
    assert _least_tp_chunk((4096,), 1) == 4096
    assert _least_tp_chunk((10,), 4) == 1          # 3, 3, 3, 1
    assert _least_tp_chunk((10, 6), 4) == 0        # dim 1: 2, 2, 2, 0
    assert _least_tp_chunk((3,), 4) == 0           # 1, 1, 1, (none)


def _stage(c: Candidate, rank: int) -> int:
    return mesh_spec(c.layout.mesh).coordinate(rank)["pp"]


def test_floor_at_most_every_traced_peak(searches, model):
    """Soundness against the trace: every pipelined candidate's floor is at most the peak live
    bytes of every rank class of the floor's stage (and the floor is most of it here)."""
    _, brute = searches
    piped = [o for o in brute.outcomes if o.candidate.layout.pp > 1]
    assert len(piped) == 3
    twins = Twins()
    for o in brute.outcomes:
        twins.add(o)
    assert {o.candidate.label() for o in brute.outcomes if o.saved_bytes} == {
        o.candidate.label() for o in brute.outcomes if o.candidate.layout.pp == 1}
    for o in piped:
        f = memory_floor(o.candidate, model, twins)
        assert activations_in_flight(o.candidate, model, twins) is not None
        assert f is not None, o.candidate.label()
        peaks = [r.peak_bytes for r in o.ranks if _stage(o.candidate, r.ranks[0]) == f.stage]
        assert peaks and f.bytes <= min(peaks), (o.candidate.label(), f.bytes, peaks)
        assert f.bytes >= 0.6 * min(peaks), (o.candidate.label(), f.bytes, peaks)


def test_gate_prunes_only_what_runs_out(searches):
    """The pruned search rules PP 2 x FSDP 4 out of memory by its floor without tracing it;
    brute force's trace of it runs out of memory; every "out of memory" the pruned search
    gives is one in brute force, and its ranking is brute force's."""
    pruned, brute = searches
    capacity = allocator_capacity(tapescope.options.Options.create(gpu="t4").gpu)
    by_floor = {c: why for c, why in pruned.pruned if why.startswith("out of memory: pipeline")}
    assert [c.label() for c in by_floor] == ["PP 2 x FSDP 4, mb 1, 2 micro-batches 1f1b"]
    assert f"{capacity / 2**30:,.1f} GiB" in next(iter(by_floor.values()))
    assert not {o.candidate for o in pruned.outcomes} & set(by_floor)
    status = {o.candidate: o.status for o in brute.outcomes}
    assert all(status[c] == "oom" for c, why in pruned.pruned if why.startswith("out of memory"))
    assert [o.candidate for o in pruned.ranked] == [o.candidate for o in brute.ranked]
    assert pruned.ranked


def test_full_checkpointing_keeps_each_blocks_output():
    """Component (1) by hand: with every block checkpointed whole, what a block's forward leaves
    for the backward is its output alone (the next block's checkpoint, or the final norm,
    saves it): micro-batch x tokens x dim bf16 bytes (2 x 128 x 64 x 2); the head keeps more
    (the logits for the loss)."""
    from tapescope.layout_search.evaluate import evaluate

    spec = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128"
    o = evaluate(Source(spec, 128, "h100"), Candidate(Layout(fsdp=4), 2, 1, "full"), 8 * 128)
    assert [r[:2] for r in o.saved_bytes] == [(2 * 128 * 64 * 2,) * 2]
    assert all(r[2] > 2 * 128 * 32000 * 2 for r in o.saved_bytes)   # bf16 logits at least
