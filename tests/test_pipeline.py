"""Pipeline parallelism: each rank's step under torch.distributed.pipelining's own schedules.

Truth: `validate.distributed.run_real_jobs` runs the same pipelined step in one process per rank
(gloo on the CPU, the same split, stages and schedule), and each rank's allocator reports its
peak; tapescope traces every rank in one process with the fake process group. Each rank's first
and steady-state peaks must be equal to the byte (above it only by what gloo's worker thread
freed late, out of the profiler's sight, in that step); ranks that run the same program (FSDP2
peers of a stage) are several observations of one peak, and the least delayed one counts.
"""

import logging
from collections import Counter

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.distributed.pipeline import block_range, split_blocks
from tapescope.errors import TapescopeError
from tapescope.validate.distributed import RealJob

from . import distributed_models as dm

MICROBATCHES = 4
CASES = {
    2: [("1f1b", {"pp": 2}, None), ("gpipe", {"pp": 2}, None),
        ("interleaved-1f1b", {"pp": 2}, None),  # stages 0, 2 on rank 0; 1, 3 on rank 1
        ("looped-bfs", {"pp": 2}, None),
        # zero bubble: the backward split into input and weight backwards (pre-hooks on
        # autograd's C++ nodes capture the gradients between them)
        ("interleaved-zb", {"pp": 2}, None),
        ("zbv", {"pp": 2}, None),  # a V: stages 0, 3 on rank 0; 1, 2 on rank 1
        ("dualpipev", {"pp": 2}, None)],
    4: [("1f1b", {"pp": 2, "dp_shard": 2}, dm.fsdp_stage),  # 2-D: FSDP2 inside each stage
        ("interleaved-1f1b", {"pp": 2, "dp_shard": 2}, dm.fsdp_stage)],  # two FSDP2 roots a rank
}
# activation checkpointing on every block of each stage (checkpoint_wrapper, torchtitan's
# apply_ac), run in the world-2 processes above: each micro-batch's blocks recompute in its
# backward, inside stage_backward
CHECKPOINTED = ("1f1b", {"pp": 2}, dm.ac_stage)


def _pipeline(schedule):
    return {"schedule": schedule, "microbatches": MICROBATCHES}


RUN = {world: cases + [CHECKPOINTED] if world == 2 else cases for world, cases in CASES.items()}
# one key a world size: the session runs them with the other modules' jobs of that world size,
# in one spawn of processes (conftest.real_runs)
REAL_JOBS = {world: [RealJob(dm.pipeline_llama, dm.PIPELINE_INPUTS, mesh, par,
                             pipeline=_pipeline(schedule)) for schedule, mesh, par in cases]
             for world, cases in RUN.items()}


@pytest.fixture(scope="module")
def real(real_runs):
    out = {}
    for world, cases in RUN.items():
        for (schedule, _, par), ranks in zip(cases, real_runs[(__name__, world)]):
            out[(world, schedule, par is dm.ac_stage)] = ranks
    return out


@pytest.mark.parametrize("world,schedule", [(w, s) for w, cases in CASES.items()
                                            for s, _, _ in cases])
def test_every_rank_of_a_pipeline_matches_its_real_process(real, world, schedule):
    mesh, par = next((m, p) for s, m, p in CASES[world] if s == schedule)
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh=mesh, parallelize=par,
                          pipeline=_pipeline(schedule))
    assert len(p.ranks) == world
    # ranks that run the same program (FSDP2 peers of one stage) are observations of one peak:
    # a real run's delays only ever raise it (gloo's thread freeing late, or later than the
    # program's own order under load), so none is below the prediction and one equals it, or
    # exceeds it by no more than what a backend thread freed late in that step
    classes: dict = {}
    for ours, theirs in zip(p.ranks, real[(world, schedule, False)]):
        assert theirs.unstepped == 0   # the real run trained every parameter of its stages
        classes.setdefault(ours.traced_as, (ours, []))[1].append(theirs)
    for ours, reals in classes.values():
        for step, pred in ((1, ours.first_step_peak_bytes), (2, ours.peak_bytes)):
            seen = [(t.peaks[step], t.late_frees.get(step, 0)) for t in reals]
            assert all(peak >= pred for peak, _ in seen), (ours.rank, step, pred, seen)
            assert any(peak <= pred + late for peak, late in seen), (ours.rank, step, pred, seen)
    assert p.peak_bytes == max(r.peak_bytes for r in p.ranks)


