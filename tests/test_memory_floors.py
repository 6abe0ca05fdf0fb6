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
    f = fsdp2_state_across_micro_batches(fsdp, model)
    assert f.bytes == 2 * BLOCK * (2 + 4 + 1) == 17_498_750_976
    tp = Candidate(Layout(fsdp=2, tp=2, pp=2), 1, 4, schedule="1f1b")
    assert fsdp2_state_across_micro_batches(tp, model).bytes == 2 * (BLOCK // 2) * (2 + 4 + 2)
    assert "unsharded" in f.reason and f.stage == 0
    # last_stage_loss, the largest here: at the last stage's second backward's loss in step 2,
    # its blocks' fp32 unsharded gradients (4 bytes an element), their shards and AdamW's two
    # states of each (3 x 4 / 4); the root group's (the final norm and the 256 x 4,096 output
    # layer) shards and states, its bf16 unsharded parameters and fp32 unsharded gradients
    # (3 x 4 / 4 + 2 + 4); the last block's bf16 unsharded parameters (2: not resharded after
    # forward); 32 tokens x 256 logits: gradient and output (4 + 4), the bf16 logits and the
    # saved log-probabilities (2 + 4)
    root = 4096 + 256 * 4096
    last = memory_floor(fsdp, model)
    assert last.stage == 1 and last.bytes == 2 * BLOCK * (4 + 3) + root // 4 * 3 * 4 \
        + root * (2 + 4) + BLOCK * 2 + 32 * 256 * (4 + 4 + 2 + 4) == 20_008_161_280


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


# ---- the last stage's loss (last_stage_loss) ---------------------------------------------------

# a model whose memory is its logits: 2 small blocks under Llama 3's 128,256-token vocabulary at
# 2,048 tokens (a trace's cost is its ops, not its sizes)
LOGITS_SPEC = ("zoo:llama:n_layers=2,dim=256,n_heads=4,n_kv_heads=4,ffn_dim=512,"
               "vocab_size=128256,max_seq_len=2048")
LOGITS_SPACE = dict(gpus=8, gpu="t4", global_batch=16, seq=2048, pp=(1, 2), tp=(1, 4),
                    checkpointing=("none",), max_steps=4, gpus_per_node=8)


@pytest.fixture(scope="module")
def logits_searches(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("loss") / "cache.jsonl")
    pruned = tapescope.search(LOGITS_SPEC, **LOGITS_SPACE, top=2, cache=cache)
    return pruned, tapescope.search(LOGITS_SPEC, **LOGITS_SPACE, brute_force=True, cache=cache)


def test_loss_floor_bytes_by_hand():
    """last_stage_loss from the model alone, by hand: PP 2 x TP 4, mb 8, 2 micro-batches 1F1B.
    The last stage runs F B F B, one micro-batch in flight at each backward; at its loss's
    _log_softmax_backward_data: 8 x 2,048 tokens x 128,256 logits (the Llama plan gathers them
    whole) of fp32 gradient (4 bytes), fp32 output (4), the saved fp32 log-probabilities (4)
    and the bf16 logits in the stage's fwd_cache (2); beside the stage's parameters, at least
    their TP 4 piece, fp32, and AdamW's exp_avg and exp_avg_sq of each (3 x 4 bytes):
    block 1's four 256 x 256 and three 512 x 256 linears and two norms, the final norm and the
    128,256 x 256 output layer, each a quarter."""
    from tapescope.layout_search.memory_floors import last_stage_loss

    model = model_parameters(Source(LOGITS_SPEC, 2048, "t4"))
    assert (model.vocab, model.vocab_gathered, model.tokens, model.optimizer_states) == \
        (128256, True, 2048, 2)
    params = 4 * 256 * 256 // 4 + 3 * 512 * 256 // 4 + 2 * 256 // 4 + 256 // 4 + 128256 * 256 // 4
    f = last_stage_loss(Candidate(Layout(tp=4, pp=2), 8, 2, schedule="1f1b"), model)
    assert f.stage == 1
    assert f.bytes == params * 4 * 3 + 8 * 2048 * 128256 * (4 + 4 + 4 + 2) == 29_519_317_248
    # GPipe: both forwards before the first backward, so two micro-batches' logits and
    # log-probabilities at its loss
    g = last_stage_loss(Candidate(Layout(tp=4, pp=2), 8, 2, schedule="gpipe"), model)
    assert g.bytes - f.bytes == 8 * 2048 * 128256 * (4 + 2)
    for c in (Candidate(Layout(tp=4, pp=2), 8, 2, schedule="interleaved-1f1b"),
              Candidate(Layout(tp=4, pp=2), 8, 2, schedule="1f1b", compile=True),
              Candidate(Layout(tp=4), 8, 2)):
        assert last_stage_loss(c, model) is None, c.label()


def test_every_floor_at_most_every_traced_peak(logits_searches, searches, model):
    """Soundness of each rule apart, against brute force on two spaces (the logits' and the
    parameters'): on every pipelined candidate, each rule's floor (with the unpipelined traces
    as twins) is at most the peak live bytes of every rank class of its stage."""
    from tapescope.layout_search.memory_floors import FLOORS

    spaces = ((logits_searches[1], model_parameters(Source(LOGITS_SPEC, 2048, "t4"))),
              (searches[1], model))
    checked = 0
    for brute, params in spaces:
        twins = Twins()
        for o in brute.outcomes:
            twins.add(o)
        for o in brute.outcomes:
            if o.candidate.layout.pp == 1:
                continue
            for rule in FLOORS:
                f = rule(o.candidate, params, twins)
                if f is None:
                    continue
                peaks = [r.peak_bytes for r in o.ranks if _stage(o.candidate, r.ranks[0]) == f.stage]
                assert peaks and f.bytes <= min(peaks), \
                    (rule.__name__, o.candidate.label(), f.bytes, peaks)
                checked += 1
    assert checked >= 10


def test_loss_floor_rules_out_before_the_trace(logits_searches):
    """The pruned search (top 2) rules PP 2 x TP 4, mb 8 out by last_stage_loss's floor without
    tracing it, rules out by memory only what brute force's traces find out of memory, and its
    top 2 are brute force's."""
    pruned, brute = logits_searches
    by_floor = {c.label(): why for c, why in pruned.pruned
                if why.startswith("out of memory: pipeline")}
    assert "PP 2 x TP 4, mb 8, 2 micro-batches 1f1b" in by_floor
    assert "_log_softmax_backward_data" in by_floor["PP 2 x TP 4, mb 8, 2 micro-batches 1f1b"]
    traced = {o.candidate.label() for o in pruned.outcomes}
    assert not traced & set(by_floor)
    status = {o.candidate: o.status for o in brute.outcomes}
    assert all(status[c] == "oom" for c, why in pruned.pruned if why.startswith("out of memory"))
    assert [o.candidate for o in pruned.ranked[:2]] == [o.candidate for o in brute.ranked[:2]]
    assert len(pruned.ranked) >= 2


def test_loss_floor_on_the_benchmark_space():
    """benchmarks/search_speed.py's 8 L4s (2 blocks of Llama 3 8B, 4,096 tokens): the floor from
    the model alone rules out PP 2 x TP 4, mb 8 before any trace; its trace (0.6 CPU s) runs
    out of memory, its last stage's tensors above the floor."""
    from tapescope.layout_search.evaluate import evaluate
    from tapescope.layout_search.memory_floors import last_stage_loss

    spec = ("zoo:llama:n_layers=2,dim=4096,n_heads=32,n_kv_heads=8,ffn_dim=14336,"
            "vocab_size=128256,max_seq_len=8192")
    source = Source(spec, 4096, "l4")
    c = Candidate(Layout(tp=4, pp=2), 8, 2, schedule="1f1b")
    f = last_stage_loss(c, model_parameters(source))
    capacity = allocator_capacity(tapescope.options.Options.create(gpu="l4").gpu)
    assert f.bytes > capacity
    o = evaluate(source, c, 16 * 4096)
    assert o.status == "oom"
    assert f.bytes <= min(r.peak_bytes for r in o.ranks if _stage(c, r.ranks[0]) == 1)
