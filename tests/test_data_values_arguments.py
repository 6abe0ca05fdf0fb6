"""DataValues maps an aten op's arguments one level deep instead of walking them with pytree (a
profile's optimizer step counters run hundreds of ops on values): the result must be pytree's."""

from collections import namedtuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tapescope.capture.data_values import _as_values, _flat_tensors, _leaves

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


def test_an_ops_result_lists_its_tensors_as_pytree_does():
    """_flat_tensors (the tensors of a result run on values) against tree_flatten's tensors."""
    t, u = torch.ones(2), torch.zeros(3)
    pair = namedtuple("Pair", "a b")
    for out in (t, (t, u), [t, 3, u], (t, [u, t]), pair(t, u), 2.5, None, [], {"a": t},
                (t, torch.Size([2]))):
        want = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        got = _flat_tensors(out)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), out


def test_ops_on_values_run_without_fake_mode_or_grad_and_restore_both():
    """_on_values: inside, no fake mode, grad off, one intra-op thread (unless told it need not
    switch); after, even after an error, what was there before."""
    import pytest
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tapescope.capture.data_values import _on_values

    def state():
        return (torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE),
                torch.is_grad_enabled(), torch.get_num_threads())

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with FakeTensorMode() as mode:
            outside = state()
            assert outside == (mode, True, 2)
            for switch in (True, False):
                with _on_values(threads=switch):
                    assert state() == (None, False, 1 if switch else 2)
                    assert type(torch.ones(1)) is torch.Tensor  # a real tensor
                assert state() == outside
                with pytest.raises(ZeroDivisionError):
                    with _on_values(threads=switch):
                        1 / 0
                assert state() == outside
            with torch.no_grad(), _on_values():
                assert not torch.is_grad_enabled()
            assert state() == outside
    finally:
        torch.set_num_threads(threads)
