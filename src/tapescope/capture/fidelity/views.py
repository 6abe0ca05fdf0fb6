"""An in-place op on a view: autograd regenerates the view for a plain tensor with as_strided.

The mechanism (which view ops autograd replays, and what AsStridedBackward0 runs) lives in
capture/view_replay.py; this is the rule the backward dispatch applies.
"""

from __future__ import annotations

import torch

from .registry import ANY_OP, BACKWARD_OP, RULES

__all__ = []

_AS_STRIDED = torch.ops.aten.as_strided.default


@RULES.register(BACKWARD_OP, ANY_OP,
                source="torch/csrc/autograd/functions/tensor.cpp (CopySlices::apply: "
                       "result.as_strided for a plain tensor, view_fn for a subclass)",
                test="tests/test_engine.py::test_in_place_ops_on_views_regenerate_views_as_for_plain_tensors")
def copy_slices_takes_view_with_as_strided(ctx, func, args, kwargs):
    """CopySlices takes the view of its gradient buffer with `as_strided` for a plain tensor and
    by replaying the view op for a subclass: the first view op the node runs is that one."""
    views = ctx.views
    if views is None or not views.copy_slices or ctx.node is None or not func.is_view:
        return None
    geometry = views.copy_slices.pop(ctx.node, None)
    if geometry is None:
        return None
    return _AS_STRIDED, (args[0], *geometry), {}
