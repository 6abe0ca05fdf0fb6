"""torch.compile + tensor parallelism with the meshes the user's own code builds (torchtitan's
ParallelDims builds them inside its parallelisation, so inside tapescope's capture).

Before: dynamo's DTensor guard (`DTENSOR_SPEC_MATCH`, guards.py `extract_dtensor_spec`)
deep-copies every DTensorSpec a compiled region sees, mesh included; the mesh's rank map held the
capture's fake rank map (so that the job's memory keeps it), the copy followed it into the fake
mode and the fake process group, and failed: "Tried to deepcopy object
__torch__.torch.classes.c10d.ProcessGroup". The held tensor is now shared by copies.

Truth: torchtitan compiles each block with fullgraph=True, so the real run has no graph break
and its layers share one graph; DTensor (spmd_backend="partial_dtensor") is what puts the spec
guards in. Reduced size: torchtitan's debug model, 2 layers, FSDP 2 x TP 2.
"""

import contextlib

import pytest
import torch

import tapescope

pytest.importorskip("torchtitan")
pytest.importorskip("spmd_types")


def test_compile_with_tp_on_meshes_built_inside_the_parallelize(monkeypatch):
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig
    from torchtitan.distributed import spmd_types as spmd_meshes, utils as dist_utils

    from .test_torchtitan import _config, _parallel_dims, _parallelize_llama

    backend = "partial_dtensor"
    cfg = _config()
    monkeypatch.setattr(dist_utils, "_spmd_backend", backend)  # the trainer's set_spmd_backend
    for registered in ("dense_mesh", "sparse_mesh"):
        monkeypatch.setattr(spmd_meshes._MESH_TLS, registered, None, raising=False)
    train_context = contextlib.ExitStack()

    def parallelize(model, mesh):
        parallelism, dims = _parallel_dims(2, 2, backend)  # the client's own meshes, built here
        model = _parallelize_llama(model, parallelism, dims,
                                   compile_config=CompileConfig(enable=True, components=["model"]))
        train_context.close()
        train_context.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
        return model

    def loss(logits, tokens):
        return cross_entropy_loss(logits, tokens, global_vocab_size=cfg.vocab_size) / tokens.numel()

    with train_context:
        p = tapescope.profile(cfg.build, tapescope.spec((2, 128), dtype=torch.long), loss_fn=loss,
                              mesh={"fsdp": 2, "tp": 2}, parallelize=parallelize, device="cuda",
                              gpu="h100", compile=True)
    assert p.compiled.regions == 1 and not p.compiled.graph_breaks
    assert {c.kind for c in p.collectives if c.group == "tp"} >= {"all_gather", "reduce_scatter"}