def test_checkpointed_blocks_in_every_stage_match_the_real_processes(real):
    """1F1B, 2 stages, every block in checkpoint_wrapper: each micro-batch's blocks keep only
    their inputs and recompute in stage_backward (RNG state saved and restored around it)."""
    schedule, mesh, par = CHECKPOINTED
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh=mesh, parallelize=par,
                          pipeline=_pipeline(schedule))
    for ours, theirs in zip(p.ranks, real[(2, schedule, True)]):
        ops = p.distributed.profiles[ours.traced_as].ops
        assert any(op.recompute for op in ops)
        for step, pred in ((1, ours.first_step_peak_bytes), (2, ours.peak_bytes)):
            # the first step peaks in AdamW's first update, inside `sqrt / bias_correction`:
            # the CPU kernel wraps the Python number in an 8- and a 4-byte tensor (the 12
            # bytes of scalars every single-device truth allows, docs/validation.md)
            late = theirs.late_frees.get(step, 0)
            assert pred <= theirs.peaks[step] <= pred + 12 + late, \
                (ours.rank, step, pred, theirs.peaks, theirs.late_frees)
    # the case checkpoints (each real rank's steady peak is below the plain 1F1B run's)
    assert all(c.peaks[2] < q.peaks[2] for c, q in zip(real[(2, schedule, True)],
                                                       real[(2, schedule, False)]))


def test_each_pipeline_coordinate_is_traced_and_its_fsdp_peers_share_it():
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh={"pp": 2, "dp_shard": 2},
                          parallelize=dm.fsdp_stage, pipeline=_pipeline("1f1b"))
    assert [r.stages for r in p.ranks] == [(0,), (0,), (1,), (1,)]
    assert [r.traced_as for r in p.ranks] == [0, 0, 2, 2]


def test_interleaved_schedules_place_stages_as_torch_does():
    from tapescope.values.pipeline import pipeline_spec

    assert pipeline_spec("interleaved-1f1b").stages_of(1, 4) == (1, 5)
    assert pipeline_spec({"schedule": "interleaved-1f1b", "stages_per_rank": 3}).stages_of(
        2, 4) == (2, 6, 10)
    assert pipeline_spec("Schedule1F1B").schedule == "1f1b"       # torch's class names too
    assert pipeline_spec("ScheduleZBVZeroBubble").stages_of(0, 4) == (0, 7)   # a V
    with pytest.raises(TapescopeError, match="unknown pipeline schedule"):
        pipeline_spec("zero-bubble-h1")


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


def test_edge_modules_are_what_the_split_puts_on_one_end_only():
    """edge_modules (what layout_search/bounds.py puts on the first / last stage) against the
    split itself: the leaf modules each end stage holds besides its blocks, and no other."""
    from tapescope.distributed.pipeline import edge_modules

    model = dm.pipeline_llama()
    blocks, first, last = edge_modules(model)
    assert blocks == [f"layers.{i}" for i in range(4)]

    def own(stage):   # the top-level modules a stage holds besides its block list
        return sorted(n for n, m in stage.named_children() if m is not None and n != "layers")

    assert own(split_blocks(model, 0, 3)) == sorted(first) == ["tok_embeddings"]
    assert own(split_blocks(model, 2, 3)) == sorted(last) == ["norm", "output"]
    assert own(split_blocks(model, 1, 3)) == []


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


