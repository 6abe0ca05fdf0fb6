"""Collectives whose real kernel returns its argument where the fake kernel makes a new tensor.

In a real step a functional collective's result is waited on and wrapped without copying:
`_c10d_functional.wait_tensor` returns the very tensor it waited for (Functional.cpp), and
`_c10d_functional._wrap_tensor_autograd` wraps it in an AsyncCollectiveTensor around the same
storage (_functional_collectives.py). Their fake kernels return `empty_like(input)`: memory the
real step never allocates, one activation-sized buffer per tensor-parallel all-reduce.
"""

from __future__ import annotations

import torch

from .registry import OUTPUT, RULES

__all__ = []


def _functional(name: str):
    ns = getattr(torch.ops, "_c10d_functional", None)
    return getattr(ns, name).default if ns is not None and hasattr(ns, name) else None


_RETURN_INPUT = [op for op in (_functional("wait_tensor"), _functional("_wrap_tensor_autograd"))
                 if op is not None]

if _RETURN_INPUT:
    @RULES.register(
        OUTPUT, *_RETURN_INPUT, name="functional_collective_returns_input",
        source="torch/csrc/distributed/c10d/Functional.cpp (wait_tensor returns its input); "
               "torch/distributed/_functional_collectives.py (_wrap_tensor_autograd)",
        test="tests/test_distributed.py::test_every_rank_matches_its_real_process[2-tp]")
    def _returns_input(ctx, func, args, out):
        return args[0]
