"""Small models and parallelisations for the distributed truth tests.

Module-level functions: the real runs spawn one process per rank, which import them by name.
"""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tapescope

D = 64
INPUT = tapescope.spec((4, 16, D))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Residual MLP blocks and a 10-way head: 10 rows do not split evenly over 4 ranks, so FSDP
    gives ranks 0-2 three rows of the head and rank 3 one (uneven shards, rank classes)."""

    def __init__(self, d=D, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build():
    return Net()


class RoutedBlock(nn.Module):
    """Experts chosen per token by a data-dependent selection (`nonzero`), as an MoE layer does;
    token i goes to expert i % experts, so the real run and tapescope's values agree."""

    def __init__(self, d, experts=3):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        owner = torch.arange(flat.shape[0], device=x.device) % len(self.experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (owner == e).nonzero().squeeze(1)  # a size only the values decide
            out = out.index_add(0, idx, expert(flat[idx]))
        return x + out.reshape(x.shape)


class RoutedNet(Net):
    def __init__(self, d=D, n=2):
        super().__init__(d, n)
        self.blocks = nn.ModuleList(RoutedBlock(d) for _ in range(n))


def build_routed():
    return RoutedNet()


def fsdp(model, mesh):
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_own_mesh(model, mesh):
    """FSDP2 on a mesh the parallelisation builds itself, under its own dimension name (as
    torchtitan's ParallelDims does); the mesh it is given is used for its device type only."""
    from torch.distributed.device_mesh import init_device_mesh

    own = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("fsdp",))
    return fsdp(model, own)


def fsdp_default_mesh(model, mesh):
    """FSDP2's most basic form: fully_shard without a mesh builds a default one over the world."""
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def fsdp_tp_own_mesh(model, mesh):
    """FSDP2 + TP on a 2-D DeviceMesh built from a rank tensor (the older spelling of a mesh)."""
    from torch.distributed.device_mesh import DeviceMesh

    own = DeviceMesh(mesh.device_type, torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    return fsdp_tp(model, own)


def _tp_blocks(model, tp_mesh):
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def tp(model, mesh):
    _tp_blocks(model, mesh["tp"])
    return model


def fsdp_tp(model, mesh):
    _tp_blocks(model, mesh["tp"])
    return fsdp(model, mesh["dp"])


def replicate(model, mesh):
    """Data parallelism the FSDP2 way (torch's `replicate`): every rank holds the whole model and
    all-reduces gradients per block."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as _replicate

    for b in model.blocks:
        _replicate(b, mesh=mesh)
    _replicate(model, mesh=mesh)
    return model


def ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_mesh=mesh)


# ---- pipeline parallelism (tests/test_pipeline.py) -------------------------------------------------

PIPELINE_INPUTS = (tapescope.spec((8, 32), dtype=torch.long, high=512),
                   tapescope.spec((8, 32), dtype=torch.long, high=512))


def pipeline_llama():
    """A 4-block Llama (embedding, blocks, norm, output): 2 stages of 2 blocks, or 4 of 1."""
    from tapescope.zoo.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=64))


def fsdp_stage(model, mesh):
    """FSDP2 over "dp_shard" on a pipeline stage: each block it holds, then the stage's root."""
    m = mesh["dp_shard"]
    for layer in model.layers:
        if layer is not None:
            fully_shard(layer, mesh=m, reshard_after_forward=False)
    fully_shard(model, mesh=m, reshard_after_forward=False)
    return model


def fsdp_compiled(model, mesh):
    """torchtitan's order: each block compiled (apply_compile: `block.compile(fullgraph=True)`),
    then FSDP2 on every block and the root."""
    for b in model.blocks:
        b.compile(fullgraph=True)
    return fsdp(model, mesh)


def _checkpoint_blocks(model, **kwargs):
    """Activation checkpointing on every block a stage holds, torchtitan's way (apply_ac:
    torch.distributed's checkpoint_wrapper, non-reentrant, put back in the block list)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, layer in list(model.layers.named_children()):
        if layer is not None:
            model.layers.register_module(name, checkpoint_wrapper(layer, **kwargs))
    return model


def ac_stage(model, mesh):
    """Full activation checkpointing on every block of a pipeline stage (checkpoint_wrapper's
    defaults: the RNG state is saved and restored around the recomputation)."""
    return _checkpoint_blocks(model)


def ac_stage_titan(model, mesh):
    """Full activation checkpointing as torchtitan configures it (preserve_rng_state=False)."""
    return _checkpoint_blocks(model, preserve_rng_state=False)


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def sac_stage(model, mesh):
    """Selective activation checkpointing (the matmuls' outputs kept) on every block."""
    return _checkpoint_blocks(model, preserve_rng_state=False, context_fn=_selective_context)


def tp_stage(model, mesh):
    """torchtitan's Llama tensor-parallel plan (sequence-parallel norms) on a pipeline stage."""
    from tapescope.distributed.presets import tp_plan_for

    tp_plan_for(model)[1](model, mesh["tp"])
    return model


def ac_fsdp(model, mesh):
    """Full activation checkpointing on every block, then FSDP2: torchtitan's order (apply_ac
    before apply_fsdp), what `--fsdp N --checkpoint plan.json` traces."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)

    for name, block in list(model.blocks.named_children()):
        model.blocks.register_module(
            name, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return fsdp(model, mesh)


# ---- fit --gpus with a checkpointing plan: torchtitan's order, written out by hand ---------------

def _wrap_first_block(model):
    """checkpoint_wrapper on layers.0 only: a plan that wraps some blocks and not others."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)

    model.layers.register_module(
        "0", checkpoint_wrapper(model.layers[0], checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def ac_then_fsdp_llama(model, mesh):
    """torchtitan's apply_ac then apply_fsdp: layers.0 checkpointed, FSDP2 on every block (the
    last kept unsharded after forward, as backward needs it next) and on the root."""
    _wrap_first_block(model)
    m = mesh["dp_shard"]
    for i, layer in enumerate(model.layers):
        fully_shard(layer, mesh=m, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mesh=m)
    return model


def tp_then_ac_llama(model, mesh):
    """torchtitan's apply_tp then apply_ac (parallelize_llama's order): its Llama plan, then
    layers.0 checkpointed."""
    _tp_llama(model, mesh)
    _wrap_first_block(model)
    return model


def _tp_llama(model, mesh):
    """torchtitan's Llama plan (apply_tp): vocabulary-parallel embedding and output,
    sequence-parallel norms, column-parallel q/k/v and w1/w3, row-parallel wo and w2."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    return model


def tp_ac_stage(model, mesh):
    """torchtitan's order on a pipeline stage with no data parallelism (apply_tp, then apply_ac):
    its Llama tensor-parallel plan, then full activation checkpointing on every block."""
    return _checkpoint_blocks(tp_stage(model, mesh))

