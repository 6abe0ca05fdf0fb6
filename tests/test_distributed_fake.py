"""Distributed profiles without running anything for real: the collectives a rank issues, against
counts and sizes derived by hand from FSDP2's and tensor parallelism's rules; the CUDA route on a
machine without a GPU; profiles that leave no trace in the process; the CLI presets."""

import gc
import json

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

import tapescope
from tapescope.analysis.collectives import collective_seconds
from tapescope.cli import app
from tapescope.devices.gpus import get_gpu, interconnect

from . import distributed_models as dm

BLOCK = 64 * 256 + 256 + 256 * 64 + 64   # one Block's parameters
HEAD = 64 * 10 + 10
F32 = 4


def _rows(p):
    return {(r.kind, r.group, r.nbytes): r.count for r in p.collective_table}


def test_fsdp_collectives_by_hand():
    """FSDP2 over 2 ranks, every block and the root wrapped: forward all-gathers the root (the
    head) and each block; backward all-gathers each block again (blocks reshard after forward,
    the root does not) and reduce-scatters every group. An all-gather's size is its output, the
    whole group's parameters (padded to a multiple of the world size)."""
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp)
    assert _rows(p) == {("all_gather", "dp", BLOCK * F32): 4, ("all_gather", "dp", HEAD * F32): 1,
                        ("reduce_scatter", "dp", BLOCK * F32): 2,
                        ("reduce_scatter", "dp", HEAD * F32): 1}
    cats = p.memory.at_peak
    assert cats["sharded parameters"] == (2 * BLOCK + HEAD) * F32 // 2


def test_tensor_parallel_collectives_by_hand():
    """Colwise up, rowwise down: each block all-reduces its output in forward and its input's
    gradient in backward, except the first block, whose input needs no gradient."""
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"tp": 2}, parallelize=dm.tp)
    activation = 4 * 16 * 64 * F32
    assert _rows(p) == {("all_reduce", "tp", activation): 3}


def test_cuda_without_a_gpu_and_nothing_left_behind():
    """device='cuda' on this GPU-less machine: FSDP2 + TP trace, streams and events stood in for;
    afterwards torch.cuda, torch.distributed and Python's collector (its thresholds, nothing left
    frozen, a caller's frozen objects still frozen) are as they were, and a second profile gives
    the same numbers."""
    before = (torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.current_device)
    collector = (gc.get_threshold(), gc.get_freeze_count())
    kw = dict(mesh={"dp": 2, "tp": 2}, parallelize=dm.fsdp_tp, device="cuda", gpu="h100")
    a = tapescope.profile(dm.build, dm.INPUT, **kw)
    assert (gc.get_threshold(), gc.get_freeze_count()) == collector
    # a caller that froze objects of its own: they stay frozen (and the numbers do not move)
    gc.freeze()
    try:
        b = tapescope.profile(dm.build, dm.INPUT, **kw)
        assert gc.get_freeze_count() > 0   # (an unfreeze leaves none; a frozen object may die)
    finally:
        gc.unfreeze()
    assert (torch.cuda.current_stream, torch.cuda.Stream, torch.cuda.current_device) == before
    assert not dist.is_initialized()
    assert (gc.get_threshold(), gc.get_freeze_count()) == collector
    assert [r.peak_bytes for r in a.ranks] == [r.peak_bytes for r in b.ranks]
    assert len(a.ranks) == 4 and a.time.comm > 0 and a.ranks[0].step_seconds == a.time.seconds