def test_activations_between_stages_require_grad():
    """A received activation that does not require grad gets no gradient: the stages before it
    would train on garbage and the zero-bubble split backward finds no weights (the static
    metadata must say requires_grad, as the dynamic inference's does)."""
    from tapescope.distributed.pipeline import pipeline_plan
    from tapescope.options import Options, Workload

    options = Options.create(mesh={"pp": 2}, pipeline=_pipeline("1f1b"))
    plan = pipeline_plan(Workload(dm.pipeline_llama, dm.PIPELINE_INPUTS, {}), options)
    assert plan.shapes[0].inputs == (((2, 32), torch.int64, False),)   # the tokens
    assert plan.shapes[1].inputs == (((2, 32, 64), torch.float32, True),)


def test_schedule_time_of_gpipe_by_hand():
    """GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s, no transfer time: stage 1
    runs F0 [1, 2], F1 [2, 3], B0 [3, 5], B1 [5, 7]; stage 0 F0 [0, 1], F1 [1, 2], B0 waits
    for stage 1's B0: [5, 7], B1 [7, 9]. Both ranks are busy 6 of 9 s: the bubble is
    (p - 1) / (m + p - 1) = 1/3."""
    from tapescope.distributed.pipeline import schedule_time

    order = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)],
             1: [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]}
    t = schedule_time(order, {0: [1, 1, 2, 2], 1: [1, 1, 2, 2]}, {0: 0.5, 1: 0.0}, 0.0, 2)
    assert t.seconds == 9.5 and t.rank_seconds == {0: 9.5, 1: 7.0}
    assert t.bubble == pytest.approx({0: 1 / 3, 1: 1 / 3})
    # 0.25 s a hop: stage 1 runs F0 [1.25, 2.25] ... B1 [5.25, 7.25]; stage 0's B0 waits for
    # [5.5, 7.5], B1 [7.5, 9.5]: two hops on the critical path (F0 there, B0 back)
    late = schedule_time(order, {0: [1, 1, 2, 2], 1: [1, 1, 2, 2]}, {}, 0.25, 2)
    assert late.seconds == 9 + 2 * 0.25 and late.rank_seconds == {0: 9.5, 1: 7.25}


def test_in_flight_micro_batches_of_1f1b_are_pp_minus_rank():
    from tapescope.distributed.pipeline import max_in_flight, traced_order

    # 1F1B on 4 stages, 8 micro-batches: stage r warms up with 4 - r forwards
    for r in range(4):
        warm = 4 - r
        kinds = ["F"] * warm + ["B", "F"] * (8 - warm) + ["B"] * warm
        assert max_in_flight(traced_order(r, kinds)) == warm


def test_cli_pipeline_prints_each_stage_and_the_bubble(tmp_path):
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "zoo:llama:dim=64,n_layers=4,n_heads=4,n_kv_heads=2,"
                                 "ffn_dim=128,vocab_size=512", "--batch", "4", "--seq", "32",
                                 "--pp", "2", "--microbatches", "4", "--device", "cuda",
                                 "--gpu", "h100", "--amp", "bf16", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    assert "Pipeline 1f1b, 2 stages on 2 ranks, 4 micro-batches" in r.output
    assert "pp rank 0 is highest" in r.output or "pp rank 1 is highest" in r.output
    pl = json.loads(out.read_text())["distributed"]["pipeline"]
    assert [x["in_flight_microbatches"] for x in pl["ranks"]] == [2, 1]
    assert pl["time"]["seconds"] >= max(pl["time"]["rank_seconds"].values()) - 1e-12


