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


def test_plain_arguments_convert_as_pytree_converts_them():
    """An op's arguments that are all tensors and plain numbers (a step counter's `add_` and
    `.item()`) are converted without `_as_values`' closures (`DataValues._flat_values`): the
    values pytree's conversion gives, the sources and largest size read; any other argument is
    left to `_as_values`, and a tensor without a value gives none."""
    from tapescope.capture.data_values import DataValues
    from tapescope.values.sizes import Sizes

    dv = DataValues(Sizes.create(None), None)
    t, u, w = torch.ones(2), torch.zeros(3), torch.ones(1)  # values are attributes of the tensor
    dv._set(t, torch.tensor([1.0, 2.0]), frozenset({0}))
    dv._set(u, torch.tensor([3, 4, 5]), frozenset({1}))
    for args in [(t, u, 3, 0.5, True, None, 2j), (u,), (0.25, t)]:
        rargs, sources, elements = dv._flat_values(args)
        expected, _ = _pytree_as_values(args, {}, lambda x: dv.value(x)[0])
        assert len(rargs) == len(expected) and all(a is b for a, b in zip(rargs, expected))
        valued = [a for a in args if isinstance(a, torch.Tensor)]
        assert sources == set().union(*(dv.value(a)[1] for a in valued))
        assert elements == max(a.numel() for a in valued)
    for args in [(t, [t, u]), (t, torch.device("meta")), (t, (1, 2)), (torch.Size([2]),)]:
        assert dv._flat_values(args) is None  # _as_values' cases
    assert dv._flat_values((t, w))[0] is None  # w has no value
    # and the op runs on the values as torch runs it on them
    out, sources = dv._run_real(torch.ops.aten.add.Tensor, (t, t), {}, None)
    assert torch.equal(out, torch.tensor([2.0, 4.0])) and sources == frozenset({0})
    out, _ = dv._run_real(torch.ops.aten.mul.Tensor, (u, 2), {}, None)
    assert torch.equal(out, torch.tensor([6, 8, 10]))