@pytest.mark.parametrize("parallelize", [dm.fsdp_own_mesh, dm.fsdp_default_mesh])
def test_cuda_parallelize_that_builds_its_own_mesh(parallelize):
    """init_device_mesh("cuda", ...) inside parallelize, and fully_shard without a mesh (its
    default mesh is on the accelerator: cuda in a GPU job), on this GPU-less machine: FSDP2's
    collectives as by hand (test_fsdp_collectives_by_hand) on a cuda mesh; the meshes' rank maps
    are host memory, so the GPU's peak is that of the same FSDP2 on the given mesh."""
    kw = dict(mesh={"dp": 2}, device="cuda", gpu="h100")
    p = tapescope.profile(dm.build, dm.INPUT, parallelize=parallelize, **kw)
    given = tapescope.profile(dm.build, dm.INPUT, parallelize=dm.fsdp, **kw)
    assert {(k, n): c for (k, _, n), c in _rows(p).items()} == {
        ("all_gather", BLOCK * F32): 4, ("all_gather", HEAD * F32): 1,
        ("reduce_scatter", BLOCK * F32): 2, ("reduce_scatter", HEAD * F32): 1}
    assert [r.peak_bytes for r in p.ranks] == [r.peak_bytes for r in given.ranks]
    assert p.time.comm > 0
    assert not dist.is_initialized() and torch._C._get_accelerator().type == "cpu"


def _own_mesh(names):
    """parallelize that builds its own mesh over the world, under the given dimension names:
    FSDP2 on the first, tensor parallel on the second if there is one."""
    from torch.distributed.device_mesh import init_device_mesh

    def parallelize(model, mesh):
        sizes = tuple(mesh.shape)
        own = init_device_mesh(mesh.device_type, sizes, mesh_dim_names=names)
        if len(names) == 1:
            return dm.fsdp(model, own)
        dm._tp_blocks(model, own[names[1]])
        return dm.fsdp(model, own[names[0]])

    return parallelize


@pytest.mark.parametrize("mesh,names,classes", [
    # the 10-row head over 4 ranks: 3, 3, 3 and 1 rows (torch.chunk), so rank 3 is its own class
    ({"dp_shard": 4}, [("dp_shard",), ("fsdp",)], [(0, 1, 2), (3,)]),
    # FSDP 2 x TP 2: the head is replicated over tp and split 5 / 5 over dp: one class
    ({"dp_shard": 2, "tp": 2}, [("dp_shard", "tp"), ("fsdp", "tensor")], [(0, 1, 2, 3)]),
])
def test_rank_classes_do_not_depend_on_the_mesh_names(mesh, names, classes):
    """The user's code names its mesh dimensions as it likes (torchtitan: dp_shard, a script:
    fsdp): the ranks traced once, and every rank's numbers, are the same either way."""
    a, b = (tapescope.profile(dm.build, dm.INPUT, mesh=mesh, parallelize=_own_mesh(n))
            for n in names)
    for p in (a, b):
        assert [list(m) for m in p.distributed.classes.members] == [list(c) for c in classes]
        assert sorted(p.distributed.profiles) == [c[0] for c in classes]  # traced once each
    assert [(r.peak_bytes, r.first_step_peak_bytes) for r in a.ranks] == \
        [(r.peak_bytes, r.first_step_peak_bytes) for r in b.ranks]


def test_sixteen_ranks_under_names_of_their_own_trace_two():
    """16 ranks of FSDP2 on a mesh named "fsdp" (the profile's is "dp"). By hand: every block
    tensor splits evenly over 16 (256 and 64 rows); the head's 10 rows split as torch.chunk
    does, 10 chunks of 1 row: ranks 0-9 hold a row of it, ranks 10-15 none. Two classes, two
    traces (before, names that differed made every rank its own class: 16 traces)."""
    p = tapescope.profile(dm.build, tapescope.spec((16, 16, 64)), mesh={"dp": 16},
                          parallelize=_own_mesh(("fsdp",)))
    assert [list(m) for m in p.distributed.classes.members] == [list(range(10)),
                                                                 list(range(10, 16))]
    assert len(p.ranks) == 16 and sorted(p.distributed.profiles) == [0, 10]


def test_unprovable_classes_are_announced_before_every_rank_is_traced(monkeypatch):
    """Where no mesh says which coordinate each rank has (torch before 2.9 without the profile's
    names), every rank is traced: the user hears so, with the time it will take, first."""
    from tapescope.distributed import ranks

    monkeypatch.setattr(ranks, "mesh_coordinates", lambda mesh, spec: None)
    with pytest.warns(UserWarning, match=r"tracing each of the 2 ranks, about \d+ s more"):
        p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp)
    assert not p.distributed.classes.provable and sorted(p.distributed.profiles) == [0, 1]