def test_fit_gpus_compares_pipelined_layouts_by_their_schedule_s_time(tmp_path):
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app
    from tapescope.layouts import candidate_layouts

    assert [str(x) for x in candidate_layouts(8, 8, (1, 2))] == [
        "FSDP 8", "FSDP 4 x TP 2", "FSDP 2 x TP 4", "TP 8",
        "PP 2 x FSDP 4", "PP 2 x FSDP 2 x TP 2", "PP 2 x TP 4"]
    out = tmp_path / "fit.json"
    r = CliRunner().invoke(app, ["fit", "zoo:llama:n_layers=4,dim=64,n_heads=4,n_kv_heads=2,"
                                 "ffn_dim=128,vocab_size=512", "--gpus", "4", "--pp", "1,2",
                                 "--gpu", "h100", "--amp", "bf16", "--batch", "4", "--seq", "32",
                                 "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    rows = {(x["pp"], x["fsdp"], x["tp"]): x for x in json.loads(out.read_text())["layouts"]}
    piped = rows[(2, 2, 1)]
    # the global batch counts data-parallel ranks only: the stages share one batch
    assert piped["global_batch"] == 4 * 2 and rows[(1, 4, 1)]["global_batch"] == 4 * 4
    assert piped["tokens_per_second"] == pytest.approx(8 * 32 / piped["step_seconds"])


def test_cli_micro_batches_above_a_zoo_model_s_default_batch_take_one_sample_each():
    from typer.testing import CliRunner

    from tapescope.cli import app

    r = CliRunner().invoke(app, ["profile", "zoo:llama:dim=64,n_layers=4,n_heads=4,n_kv_heads=2,"
                                 "ffn_dim=128,vocab_size=512", "--seq", "32", "--pp", "4",
                                 "--microbatches", "8", "-q"])
    assert r.exit_code == 0, r.output
    assert "batch 8 (one sample per micro-batch" in r.output   # said, on stderr
    assert "8x32" in r.output and "Pipeline 1f1b, 4 stages on 4 ranks, 8 micro-batches" in r.output


def test_a_zero_bubble_schedule_s_cuda_memory_replays_its_steps_on_cuda_without_a_gpu():
    """ZBV keeps each stage's last outputs until the next step starts (in the real CPU runs as
    in the trace: the steady peaks above are equal), so the steady step frees what the step
    before it left. The caching-allocator replay runs the steady step twice; the second must
    free the first's leftovers, and (the steady state repeating) peak as the first did. By
    hand: max_memory_allocated is the trace's peak plus sm90's 32 MiB cuBLAS workspace, with
    each block rounded up to 512 bytes (at most 511 bytes a block more)."""
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh={"pp": 2},
                          pipeline=_pipeline("zbv"), device="cuda", gpu="h100")
    for prof in p.distributed.profiles.values():
        cm = prof.cuda_memory
        assert not cm.oom
        assert cm.steady_allocated == cm.max_allocated
        blocks = max(1, len(prof.trace.storages))
        assert 0 <= cm.max_allocated - (32 << 20) - prof.peak_bytes <= 511 * blocks


def test_step_2_is_reused_where_proven_and_keeps_the_real_peak(real):
    """Step 2 built from step 1's records (capture/first_step.py) on 1F1B with FSDP2 inside each
    stage (its gradients reduce-scattered): each rank's steady peak is the real processes', as
    the test above asserts it. A zero-bubble schedule keeps its stages' last outputs into the
    next step (the proof's condition 3 fails): its step 2 is traced, and says why."""
    mesh, par = next((m, p) for s, m, p in CASES[4] if s == "1f1b")
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh=mesh, parallelize=par,
                          pipeline=_pipeline("1f1b"))
    assert {q.trace.step2 for q in p.distributed.profiles.values()} == {"reused"}
    classes: dict = {}
    for ours, theirs in zip(p.ranks, real[(4, "1f1b", False)]):
        classes.setdefault(ours.traced_as, (ours, []))[1].append(theirs)
    for ours, reals in classes.values():
        seen = [(t.peaks[2], t.late_frees.get(2, 0)) for t in reals]
        assert all(peak >= ours.peak_bytes for peak, _ in seen), (ours.rank, seen)
        assert any(peak <= ours.peak_bytes + late for peak, late in seen), (ours.rank, seen)
    zbv = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh={"pp": 2},
                            pipeline=_pipeline("zbv"))
    for q in zbv.distributed.profiles.values():
        assert q.trace.step2 == "traced"
        assert "alive" in q.facts["step2_not_reused"] or "made before" in \
            q.facts["step2_not_reused"]


