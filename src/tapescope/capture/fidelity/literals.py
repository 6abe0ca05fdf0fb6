"""Tensor literals: which ops a real run dispatches to make one, by the function that makes it.

`torch.tensor(data)` builds a real tensor outside the dispatcher and lifts it into fake mode
(`aten.lift_fresh`), so a fake trace sees one op where the real run dispatches
empty -> lift_fresh -> detach_ (fewer for as_tensor and for a scalar assigned into a tensor). The
function rules below only mark the maker as running; the tape records `LITERAL_OPS[maker]`.
"""

from __future__ import annotations

import torch

from .registry import FUNCTION, RULES

__all__ = ["LITERAL_OPS", "literal_ops"]

# As the profiler shows them for real tensors.
LITERAL_OPS = {
    torch.tensor: ("empty", "lift_fresh", "detach_"),
    torch.as_tensor: ("empty", "lift_fresh"),
    torch.Tensor.__setitem__: ("lift_fresh",),  # x[i] = 3: the scalar, lifted
}


def literal_ops(ctx) -> tuple:
    """The ops the real run dispatches for the literal being lifted now."""
    maker = ctx.innermost(LITERAL_OPS)
    return LITERAL_OPS.get(maker, LITERAL_OPS[torch.tensor])


@RULES.register(FUNCTION, *LITERAL_OPS, source="torch/csrc/utils/tensor_new.cpp (internal_new_from_data)",
                test="tests/test_engine.py::test_composite_branches_and_literals_run_as_for_plain_tensors")
def tensor_literal_maker(ctx, func, args, kwargs):
    """Marks the maker running while it runs (FunctionRulesMode does); see `literal_ops`."""
    return func(*args, **kwargs)