def test_ring_time_by_hand():
    """An all-gather of S bytes on n ranks moves S (n-1)/n through each link (nccl-tests' bus
    bandwidth); inside an H100 node that is NVLink at 450 GB/s per direction, 80% reached, plus
    NCCL's ring latency: 8.4 us + 3.4 us per step (7 steps)."""
    ic = interconnect(get_gpu("h100"))
    s = 1 << 30
    t, inter = collective_seconds("all_gather", s, range(8), ic)
    assert not inter
    assert t == pytest.approx(s * 7 / 8 / (450e9 * 0.8) + 8.4e-6 + 7 * 3.4e-6)
    # 8 ranks on 2 nodes, 4 in each: the ring leaves a node through 4 NICs of 50 GB/s (90%
    # reached) = 180 GB/s < NVLink's 360; all-reduce: 14 steps, 2 of them across nodes
    t2, inter2 = collective_seconds("all_reduce", s, range(0, 16, 2), ic)
    assert inter2
    assert t2 == pytest.approx(2 * s * 7 / 8 / (4 * 50e9 * 0.9) + 8.4e-6 + 12 * 3.4e-6 + 2 * 6.6e-6)
    # one rank per node (an HSDP replicate group): one NIC
    t3, _ = collective_seconds("all_reduce", s, range(0, 128, 8), ic)
    assert t3 == pytest.approx(2 * s * 15 / 16 / (50e9 * 0.9) + 8.4e-6 + 30 * 6.6e-6)
    # FSDP over 16 whole nodes: 8 NICs a node (400 GB/s) > NVLink: NVLink-bound
    t4, _ = collective_seconds("all_gather", s, range(128), ic)
    assert t4 == pytest.approx(s * 127 / 128 / (450e9 * 0.8) + 8.4e-6 + 112 * 3.4e-6 + 15 * 6.6e-6)


def test_collectives_against_published_nccl_tests_bus_bandwidths():
    """NCCL's maintainer on 8 x H100 SXM (NVIDIA/nccl-tests#212 and #326): all_gather (and a ring
    all-reduce) bus bandwidth 360-370 GB/s at large sizes; all-reduce with NVLink SHARP, the
    default, busBw ~480 GB/s (algbw ~275 GB/s). busbw = S / t x (n-1)/n (all-gather) and
    2 (n-1)/n (all-reduce), nccl-tests' PERFORMANCE.md."""
    ic = interconnect(get_gpu("h100"))
    s = 8 << 30
    t, _ = collective_seconds("all_gather", s, range(8), ic)
    assert s / t * 7 / 8 == pytest.approx(360e9, rel=0.01)   # the published 360 (to 370)
    t, _ = collective_seconds("all_reduce", s, range(8), ic)
    assert s / t == pytest.approx(275e9, rel=0.01)
    assert s / t * 2 * 7 / 8 == pytest.approx(480e9, rel=0.01)
    # two ranks: the ring (algbw 360 GB/s) beats NVLS (275): NCCL's tuner takes the ring
    t, _ = collective_seconds("all_reduce", s, range(2), ic)
    assert s / t == pytest.approx(360e9, rel=0.01)
    # A100's NVSwitch has no SHARP: ring all-reduce only
    a100 = interconnect(get_gpu("a100"))
    t, _ = collective_seconds("all_reduce", s, range(8), a100)
    assert s / t * 2 * 7 / 8 == pytest.approx(300e9 * 0.8, rel=0.01)
    # Azure's AI-benchmarking-guide, nccl all_reduce busBw at 8 GB on 8 GPUs: ND H100 v5 478.87,
    # ND H200 v5 479.98 (NVLS), ND A100 v4 231.58 GB/s (ring): within 4%
    for gpu, measured in (("h100", 478.87e9), ("h200", 479.98e9), ("a100", 231.58e9)):
        t, _ = collective_seconds("all_reduce", 8 << 30, range(8), interconnect(get_gpu(gpu)))
        assert (8 << 30) / t * 2 * 7 / 8 == pytest.approx(measured, rel=0.04)