# ---- activation checkpointing with no data parallelism -------------------------------------------
# A stage's first block, checkpointed, takes the activation the stage received: a leaf, so
# nothing of this micro-batch is recorded before checkpoint saves the block's inputs (FSDP2's
# pre-forward would record a node on them). Issue 35's search failed every such candidate
# ("Failed to run stage backward": the inputs, counted as the previous micro-batch's last
# node's, were released by its backward before this micro-batch recomputed). The cases: 4
# stages of one block under 1F1B (the middle stages hold 2 and 3 micro-batches), and PP 2 x TP 2
# (torchtitan's Llama plan, sequence parallel) under GPipe, where the last stage runs both
# forwards before its first backward. The TP job runs twice: a gloo TP rank's peak is seen up
# to 16-98 KiB above its program's, now and then with no late free recorded
# (tests/test_fit_layouts_checkpoint.py); one observation of a class must equal it.
UNSHARDED = {"pp 4, 1f1b": ({"pp": 4}, dm.ac_stage, "1f1b", 4),
             "pp 2 x tp 2, gpipe": ({"pp": 2, "tp": 2}, dm.tp_ac_stage, "gpipe", 2)}
UNSHARDED_RUNS = {name: 2 if "tp" in case[0] else 1 for name, case in UNSHARDED.items()}
REAL_JOBS["unsharded"] = [RealJob(dm.pipeline_llama, dm.PIPELINE_INPUTS, mesh, par,
                                  pipeline={"schedule": schedule, "microbatches": n})
                          for name, (mesh, par, schedule, n) in UNSHARDED.items()
                          for _ in range(UNSHARDED_RUNS[name])]
# per checkpointed block and micro-batch, the matmuls the profiler lists that run no kernel
# (tests/test_checkpoint.py's NO_KERNEL, here for Llama's 7 Linears: wq, wk, wv, wo, w1, w3,
# w2): early stop raises in the last one's input save (w2), before its kernel
NO_KERNEL_MM = 1


@pytest.fixture(scope="module")
def unsharded(real_runs):
    runs = iter(real_runs[(__name__, "unsharded")])
    return {name: [next(runs) for _ in range(UNSHARDED_RUNS[name])] for name in UNSHARDED}


def _op_counts(names) -> Counter:
    return Counter(n.replace("::", ".").replace("aten._reshape_alias", "aten.view")
                   for n in names)


@pytest.mark.parametrize("name", list(UNSHARDED))
def test_checkpointed_stages_without_data_parallelism_match_the_real_processes(unsharded, name):
    """Each rank's first and steady peaks are the real processes' (the rule above: none below,
    one equal, or above by the 12 bytes of AdamW's first-step scalars or a late free), and its
    steady step dispatches the real step's ops: the same count of each, except the matmuls that
    run no kernel (NO_KERNEL_MM) and, on the last stage, pipelining's detach_ of each stage
    output after its backward (not recorded by the trace, with or without checkpointing)."""
    from tapescope.analysis.ops import expanded_ops

    mesh, par, schedule, microbatches = UNSHARDED[name]
    p = tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh=mesh, parallelize=par,
                          pipeline={"schedule": schedule, "microbatches": microbatches})
    runs = unsharded[name]
    assert all(r.unstepped == 0 for run in runs for r in run)
    classes: dict = {}
    for ours in p.ranks:
        classes.setdefault(ours.traced_as, (ours, []))[1].extend(run[ours.rank] for run in runs)
    blocks = 4 // mesh["pp"]   # a stage's blocks, all checkpointed
    for ours, reals in classes.values():
        for step, pred, slack in ((1, ours.first_step_peak_bytes, 12), (2, ours.peak_bytes, 0)):
            seen = [(t.peaks[step], t.late_frees.get(step, 0)) for t in reals]
            assert all(peak >= pred for peak, _ in seen), (ours.rank, step, pred, seen)
            assert any(peak <= pred + slack + late for peak, late in seen), \
                (ours.rank, step, pred, seen)
        ops = [op for op in expanded_ops(p.distributed.profiles[ours.traced_as].ops)
               if not isinstance(op, str)]
        assert any(op.recompute for op in ops)
        fake = _op_counts(op.name.rsplit(".", 1)[0] for op in ops if op.name.startswith("aten."))
        no_kernel = Counter({"aten.mm": NO_KERNEL_MM * blocks * microbatches})
        last = ours.stages == (mesh["pp"] - 1,)
        for real in reals:
            counts = _op_counts(n for s, ph, n in real.ops if s == 2 and ph
                                and n.startswith("aten::"))
            if "tp" in mesh:
                # DTensor's dispatch lists other outermost ops than its local ones: the matmuls
                # (one local mm each) are compared
                assert counts["aten.mm"] - fake["aten.mm"] == no_kernel["aten.mm"], ours.rank
                continue
            detached = Counter({"aten.detach_": microbatches} if last else {})
            assert counts - fake == no_kernel + detached and not fake - counts, \
                (ours.rank, counts - fake, fake - counts)


