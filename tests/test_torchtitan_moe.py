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
after the experts. Not yet checked against a real gloo run (the issue's per-rank peak truth).
"""

import contextlib

import pytest
import torch

import tapescope

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
