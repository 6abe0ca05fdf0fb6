"""torchtitan's own Llama 3 and its own `parallelize_llama` (FSDP2 and selective activation
checkpointing, its mesh built by its ParallelDims inside the parallelisation), profiled GPU-less
on device="cuda" as written. Reduced size: torchtitan's debug model (dim 256, 16 heads, vocabulary
2,048) with 2 of its 6 layers.

torchtitan 0.3.0 installs against torch 2.14.1 without its pinned dependencies:
`pip install --no-deps torchtitan==0.3.0 spmd_types tyro einops docstring_parser typeguard`.
Its language models take flex attention (compiled, which needs a GPU) or varlen attention (per-
document metadata from its data loader); the test gives each layer torchtitan's SDPA wrapper,
which runs `sdpa_kernel([cuDNN, flash, math], set_priority=True)` around a causal SDPA.
"""

import contextlib

import pytest
import torch

import tapescope

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")

WORLD = 2


def _config():
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = llama3_configs["debugmodel"](attn_backend="varlen")
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=True)  # what torchtitan's trainer does first
    return cfg


def _parallel_dims(fsdp=WORLD, tp=1, spmd_backend="spmd_types"):
    """torchtitan's trainer, as written: its ParallelismConfig, and ParallelDims building its
    own meshes (names "fsdp", "batch", "loss_mesh", ...)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    parallelism = ParallelismConfig(data_parallel_shard_degree=fsdp, tensor_parallel_degree=tp,
                                    spmd_backend=spmd_backend)
    dims = ParallelDims.from_config(parallelism, world_size=fsdp * tp)
    dims.build_mesh()
    return parallelism, dims


def _parallelize_llama(model, parallelism, dims, compile_config=None):
    """parallelize_llama with torchtitan's default selective AC (and compile config)."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.llama3.parallelize import parallelize_llama

    return parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                             parallelism=parallelism,
                             compile_config=compile_config or CompileConfig(),
                             ac_config=SelectiveAC.Config(), dump_folder="/tmp")


def _parallelize(model, mesh):
    """torchtitan's trainer, as written: ParallelDims builds its own mesh, then
    parallelize_llama with its default selective AC."""
    return _parallelize_llama(model, *_parallel_dims())


def _loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def test_torchtitan_llama3_fsdp_selective_ac_on_cuda_without_a_gpu():
    """By hand: FSDP2 over 2 ranks splits every parameter in two (every dim 0 is even), so a
    rank's sharded parameters are half the model's fp32 parameters and AdamW's two moments
    twice that; the ranks hold equal shards (one class, one trace); bf16 attention (torchtitan's
    FSDP2 mixed precision) on sm90 takes cuDNN, first in the wrapper's order (sdp_utils.cpp);
    selective AC recomputes part of each layer in backward."""
    cfg = _config()
    with torch.device("meta"):
        numel = sum(p.numel() for p in cfg.build().parameters())
    p = tapescope.profile(cfg.build, tapescope.spec((2, 128), dtype=torch.long), loss_fn=_loss,
                          mesh={"fsdp": WORLD}, parallelize=_parallelize, device="cuda",
                          gpu="h100")
    assert [list(m) for m in p.distributed.classes.members] == [[0, 1]]
    assert sorted(p.distributed.profiles) == [0]
    assert p.memory.at_peak["sharded parameters"] == numel * 4 // WORLD
    assert p.ranks[0].at_peak["optimizer state"] == 2 * numel * 4 // WORLD
    assert set(p.facts["sdpa_backends"]) == {"cudnn"}
    assert p.recompute_flops > 0
    assert {r.kind for r in p.collective_table} >= {"all_gather", "reduce_scatter"}


def _parallelize_compiled(model, mesh):
    """As `_parallelize`, with torchtitan's `--compile.enable` for the model: apply_compile calls
    `block.compile(fullgraph=True)` on every TransformerBlock after AC and before FSDP2."""
    from torchtitan.config import CompileConfig

    return _parallelize_llama(model, *_parallel_dims(),
                              compile_config=CompileConfig(enable=True, components=["model"]))