def test_a_process_group_already_there_is_refused():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(tapescope.TapescopeError, match="already initialised"):
            tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp)
    finally:
        dist.destroy_process_group()


def test_mesh_needs_parallelize():
    with pytest.raises(tapescope.TapescopeError, match="parallelize"):
        tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2})


TINY_LLAMA = "zoo:llama:dim=64,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=160,vocab_size=128"


def test_cli_presets_fsdp_and_tp(tmp_path):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", TINY_LLAMA, "--batch", "2", "--seq", "32", "--fsdp",
                                 "2", "--tp", "2", "--device", "cuda", "--amp", "bf16",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Per rank" in r.output and "Collectives" in r.output and "dp_shard" in r.output
    d = json.loads(out.read_text())
    assert len(d["ranks"]) == 4 and d["distributed"]["mesh"] == {"dp_shard": 2, "tp": 2}
    kinds = {c["kind"] for c in d["collectives"]}
    assert {"all_gather", "reduce_scatter"} <= kinds


def test_cli_tp_without_a_plan_says_what_to_do():
    r = CliRunner().invoke(app, ["profile", "zoo:gpt2:n_layer=1,n_embd=64,n_head=2,vocab_size=64,"
                                 "block_size=32", "--batch", "1", "--seq", "16", "--tp", "2"])
    assert r.exit_code == 1 and "--parallelize" in r.output


def test_hsdp_reduces_across_replicas():
    """HSDP (--fsdp 2 --hsdp 2): gradients are reduce-scattered within a shard group, then
    all-reduced across the replicas; parameters gathered within the shard group only."""
    from tapescope.distributed.presets import Layout, preset_parallelize

    layout = Layout(fsdp=2, dp_replicate=2)
    p = tapescope.profile(dm.build, dm.INPUT, mesh=layout.mesh,
                          parallelize=preset_parallelize(layout))
    kinds = {(r.kind, r.group) for r in p.collective_table}
    assert kinds == {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"),
                     ("all_reduce", "dp_replicate")}
    assert len(p.ranks) == 4


def test_transformers_models_bring_their_own_tp_plan():
    from tapescope.distributed.presets import Layout, preset_parallelize
    from tapescope.zoo import resolve

    m = resolve("hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
                "num_attention_heads=4,num_key_value_heads=2,vocab_size=128", batch=2, seq=16)
    layout = Layout(tp=2)
    p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          mesh=layout.mesh, parallelize=preset_parallelize(layout))
    assert {r.group for r in p.collective_table} == {"tp"}
    assert p.memory.at_peak["sharded parameters"] > 0


def test_a_failing_parallelize_in_a_folder_named_tapescope_names_its_line(tmp_path):
    """README's layout clones the project into a folder called `tapescope`: a user's
    parallelize living under such a folder is still the user's code, and the error names its
    file and line (the frame is found by the installed packages' folders, errors.py)."""
    import importlib.util

    from tapescope.errors import TapescopeError

    folder = tmp_path / "tapescope" / "recipes"
    folder.mkdir(parents=True)
    path = folder / "my_parallel.py"
    path.write_text("def parallelize(model, mesh):\n"
                    "    raise ValueError('no such layer: blocks')\n")
    spec = importlib.util.spec_from_file_location("my_parallel_in_tapescope_dir", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(TapescopeError) as info:
        tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=module.parallelize)
    message = str(info.value)
    assert f"{path}:2" in message and "no such layer: blocks" in message
    assert "reads tensor values" not in message   # not a data-dependent failure


