"""torchtitan 0.3.0's own Qwen3 MoE under expert parallelism, for the profile and its real runs.

Module-level functions: the gloo truth spawns one process per rank, which imports them by name.
The model is torchtitan's `debugmodel_moe` (top-8, width 256) cut to LAYERS layers and EXPERTS of
its 64 experts (a smaller real run), each given torchtitan's SDPA wrapper (0.3.0 gives its language
models flex or varlen attention);
`parallelize` is what torchtitan's trainer does: the sharding config with EP on
(`set_qwen3_sharding_config`, its `update_from_config`), its spmd backend set
(`set_spmd_backend`), ParallelDims building its meshes, `parallelize_qwen3` with its default
selective AC, and its train_context (the registered SPMD meshes the token dispatcher asks for
its EP group) entered for the steps that follow.
"""

import contextlib

import torch

import tapescope

WORLD, EP, BATCH, SEQ, LAYERS, EXPERTS = 4, 4, 2, 128, 2, 16
BACKEND = "spmd_types"  # torchtitan's default spmd_backend
INPUT = tapescope.spec((BATCH, SEQ), dtype=torch.long)

# torchtitan's trainer holds its train_context open around every step; a parallelisation here
# enters it (a traced rank, or a real rank's process) and leaves it open for the steps after
TRAIN_CONTEXT = contextlib.ExitStack()


def parallelism():
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(data_parallel_shard_degree=WORLD, expert_parallel_degree=EP,
                             spmd_backend=BACKEND)


def config():
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    par = parallelism()
    cfg = model_registry("debugmodel_moe", attn_backend="varlen").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        _set_experts(layer.moe, EXPERTS)
    set_qwen3_sharding_config(cfg, enable_sp=par.enable_sequence_parallel,
                              enable_ep=par.expert_parallel_degree > 1)
    return cfg


def _set_experts(moe, n):
    """The flavor's expert count (64) cut to n everywhere its config repeats it."""
    routed = moe.routed_experts
    moe.num_experts = routed.inner_experts.num_experts = n
    routed.token_dispatcher.num_experts = moe.router.num_experts = n
    moe.router.gate.out_features = n


def build():
    return config().build()


def parallelize(model, mesh):
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    par = parallelism()
    TRAIN_CONTEXT.close()  # an earlier job's meshes: this one's parameters get its own
    dist_utils.set_spmd_backend(BACKEND)
    dims = ParallelDims.from_config(par, world_size=WORLD)
    dims.build_mesh()
    model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(),
                              parallelism=par, compile_config=CompileConfig(),
                              ac_config=SelectiveAC.Config(), dump_folder="/tmp")
    TRAIN_CONTEXT.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
    return model


def _force_balanced(router, args, out):
    """The router's expert ids overwritten in place with tapescope's balanced routing, token t's
    j-th choice expert (t*k + j) mod E (written here, not with tapescope's routing_indices).
    In place and through `.data`: arange writes into `out=` (only remainder_'s wrapped scalar,
    8 B, comes and goes) and the version `gather` saved the ids at is kept, so the run's memory
    is the unforced model's."""
    flat = out[1].data.view(-1)  # (scores, expert ids, all scores)
    torch.arange(flat.numel(), out=flat)
    flat.remainder_(router.num_experts)
    return out


def parallelize_forced_sum_routed(model, mesh):
    """`parallelize` for a real gloo run: every router forced to the balanced routing, and
    FSDP2's reduce-scatters told to use SUM.

    Why SUM: torchtitan turns FSDP's gradient division off (`set_gradient_divide_factor(1.0)`),
    so FSDP2 reduce-scatters with `ReduceOp.PREMUL_SUM(1.0)`, which gloo refuses ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"). `set_force_sum_reduction_for_comms(True)` makes FSDP2 use
    SUM with a post-division by the factor, which `_div_if_needed` skips at 1.0
    (_fsdp_collectives.py, `_get_gradient_divide_factors`): the same buffers, the same values,
    only the reduce op's name differs."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import parallel_dims
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    on_cpu(parallel_dims)
    model = parallelize(model, mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
        if isinstance(module, TokenChoiceTopKRouter):
            module.register_forward_hook(_force_balanced)
    return model


def on_cpu(parallel_dims_module, setattr=setattr):
    """ParallelDims builds its meshes on torchtitan's `device_type`, "cuda" on any machine without
    an accelerator (tools/utils.py, `get_device_info`); the CPU truth and its profile build them
    on the CPU, where gloo runs."""
    setattr(parallel_dims_module, "device_type", "cpu")


def loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