def test_search_traces_checkpointed_pipelines_without_data_parallelism():
    """Issue 35's search space, reduced: PP 4 x TP 2 on 8 GPUs with selective checkpointing
    (torchtitan's op-level policy), which the search reported as an error ("Failed to run stage
    backward") as it did full checkpointing (the real runs above), is traced on every rank
    class."""
    r = tapescope.search("zoo:llama:n_layers=4,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128,"
                         "vocab_size=512", gpus=8, gpu="h100", global_batch=8, seq=32, pp=(4,),
                         tp=(2,), checkpointing=("selective",), max_steps=4, brute_force=True)
    assert not r.rejected, [(o.candidate.label(), o.reason) for o in r.rejected]
    [o] = r.outcomes
    assert o.candidate.checkpointing == "selective" and o.candidate.steps == 4
    assert o.status == "fits" and len(o.ranks) == 4   # a class per stage (TP peers alike)


def test_zero_bubble_with_selective_checkpointing_is_refused_as_pytorch_refuses_it():
    """A zero-bubble schedule runs each micro-batch's backward as an input backward, then a
    weight backward: two backwards through every checkpointed region, and selective
    checkpointing recomputes a region for one only. Truth: PyTorch's own two (pipelining's
    stage_backward_input, then stage_backward_weight, as the I and W actions call them) on a
    real stage raise under selective checkpointing and run under full (real gloo runs of ZBV,
    interleaved ZB and DualPipeV raise the same, docs/distributed.md). tapescope refuses it in
    one line: the schedule, the module and line, why, the fix."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    for par, refused in ((dm.sac_stage, True), (dm.ac_stage, False)):
        stage = par(split_blocks(dm.pipeline_llama(), 1, 2), None)
        x = torch.randn(2, 32, 64, requires_grad=True)
        _, groups = stage_backward_input([stage(x).float().mean()], None, [x], stage.parameters())
        if refused:
            with pytest.raises(RuntimeError, match="backward once on any region computed under "
                                                   "selective activation checkpoint"):
                stage_backward_weight(stage.parameters(), groups)
        else:
            stage_backward_weight(stage.parameters(), groups)
    # ... nor the schedule's table that torch's multi-stage schedules log at ERROR on a failure
    logged = []
    log = logging.getLogger("torch.distributed.pipelining.schedules")
    handler = logging.Handler()
    handler.emit = logged.append
    log.addHandler(handler)
    try:
        with pytest.raises(TapescopeError) as e:
            tapescope.profile(dm.pipeline_llama, *dm.PIPELINE_INPUTS, mesh={"pp": 2},
                              parallelize=dm.sac_stage, pipeline=_pipeline("zbv"))
    finally:
        log.removeHandler(handler)
    assert not [r for r in logged if r.levelno >= logging.ERROR]
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("pipeline schedule zbv with selective activation checkpointing: "
                              "PyTorch refuses it")
    assert "in module '1.layers.3._checkpoint_wrapped_module.attention.wq' at " in message
    assert "zoo/llama.py:" in message
    assert message.endswith("Fix: full activation checkpointing, or a schedule with one backward "
                            "(gpipe, 1f1b, interleaved-1f1b, looped-bfs)")
