"""Reading a tensor's values on the host, where an assumption decided them (data_values.py).

`.tolist()` and `.numpy()` read a tensor's memory without dispatching an op, so a fake tensor
cannot answer them. Where the capture's assumption gave the tensor values (the experts a router
chose, the tokens each expert got), the real step would read exactly those: we return them.
"""

from __future__ import annotations

import torch

from .registry import FUNCTION, RULES

__all__ = []


@RULES.register(FUNCTION, torch.Tensor.tolist, torch.Tensor.numpy,
                source="torch/csrc/utils/tensor_list.cpp (tolist), tensor_numpy.cpp (numpy)",
                test="tests/test_data_sizes.py::test_counts_read_on_the_host_split_the_tokens")
def assumed_values_read_on_the_host(ctx, func, args, kwargs):
    """The values the assumption gave, as the real tensor's would be read."""
    values, t = ctx.values, args[0] if args else None
    if values is None or not isinstance(t, torch.Tensor) or len(args) > 1 or kwargs:
        return func(*args, **kwargs)
    if values.value(t) is None:
        values.check_known(func, [t])  # a random draw, a meta buffer: says which
        return func(*args, **kwargs)
    return values.read(t, func.__name__)
