"""Backward formulas (FunctionsManual.cpp) that branch on "is this a tensor subclass?"."""

from __future__ import annotations

import torch

from .registry import BACKWARD_OP, RULES

__all__ = []

_INDEX_PUT = torch.ops.aten.index_put.default
_INDEX_PUT_IMPL = torch.ops.aten._index_put_impl_.default


@RULES.register(BACKWARD_OP, _INDEX_PUT,
                source="torch/csrc/autograd/FunctionsManual.cpp (index_backward)",
                test="tests/test_engine.py::test_index_backward_accumulates_in_place_as_for_plain_tensors")
def index_backward_accumulates_in_place(ctx, func, args, kwargs):
    """IndexBackward0 (the gradient of `x[idx]`): for plain tensors
    `at::_index_put_impl_(zeros_like_self, indices, grad, true, true)` accumulates into the zeros
    the formula just made; for subclasses `zeros_like_self.index_put(indices, grad, true)`, a
    second self-sized tensor."""
    if ctx.node is None or type(ctx.node).__name__ != "IndexBackward0":
        return None
    self, indices, values, *rest = args
    accumulate = rest[0] if rest else kwargs.get("accumulate", False)
    if not accumulate:
        return None
    return _INDEX_PUT_IMPL, (self, indices, values, True, True), {}