def test_torchtitan_llama3_compiled_fsdp_selective_ac_on_cuda_without_a_gpu():
    """torchtitan's own compile + FSDP2 + selective AC, GPU-less (compile=True: the blocks its
    apply_compile compiled are compiled by tapescope's backend). Truths: torchtitan compiles with
    fullgraph=True, so the real run has no graph break (one graph, shared by the layers); the
    selective checkpoint stays inside it (a higher-order op) and the partitioner recomputes part
    of each layer; attention in the graph is the backend sm90 picks for bf16 in the wrapper's
    order (cuDNN, sdp_utils.cpp). (The wrapper read as text, tests/test_compile_cuda.py, is not
    applied here: the extern attention op returns a tuple of outputs, which that reading does
    not model yet.)"""
    cfg = _config()
    p = tapescope.profile(cfg.build, tapescope.spec((2, 128), dtype=torch.long), loss_fn=_loss,
                          mesh={"fsdp": WORLD}, parallelize=_parallelize_compiled,
                          device="cuda", gpu="h100", compile=True)
    c = p.compiled
    assert c.regions == 1 and not c.graph_breaks
    assert c.recompute_flops > 0
    ops = {str(n.target) for g in c.graphs for n in g.graph.graph.nodes}
    assert "aten._scaled_dot_product_cudnn_attention.default" in ops
    assert "aten._scaled_dot_product_cudnn_attention_backward.default" in ops
    assert p.eager is not None and p.eager.ranks[0].peak_bytes > 0


def test_torchtitan_llama3_fsdp_tp_sequence_parallel_on_both_spmd_backends(monkeypatch):
    """FSDP 2 x TP 2 with sequence parallelism, torchtitan's trainer step as written: its
    spmd_backend set first (the trainer's set_spmd_backend), forward, loss and backward inside its
    train_context (which registers the SPMD meshes: without them spmd_types skips every module's
    redistribution, and the trace has no TP collective), its cross-entropy.

    By hand, per rank, forward (B x S tokens, width D, bf16 activations): the vocabulary-parallel
    embedding reduce-scatters its output into sequence shards; each layer all-gathers the sequence
    before attention and before the feed-forward and reduce-scatters after wo and after w2; the
    final norm's output is all-gathered for the vocabulary-parallel output projection: each a
    B x S x D bf16 tensor. torchtitan's loss-parallel cross-entropy then all-reduces three fp32
    values per token (max, sum of exponentials, the target's logit). torchtitan's two backends
    run that same program (spmd_types with explicit collectives, partial_dtensor through DTensor),
    so both give these collectives, the same backward, and the same peak."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import spmd_types as spmd_meshes, utils as dist_utils

    batch, seq, fsdp, tp = 2, 128, 2, 2
    cfg = _config()
    dim, layers = cfg.dim, len(cfg.layers)

    def loss(logits, tokens):  # torchtitan's CrossEntropyLoss: a sum over the tokens
        return cross_entropy_loss(logits, tokens, global_vocab_size=cfg.vocab_size) / tokens.numel()

    def profile(backend):
        monkeypatch.setattr(dist_utils, "_spmd_backend", backend)  # set_spmd_backend, undone
        for registered in ("dense_mesh", "sparse_mesh"):  # what train_context registers, undone
            monkeypatch.setattr(spmd_meshes._MESH_TLS, registered, None, raising=False)
        train_context = contextlib.ExitStack()  # the traced rank's, open while it is traced

        def parallelize(model, mesh):
            parallelism, dims = _parallel_dims(fsdp, tp, backend)
            model = _parallelize_llama(model, parallelism, dims)
            train_context.close()
            train_context.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
            return model

        with train_context:
            return tapescope.profile(cfg.build, tapescope.spec((batch, seq), dtype=torch.long),
                                     loss_fn=loss, mesh={"fsdp": fsdp, "tp": tp},
                                     parallelize=parallelize, device="cuda", gpu="h100")

    activation, per_token = batch * seq * dim * 2, batch * seq * 4
    forward = ([("reduce_scatter", activation)]
               + [("all_gather", activation), ("reduce_scatter", activation)] * 2 * layers
               + [("all_gather", activation)] + [("all_reduce", per_token)] * 3)
    runs = {b: profile(b) for b in ("spmd_types", "partial_dtensor")}
    tp_collectives = {b: [(c.kind, c.nbytes, c.phase) for c in p.collectives if c.group == "tp"]
                      for b, p in runs.items()}
    for backend, seen in tp_collectives.items():
        assert [(k, n) for k, n, phase in seen if phase == "forward"] == forward, backend
    assert tp_collectives["spmd_types"] == tp_collectives["partial_dtensor"]
    assert runs["spmd_types"].peak_bytes == runs["partial_dtensor"].peak_bytes
