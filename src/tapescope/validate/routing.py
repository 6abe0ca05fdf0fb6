"""A real model routed as tapescope assumes: the truth for data-dependent (MoE) profiles.

tapescope gives a router's top-k indices values that realize an assumed routing
(capture/data_values.py). A real step routes by its random weights instead, so to compare the two
the real model's routers are forced, by a forward hook, to indices written here by hand (not with
tapescope's own `routing_indices`): balanced takes experts (t*k + j) mod E; worst gives every token
expert 0 and spreads its other choices round-robin over the rest - the counts the assumption gives.
"""

from __future__ import annotations

import torch

__all__ = ["forced_routing"]


def _indices(logits: torch.Tensor, indices: torch.Tensor, routing: str) -> torch.Tensor:
    tokens, k = indices.shape
    experts = logits.shape[-1]
    rows = [[(t * k + j) % experts for j in range(k)] if routing == "balanced" else
            [0] + [1 + (t * (k - 1) + j) % (experts - 1) for j in range(k - 1)]
            for t in range(tokens)]
    return torch.tensor(rows, dtype=indices.dtype)


def forced_routing(build, routing: str):
    """`build` with every transformers `*TopKRouter` (which returns logits, scores, indices)
    hooked to return the indices of `routing` ("balanced" or "worst")."""
    if routing not in ("balanced", "worst"):
        raise ValueError(f"routing must be 'balanced' or 'worst', not {routing!r}")

    def routed():
        model = build()
        for mod in model.modules():
            if type(mod).__name__.endswith("TopKRouter"):
                mod.register_forward_hook(
                    lambda mod, args, out: (out[0], out[1], _indices(out[0], out[2], routing)))
        return model
    return routed
