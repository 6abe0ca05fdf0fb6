"""DataValues maps an aten op's arguments one level deep instead of walking them with pytree (a
profile's optimizer step counters run hundreds of ops on values): the result must be pytree's."""

from collections import namedtuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tapescope.capture.data_values import _as_values, _leaves

_CPU = torch.device("cpu")


def _pytree_as_values(args, kwargs, value):
    """_as_values as pytree computes it (the definition the one-level walk replaces)."""
    def convert(x):
        if isinstance(x, torch.Tensor):
            return value(x)
        return _CPU if isinstance(x, torch.device) else x

    vargs, vkwargs = tree_map(convert, (args, kwargs))
    if "device" in vkwargs:
        vkwargs["device"] = _CPU
    if "pin_memory" in vkwargs:
        vkwargs["pin_memory"] = False
    return tuple(vargs), vkwargs


def test_arguments_map_as_pytree_maps_them():
    t, u = torch.ones(2), torch.zeros(3)
    pair = namedtuple("Pair", "a b")
    cases = [
        ((t, [t, u], 3, None, 0.5, torch.device("meta")),
         {"dtype": torch.float32, "device": torch.device("meta"), "pin_memory": True}),
        ((u, (1, 2), [None, t]), {}),
        (([[t], u],), {}),                         # nested deeper than aten's lists
        ((pair(t, 2),), {"x": {"a": u}}),         # a namedtuple and a dict
        ((torch.Size([2, 3]), [torch.Size([1])]), {}),  # torch.Size is a pytree node
    ]
    value = lambda x: ("value of", id(x))  # noqa: E731
    for args, kwargs in cases:
        assert _as_values(args, kwargs, value, lambda s: s) == \
            _pytree_as_values(args, kwargs, value)
        assert _leaves(args, kwargs) == tree_flatten((args, kwargs))[0]
