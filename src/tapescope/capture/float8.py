"""float8 training for the presets (`--float8 tensorwise|rowwise`): torchao's
`convert_to_float8_training` on the traced copy of the model, as torchtitan's float8 converter
applies it, before the preset's parallelize.

Which Linears (torchtitan/components/quantization/utils.py, module_filter_fn): every dim a
multiple of 16 (float8 GEMMs need it), and not one a filter names; torchtitan's training configs
filter the output head (`filter_fqns = ["output"]`), which here is the model's head: its
`get_output_embeddings()` (transformers) or its top-level `output` (torchtitan up to 0.2, the
zoo's Llama) or `lm_head` (torchtitan 0.3), matched by identity, not by a substring of every name.
(torchtitan 0.3.0's own default filters nothing, so its lm_head is converted when its dims allow:
filter it as its earlier configs did, `filter_fqns=["lm_head"]`, for the same set.)

tensorwise under FSDP (torchtitan's Float8 converter up to 0.2, and its llama3 70B/405B configs):
`enable_fsdp_float8_all_gather` (FSDP2 gathers each weight in float8, after an all-reduce of its
amax) and `precompute_float8_dynamic_scale_for_fsdp` after each optimizer step (one all-reduce
of every weight's amax, so the gather needs none). rowwise takes torchao's recipe as it is
(`Float8LinearConfig.from_recipe_name`); it has no float8 all-gather.

Under TP the preset's styles stay plain (ColwiseParallel / RowwiseParallel), as torchtitan 0.3.0
applies them: its sharding is dtype-agnostic ("quantization (Float8/MXFP8) is orthogonal",
protocols/sharding.py), so the TP collectives move activations in the model's dtype and each
Float8Linear casts its local shard. torchtitan up to 0.2 instead applied torchao's
Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput for tensorwise
(`enable_float8_tensorwise_tp`), gathering activations in float8; that is not modelled, and the
note says so.

Refused: on the CPU (the float8 GEMM there is an emulation, not what a training run does) and on a
GPU below compute capability 8.9, as torch's `_scaled_mm` and torchtitan's converter refuse it.
Not done: float8 for MoE grouped experts (torchtitan's Float8GroupedExpertsConverter), MXFP8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..errors import TapescopeError

__all__ = ["Float8Plan", "convert_float8", "float8_linear_names"]


@dataclass(frozen=True)
class Float8Plan:
    """What was converted: the Linears' names, and whether FSDP2 gathers float8 weights (then
    the scales are precomputed after each optimizer step)."""

    recipe: str
    converted: tuple[str, ...]
    fsdp_float8_all_gather: bool
    tensor_parallel: bool = False  # the preset shards with TP: its styles stay plain

    def describe(self) -> str:
        gather = ("; FSDP2 gathers their weights in float8, scales precomputed after each "
                  "optimizer step") if self.fsdp_float8_all_gather else ""
        tp = ("; the TP styles stay plain, as torchtitan 0.3.0 applies them: TP collectives "
              "move activations in the model's dtype, not float8 (torchtitan up to 0.2's "
              "Float8ColwiseParallel / Float8RowwiseParallel are not modelled)"
              ) if self.tensor_parallel else ""
        return (f"float8 {self.recipe}: {len(self.converted)} Linears of the traced copy "
                f"swapped to torchao's Float8Linear{gather}{tp}")


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        return head
    return next((m for m in (getattr(model, n, None) for n in ("output", "lm_head"))
                 if isinstance(m, nn.Module)), None)


def float8_linear_names(model: nn.Module) -> list[str]:
    """The Linears torchtitan's filter converts: dims multiples of 16, the output head left out."""
    head = _output_head(model)
    return [fqn for fqn, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head
            and m.in_features % 16 == 0 and m.out_features % 16 == 0]


def convert_float8(model: nn.Module, recipe: str, fsdp: bool,
                   tensor_parallel: bool = False) -> Float8Plan:
    """Swap the model's Linears (in place: the traced copy) to torchao's Float8Linear."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise TapescopeError("--float8 needs torchao's float8 training: pip install --no-deps "
                             "torchao==0.18.0") from None
    names = set(float8_linear_names(model))
    all_gather = recipe == "tensorwise" and fsdp
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if all_gather else \
        Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: fqn in names)
    return Float8Plan(recipe, tuple(sorted(names)), all_gather, tensor_parallel)


def precompute_scales(model: nn.Module):
    """The optimizer's step post-hook torchtitan registers for a float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(optimizer, args, kwargs):
        precompute_float8_dynamic_scale_for_fsdp(model)
    return hook