def _fsdp_bf16(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def test_fsdp_ops_are_recorded_on_the_streams_fsdp2_issues_them_on():
    """FSDP2's rules (_fsdp_collectives.foreach_all_gather / foreach_reduce): the parameters are
    cast into the all-gather input (`_foreach_copy_`) and copied in on the all-gather copy-in
    stream, the all-gather runs on the all-gather stream and the reduce-scatter on the
    reduce-scatter stream - the streams FSDPCommContext.lazy_init creates in that order (1, 2, 3
    after the default stream 0); every matmul runs on the default stream (analysis.timing runs each
    stream in its own queue)."""
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=_fsdp_bf16,
                          device="cuda", gpu="h100")
    streams = {}
    for op in p.ops:
        streams.setdefault(op.name.split(".")[1], set()).add(op.record.stream)
    assert streams["all_gather_copy_in"] == {1} and 1 in streams["_foreach_copy_"]
    assert streams["_allgather_base_"] == {2} and streams["_reduce_scatter_base_"] == {3}
    assert streams["mm"] == {0} and streams["addmm"] == {0}


def test_fsdp_streams_wait_on_the_events_fsdp2_makes_them_wait_on():
    """FSDP2's rules, as its source writes them: the all-gather stream waits for the copy-in
    stream (`all_gather_stream.wait_stream(all_gather_copy_in_stream)`), so each all-gather waits
    for its own copy-in; in forward the streams of the next all-gather wait for the copy-out
    event of the group before the previous one (`wait_for_unshard` ->
    `_wait_all_gather_streams_on_event(prev_all_gather_state.event)`), which bounds how far
    all-gathers run ahead of compute; the reduce-scatter stream waits for the compute stream
    (`reduce_scatter_stream.wait_stream(current_stream)`), after the gradients' copy-in."""
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=_fsdp_bf16,
                          device="cuda", gpu="h100")
    ops = [op.record for op in p.ops]
    at = {r.index: r for r in ops}
    gathers = [r for r in ops if r.name == "c10d._allgather_base_.default"]
    copy_ins = [r for r in ops if r.name == "fsdp.all_gather_copy_in.default"]
    for g in gathers:   # the last copy-in before it is among the ops it waits for
        assert max(c.index for c in copy_ins if c.index < g.index) in g.waits
    forward = [r for r in ops if r.phase == "forward"]
    outs = [r for r in forward if r.name == "fsdp.split_with_sizes_copy.default"]
    firsts = [r for r in forward if r.stream == 1 and r.waits]
    # the third group's (blocks.1) all-gather: its copy-in stream waits for a compute-stream op
    # issued after the first group's (the root's) copy-out and before the second's all-gather
    third = [r for r in firsts if r.module == "blocks.1"][0]
    (mark,) = third.waits
    assert at[mark].stream == 0 and outs[0].index < mark < copy_ins[1].index
    for rs in (r for r in ops if r.name == "c10d._reduce_scatter_base_.default"):
        first = [r for r in ops if r.stream == 3 and r.index < rs.index][-1]  # its output
        (mark,) = first.waits
        assert at[mark].name == "fsdp.chunk_cat.default" and at[mark].stream == 0


def test_foreach_ops_expanded_once_per_distinct_element_trace_as_dtensor_expands_each(monkeypatch):
    """AdamW's foreach ops over FSDP2 + TP DTensors: with tapescope expanding each op's sharding
    strategy once per distinct list element (distributed/fidelity.py point 5), the rank's trace
    is op for op, shape for shape, the trace with DTensor's own expansion of every element (the
    truth: the same profile with that shortcut switched off). A wrong strategy for an element
    shows as redistributions the step does not make."""
    from tapescope.distributed import fidelity
    from tapescope.distributed.presets import Layout, preset_parallelize
    from tapescope.zoo import resolve

    m, layout = resolve("zoo:llama", batch=1, seq=64), Layout(fsdp=2, tp=2)

    def ops():
        p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                              device="cuda", gpu="h100", mesh=layout.mesh,
                              parallelize=preset_parallelize(layout, torch.bfloat16))
        return [(str(o.func), tuple(None if r is None else tuple(r.shape) for r in o.outputs))
                for o in p.trace.ops]

    expand, reduced = fidelity._distinct_elements, []

    def seen(*args):
        out = expand(*args)
        reduced.append(out is not None)
        return out

    monkeypatch.setattr(fidelity, "_distinct_elements", seen)
    distinct = ops()
    assert any(reduced)  # the shortcut was taken
    monkeypatch.setattr(fidelity, "_distinct_elements", lambda *args: None)
    assert distinct == ops()


