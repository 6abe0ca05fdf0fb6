"""Models for the float8 truth tests: module-level so that spawned gloo workers can import them."""

import torch
import torch.nn as nn

D_IN, D_HIDDEN = 256, 512


def float8_mlp(recipe="tensorwise", **config) -> nn.Module:
    """Two bias-free Linears swapped to torchao's Float8Linear (every dim a multiple of 16, as
    float8 GEMMs need)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig.from_recipe_name(recipe) if not config else Float8LinearConfig(**config)
    m = nn.Sequential(nn.Linear(D_IN, D_HIDDEN, bias=False), nn.ReLU(),
                      nn.Linear(D_HIDDEN, D_IN, bias=False))
    convert_to_float8_training(m, config=cfg)
    return m


def float8_mlp_bf16_all_gather() -> nn.Module:
    torch.manual_seed(0)
    return float8_mlp(enable_fsdp_float8_all_gather=False)


def fully_shard_each_linear(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
