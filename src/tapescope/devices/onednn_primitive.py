"""The record of one oneDNN primitive's bytes, shared by the convolution models (onednn.py,
onednn_bf16.py, onednn_brgemm_bwd.py): its own module so that those can import it without
importing each other."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Primitive"]


@dataclass(frozen=True)
class Primitive:
    """One oneDNN primitive as PyTorch runs it: bytes beside PyTorch's own tensors."""

    impl: str                # oneDNN's implementation name (as ONEDNN_VERBOSE prints it)
    src: int = 0             # the source (or diff_dst) reordered into the kernel's layout
    weights: int = 0         # the weights reordered (forward, backward-data)
    dst: int = 0             # the kernel's own destination (ideep's, before PyTorch's copy)
    diff_dst: int = 0        # backward weights: diff_dst reordered
    bias: int = 0            # backward weights: ideep's own bias gradient
    scratchpad: int = 0
    exact: bool = True       # False: a heuristic (see the module doc)