def test_a_second_rank_class_takes_the_first_ones_sharding_decisions_rebound(monkeypatch):
    """A small Llama, FSDP 4 x TP 2, its 1,004-row vocabulary split 502 per TP rank and then 126
    rows per FSDP rank, 124 on the last: ranks 6 and 7 are a second class. Their capture takes
    the first class's DTensor sharding decisions, re-bound to their own meshes
    (distributed/fidelity.py point 4), and their traces are op for op, shape for shape, and their
    peaks byte for byte, what they are when each rank makes its own decisions as each process of
    a real job does (the truth: the same profile with the sharing switched off). A decision left
    with rank 0's meshes sends rank 6's vocabulary-parallel reduce-scatter to rank 0's process
    group, which rank 6's world does not have."""
    from contextlib import nullcontext

    from tapescope.distributed import fidelity, profile
    from tapescope.distributed.presets import Layout, preset_parallelize
    from tapescope.zoo import resolve

    m = resolve("zoo:llama:dim=64,n_layers=1,n_heads=4,n_kv_heads=4,ffn_dim=128,vocab_size=1004",
                batch=1, seq=16)
    layout = Layout(fsdp=4, tp=2)

    def traced():
        p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                              device="cuda", gpu="h100", mesh=layout.mesh,
                              parallelize=preset_parallelize(layout, torch.bfloat16))
        assert p.distributed.classes.members == ((0, 1, 2, 3, 4, 5), (6, 7))
        ops = {r: [(str(o.func), tuple(None if t is None else tuple(t.shape)
                                       for t in o.outputs)) for o in q.trace.ops]
               for r, q in p.distributed.profiles.items()}
        return ops, [(r.peak_bytes, r.first_step_peak_bytes, r.step_seconds) for r in p.ranks]

    rebound, taken = fidelity.SharedDecisions._rebound, []

    def spy(self, *args):
        taken.append(True)
        return rebound(self, *args)

    monkeypatch.setattr(fidelity.SharedDecisions, "_rebound", spy)
    shared = traced()
    assert taken  # rank 6 took rank 0's decisions
    monkeypatch.setattr(profile, "decisions_shared_by_ranks", nullcontext)
    assert shared == traced()


def test_collective_table_counts_each_run_of_a_repeated_micro_batch():
    """accumulate=6 with FSDP2 on the root only, reshard_after_forward=False: by hand each
    micro-batch all-gathers the model once (forward; backward finds it unsharded) and
    reduce-scatters its gradients once, 2 x (64 x 64 + 64) fp32 = 33,280 B. The capture traces
    micro-batches until one repeats and lets it stand for the rest (Op.runs); the table counts
    6 of each, and their seconds 6 x one's, as the step time prices them."""
    import torch.nn as nn

    def parallelize(model, mesh):
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model, mesh=mesh["fsdp"], reshard_after_forward=False)

    p = tapescope.profile(lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)),
                          tapescope.spec((4, 64)), mesh={"fsdp": 2}, parallelize=parallelize,
                          gpu="h100", accumulate=6)
    size = 2 * (64 * 64 + 64) * F32
    assert len(p.collectives) < 12 and any(c.runs > 1 for c in p.collectives)  # stood for
    assert _rows(p) == {("all_gather", "fsdp", size): 6, ("reduce_scatter", "fsdp", size): 6}
    one = collective_seconds("all_gather", size, range(2), interconnect(get_gpu("h100")))[0]
    row = next(r for r in p.collective_table if r.kind == "all_gather")
    assert row.seconds == pytest.approx(6 * one)
