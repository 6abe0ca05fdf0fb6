"""torchtitan 0.3.0's own MoE model (Qwen3 `debugmodel_moe`, 2 of its layers: 64 experts, top-8,
width 256) with expert parallelism 4 over FSDP 4, through its own `parallelize_qwen3`, GPU-less on
an H100, under tapescope's default routing assumption (balanced).

As torchtitan's trainer runs it: the sharding config set on the model config with EP on (what
its `update_from_config` does: `set_qwen3_sharding_config(enable_ep=True)`), its spmd_backend set
(`set_spmd_backend`), ParallelDims building its meshes inside the parallelisation, and its
train_context (the registered SPMD meshes, which the token dispatcher asks for its EP group)
open while the step is traced. The test gives each layer torchtitan's SDPA wrapper (0.3.0 gives
its language models flex or varlen attention).

Truth by hand: a rank has 2 x 128 = 256 tokens, each routed to 8 experts; the dispatcher first
exchanges each expert's token count (64 int64: 512 B), then all-to-alls the routed tokens (256 x
8 rows of 256 bf16 values under FSDP2's bf16 mixed precision: 1,048,576 B) and the same back
after the experts.

Per-rank peaks: against real gloo runs of the same model (tests/torchtitan_moe_models.py: 16 of
the flavor's 64 experts, EP 4 x FSDP 4 on the CPU) with the routers forced to the balanced routing
(each router's expert ids overwritten in place, no tensor kept), read from each process's
allocator as tests/test_distributed.py reads them. What the real run does differently: FSDP2's
reduce-scatter runs with ReduceOp.SUM where torchtitan's code asks for PREMUL_SUM(1.0), which
gloo refuses; same buffers, same values (see `parallelize_forced_sum_routed`).
"""

import contextlib

import pytest
import torch

import tapescope
from tapescope.validate.distributed import RealJob, run_real_jobs

from . import torchtitan_moe_models as tm
from .test_distributed import SCALAR_TEMPS, _matches, _observed_with_late_frees

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

WORLD, EP, BATCH, SEQ = 4, 4, 2, 128


def _config(parallelism):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    cfg = model_registry("debugmodel_moe", attn_backend="varlen").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel,
                              enable_ep=parallelism.expert_parallel_degree > 1)
    return cfg


def test_torchtitan_qwen3_moe_expert_parallel_on_cuda_without_a_gpu(monkeypatch):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import spmd_types as spmd_meshes, utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    backend = "spmd_types"
    parallelism = ParallelismConfig(data_parallel_shard_degree=WORLD, expert_parallel_degree=EP,
                                    spmd_backend=backend)
    cfg = _config(parallelism)
    monkeypatch.setattr(dist_utils, "_spmd_backend", backend)  # the trainer's set_spmd_backend
    for registered in ("dense_mesh", "sparse_mesh"):
        monkeypatch.setattr(spmd_meshes._MESH_TLS, registered, None, raising=False)
    train_context = contextlib.ExitStack()

    def parallelize(model, mesh):
        dims = ParallelDims.from_config(parallelism, world_size=WORLD)
        dims.build_mesh()
        model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(),
                                  parallelism=parallelism, compile_config=CompileConfig(),
                                  ac_config=SelectiveAC.Config(), dump_folder="/tmp")
        train_context.close()
        train_context.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
        return model

    def loss(logits, tokens):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())

    with train_context:
        p = tapescope.profile(cfg.build, tapescope.spec((BATCH, SEQ), dtype=torch.long),
                              loss_fn=loss, mesh={"fsdp": WORLD}, parallelize=parallelize,
                              gpu="h100")
    tokens, top_k, experts, dim = BATCH * SEQ, 8, 64, 256
    a2a = [(c.nbytes, c.phase) for c in p.collectives if c.kind == "all_to_all"]
    forward = [n for n, phase in a2a if phase == "forward"]
    layers = len(cfg.layers)
    # per layer: counts, tokens out, tokens back
    assert forward == [experts * 8, tokens * top_k * dim * 2, tokens * top_k * dim * 2] * layers
    assert {n for n, _ in a2a} == {experts * 8, tokens * top_k * dim * 2}
    assert any(a.kind == "routing" for a in p.trace.assumptions)


# steps 2 and 3 are both the steady state. One run (a second job in the same processes fails:
# FSDP2 sees the experts' EP mesh as another object than the one ParallelDims built again); its
# 4 ranks of one class give 4 observations of the first step and 8 of the steady one: a gloo work
# object can hold the token-count all-to-all's outputs past a rank's peak (measured: 128-512 B,
# on some ranks of a run, never all of them in 5 runs)
STEPS = 3


@pytest.fixture(scope="module")
def real_ep():
    return run_real_jobs([RealJob(tm.build, (tm.INPUT,), {"fsdp": tm.WORLD},
                                  tm.parallelize_forced_sum_routed, loss_fn=tm.loss,
                                  steps=STEPS)])


def test_expert_parallel_peaks_equal_real_gloo_ranks_routed_as_assumed(real_ep, monkeypatch):
    """Every rank's first and steady peak equal its real process's (within the CPU kernels'
    Python-scalar temporaries), routing assumed balanced here and forced balanced there."""
    from torchtitan.distributed import parallel_dims, spmd_types as spmd_meshes, utils as dist_utils

    tm.on_cpu(parallel_dims, monkeypatch.setattr)
    monkeypatch.setattr(dist_utils, "_spmd_backend", dist_utils.get_spmd_backend())
    for registered in ("dense_mesh", "sparse_mesh"):
        monkeypatch.setattr(spmd_meshes._MESH_TLS, registered, None, raising=False)
    with tm.TRAIN_CONTEXT:
        p = tapescope.profile(tm.build, tm.INPUT, loss_fn=tm.loss, mesh={"fsdp": tm.WORLD},
                              parallelize=tm.parallelize, sizes="balanced")
    assert any(a.kind == "routing" for a in p.trace.assumptions)
    assert all(r.unstepped == 0 for run in real_ep for r in run)
    for members in p.distributed.classes.members:
        rep = p.ranks[members[0]]
        _matches(rep.first_step_peak_bytes, _observed_with_late_frees(real_ep, members, [1]),
                 SCALAR_TEMPS)
        _matches(rep.peak_bytes, _observed_with_late_frees(real_ep, members, range(2, STEPS + 1)),
                 SCALAR_TEMPS)
