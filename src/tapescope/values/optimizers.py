"""The optimizers an option may name; capture/optimizers.py builds them for the traced device."""

from __future__ import annotations

import torch

__all__ = ["OPTIMIZERS"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
