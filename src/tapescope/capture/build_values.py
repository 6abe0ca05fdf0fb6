"""The values of small constants a model makes while it is built on the meta device.

A model given as a build function is built on meta (model.py `build_on_meta`): no memory, no
init compute, and no values. Most models need none, but some keep small integer constants as
buffers and compute sizes from them in forward: transformers' Encodec pads each convolution by
`padding_total`, a 0-dim int64 buffer made in `__init__` as `kernel_size - stride`. The real model
has those values; a meta one would not, and the trace would stop at the pad.

`BuildValues` is a TorchFunctionMode entered around the build, above the meta device: each torch
function whose tensor arguments all have values and whose outputs are small (at most
`BUILD_LIMIT` elements) runs a second time on CPU copies of those values, and the copy hangs on the
meta output (`build_value(t)`). Factories from Python data (`torch.tensor(3)`, `arange(4)`,
`full`) need no inputs. An in-place write runs on the copy too (views of a copy share its storage,
as the meta views share theirs); a write the copies cannot follow (its source has no value)
drops the value of every tensor sharing that storage.

Not followed: random draws (not constants; drawing on CPU would also move the user's generator),
`empty` (no values), anything above the limit, and what C++ writes without a torch function
(`.data =`, a C extension). The builder sees the meta tensors it always saw.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..torch_compat import device_constructors, tree_flatten, tree_map

__all__ = ["BuildValues", "build_value", "keep_build_value", "BUILD_LIMIT"]

BUILD_LIMIT = 64   # elements: a constant (a stride, a kernel size, a table of a few ids), no more
_ATTR = "_tapescope_build_value"   # on a meta tensor: its value, a CPU tensor
# functions whose outputs have no constant value: random draws, uninitialized memory
_NO_VALUE = ("rand", "bernoulli", "normal", "uniform", "multinomial", "exponential", "cauchy",
             "geometric", "random", "poisson", "dropout", "empty")


def build_value(t: torch.Tensor):
    """The value a meta tensor made during the build has (a CPU tensor), or None."""
    return getattr(t, _ATTR, None)


def keep_build_value(meta: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """`meta` (made from `real`) keeps real's value if it is small; returns meta."""
    if real.device.type != "meta" and real.numel() <= BUILD_LIMIT:
        setattr(meta, _ATTR, real.detach().to("cpu", copy=True))
    return meta


class BuildValues(TorchFunctionMode):
    """Values for the small tensors made while building on meta (see the module docstring).
    `forget_unfollowed(model)` after the build drops values a later write made stale."""

    def __init__(self):
        super().__init__()
        self._stale: set = set()   # storages of value copies a write could not follow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        written = _written(name, args, kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        followed = False
        if (outs or written) and not any(w in name for w in _NO_VALUE) \
                and all(build_value(t) is not None or t.device.type != "meta" for t in tensors) \
                and sum(o.numel() for o in outs) <= BUILD_LIMIT \
                and all(t.numel() <= BUILD_LIMIT for t in tensors):
            followed = self._follow(func, args, kwargs, outs)
        if not followed:
            for w in written:
                v = build_value(w)
                if v is not None:
                    self._stale.add(v.untyped_storage().data_ptr())
                    delattr(w, _ATTR)
        return out

    def _follow(self, func, args, kwargs, outs) -> bool:
        def value(x):
            if isinstance(x, torch.Tensor):
                return build_value(x) if x.device.type == "meta" else x
            if isinstance(x, torch.device) or (isinstance(x, str) and _is_device(x)):
                return torch.device("cpu")
            return x

        vargs, vkwargs = tree_map(value, (args, kwargs))
        if kwargs.get("device") is None and func in device_constructors():
            vkwargs["device"] = torch.device("cpu")  # not the meta device the build runs under
        try:
            with torch.no_grad():
                real = func(*vargs, **vkwargs)
        except Exception:  # noqa: BLE001 - what the copies cannot run has no value
            return False
        reals = [r for r in tree_flatten(real)[0] if isinstance(r, torch.Tensor)]
        if len(reals) != len(outs):
            return False
        for o, r in zip(outs, reals):
            if o.device.type == "meta" and r.device.type == "cpu" and o.shape == r.shape:
                setattr(o, _ATTR, r)
        return True

    def forget_unfollowed(self, model: nn.Module) -> None:
        """Drop the values of the model's tensors whose storage a write the copies could not
        follow reached through another view."""
        if not self._stale:
            return
        for m in model.modules():
            for t in list(m._buffers.values()) + [v for v in vars(m).values()
                                                   if isinstance(v, torch.Tensor)]:
                v = None if t is None else build_value(t)
                if v is not None and v.untyped_storage().data_ptr() in self._stale:
                    delattr(t, _ATTR)


def _written(name: str, args, kwargs) -> list:
    """The tensors a torch function writes: `x.add_(...)`, `x[i] = v`, `x += v`, `out=`."""
    out = []
    if args and isinstance(args[0], torch.Tensor) and (
            (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
            or (name.startswith("__i") and name.endswith("__") and name != "__index__"
                and name != "__int__" and name != "__invert__")):
        out.append(args[0])
    o = kwargs.get("out")
    out += [t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor)]
    return out


def _is_device(s: str) -> bool:
    try:
        torch.device(s)
    except (RuntimeError, ValueError):
        return False
    return True

