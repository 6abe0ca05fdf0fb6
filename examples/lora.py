"""Llama 3 8B fine-tuned with LoRA on one 24 GB GPU, as a model file holds it (README's "A 24 GB GPU").

    tapescope profile examples/lora.py:build --input 1,2048:int64 --input 1,2048:int64 --gpu 4090 --dtype bf16

The base weights are frozen (no gradients, no optimizer state); each attention's query and value
projections get a low-rank adapter (Hu et al. 2021: W x + B A x * alpha / r, B zero at the
start), the only trainable parameters, as peft's LoraConfig(r=16, target_modules=["wq", "wv"])
makes them; each block is checkpointed (torch.utils.checkpoint, non-reentrant), so backward
recomputes a block's activations instead of keeping them. Written out here, rather than with peft,
so that it runs where peft is not installed; the memory is the same mechanism: frozen weights and
a few small trainable matrices. The two inputs are the tokens and the next-token targets; the
model returns its loss.
"""

import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tapescope.zoo.llama import PRESETS, Llama


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update B A (rank r, scaled by alpha / r)."""

    def __init__(self, base: nn.Linear, r: int = 16, alpha: int = 32):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(r, base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class Checkpointed(nn.Module):
    """A block whose activations backward recomputes (what torch's checkpoint_wrapper does)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def build(n_layers: int | None = None, r: int = 16) -> nn.Module:
    """Llama 3 8B (tapescope's zoo preset; `n_layers` to cut it down), LoRA on wq and wv."""
    from dataclasses import replace

    config = PRESETS["llama3-8b"]
    model = Llama(replace(config, n_layers=n_layers or config.n_layers))
    model.requires_grad_(False)
    for i, block in enumerate(model.layers):
        block.attention.wq = LoRALinear(block.attention.wq, r)
        block.attention.wv = LoRALinear(block.attention.wv, r)
        model.layers[i] = Checkpointed(block)
    return model


def build_small() -> nn.Module:
    """Four of its 32 layers: what tests/test_readme.py runs in place of `build` (the same
    frozen weights, adapters and checkpointing, traced in seconds)."""
    return build(n_layers=4)
