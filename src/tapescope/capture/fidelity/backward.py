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


# value_selecting_reduction_backward: the gradient of max/min/topk/kthvalue/mode/median/sort along
# a dimension, for each node that calls it
_VALUE_SELECTING_NODES = frozenset({
    "TopkBackward0", "MaxBackward0", "MinBackward0", "KthvalueBackward0", "ModeBackward0",
    "MedianBackward1", "NanmedianBackward1", "SortBackward0", "SortBackward1"})
_NEW_ZEROS, _ZEROS = torch.ops.aten.new_zeros.default, torch.ops.aten.zeros.default
_SCATTER, _SCATTER_ = torch.ops.aten.scatter.src, torch.ops.aten.scatter_.src


def _in_value_selecting_backward(ctx) -> bool:
    return ctx.node is not None and ctx.node.name() in _VALUE_SELECTING_NODES


@RULES.register(BACKWARD_OP, _NEW_ZEROS,
                source="aten/src/ATen/native/ReduceOps.cpp (value_selecting_reduction_backward)",
                test="tests/test_engine.py::test_value_selecting_backward_scatters_in_place")
def value_selecting_backward_makes_zeros(ctx, func, args, kwargs):
    """The gradient buffer is `at::zeros(sizes, grad.options())` for plain tensors."""
    if not _in_value_selecting_backward(ctx):
        return None
    grad, size = args[0], args[1]
    return _ZEROS, (size,), {"dtype": kwargs.get("dtype") or grad.dtype,
                             "layout": kwargs.get("layout") or grad.layout,
                             "device": kwargs.get("device") or grad.device}


@RULES.register(BACKWARD_OP, _SCATTER,
                source="aten/src/ATen/native/ReduceOps.cpp (value_selecting_reduction_backward: "
                       "scatter_ unless a tensor subclass is involved)",
                test="tests/test_engine.py::test_value_selecting_backward_scatters_in_place")
def value_selecting_backward_scatters_in_place(ctx, func, args, kwargs):
    """`grad_in.scatter_(dim, indices, grad)` into the zeros for plain tensors; `scatter`, a second
    input-sized tensor, for subclasses."""
    if not _in_value_selecting_backward(ctx):
        return None
    return _SCATTER_, args, kwargs


_SCATTER_ADD, _SCATTER_ADD_ = torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_add_.default


@RULES.register(BACKWARD_OP, _SCATTER_ADD,
                source="torch/csrc/autograd/FunctionsManual.cpp (gather_backward: scatter_add_ into "
                       "grad.new_zeros unless index or grad is a tensor subclass)",
                test="tests/test_engine.py::test_gather_backward_scatters_in_place")
def gather_backward_scatters_in_place(ctx, func, args, kwargs):
    """GatherBackward0 (the gradient of `x.gather(dim, index)`: a router's weights of the chosen
    experts) adds into the zeros it made for plain tensors; `scatter_add` for subclasses makes a
    second input-sized tensor."""
    if ctx.node is None or ctx.node.name() != "GatherBackward0":
        return None
    return _SCATTER_ADD_, args, kwargs


_SUB, _SUB_ = torch.ops.aten.sub.Tensor, torch.ops.aten.sub_.Tensor
_MUL, _MUL_ = torch.ops.aten.mul.Tensor, torch.ops.aten.mul_.Tensor


@RULES.register(BACKWARD_OP, _SUB, _MUL,
                source="torch/csrc/autograd/FunctionsManual.cpp (binary_cross_entropy_with_logits"
                       "_backward: input.sigmoid().sub_(target), grad_input.mul_(grad), "
                       ".mul_(weight) unless a tensor is a subclass or grad mode is on)",
                test="tests/test_detection.py::test_bce_with_logits_backward_works_in_place")
def bce_with_logits_backward_works_in_place(ctx, func, args, kwargs):
    """BinaryCrossEntropyWithLogitsBackward0 (RetinaNet's and FCOS's sigmoid focal loss) writes
    into the sigmoid it just made for plain tensors; a subclass takes `sub`/`mul`, one more
    input-sized tensor at each. Left as traced with a pos_weight (its `pos_weight.mul(target)`
    stays out of place) and under create_graph (grad mode on: out of place for real too)."""
    node = ctx.node
    if node is None or node.name() != "BinaryCrossEntropyWithLogitsBackward0" \
            or torch.is_grad_enabled() or getattr(node, "_saved_pos_weight", None) is not None:
        return None
    return (_SUB_ if func is _SUB else _MUL_), args, kwargs
