"""The sizes a real step's data decided, per source line: what `sizes={"counts": ...}` takes.

A fake trace cannot know how many boxes an NMS keeps or how many proposals a sampler finds
positive: those sizes come from an assumption (capture/data_values.py). To tell an assumption's
error from the trace's own, run the real step under `RecordedSizes` and profile with its
`counts`: every data-dependent size then equals the real one, and what still differs is the
trace's.

An op counts when its output's size depends on values: torch tags those `dynamic_output_shape`
(nonzero, masked_select, unique, an index by a boolean mask; an index by integers is tagged too
but its size is the index's, so it does not count); a library op counts when its fake kernel
makes an unbacked size (torchvision's nms), asked once per op. The line is the innermost frame
outside torch and tapescope, as the trace names it (basename:line).

    with RecordedSizes() as sizes:
        run_real_steps(build, inputs, optimizer="sgd")   # the sizes (the same seed each run)
    real = run_real_steps(build, inputs, optimizer="sgd")  # the allocator's peaks
    p = tapescope.profile(build, *inputs, optimizer="sgd", sizes={"counts": sizes.counts})

The peaks come from a second run: under this mode, `run_real_steps`' profiler loses its step
markers (only setup's peak is read; not investigated).
"""

from __future__ import annotations

import os
import sys

import torch

from ..torch_compat import (FakeTensorMode, ShapeEnv, TorchDispatchMode, free_unbacked_symbols,
                            tree_flatten, tree_map)

__all__ = ["RecordedSizes"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCH_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HELPERS = ("contextlib.py", "functools.py")  # decorators' frames: the line is above them
_DYNAMIC = torch.Tag.dynamic_output_shape


class RecordedSizes(TorchDispatchMode):
    """A dispatch mode that records, for each call of a data-dependent op, the size of its
    output's first dimension (the one the data decides), under the call's source line."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}       # "boxes.py:54" -> [size of each call, in order]
        self._library: dict = {}     # library op -> whether its fake kernel makes a size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._data_dependent(func, args, kwargs):
            first = next(o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
            self.counts.setdefault(_line(), []).append(int(first.shape[0]))
        return out

    def _data_dependent(self, func, args, kwargs) -> bool:
        if _DYNAMIC in func.tags:
            if func is torch.ops.aten.index.Tensor:  # a size only where a mask selects
                return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                           for i in args[1])
            return True
        if func.namespace in ("aten", "prims") or not any(
                isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
            return False  # no tensor in, no size a tensor's values decide
        known = self._library.get(func)
        if known is None:
            known = self._library[func] = _makes_unbacked_size(func, args, kwargs)
        return known


def _makes_unbacked_size(func, args, kwargs) -> bool:
    """Whether the op's fake kernel gives its output a size no shape decides."""
    try:
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fargs, fkwargs = tree_map(
                lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
            out = func(*fargs, **fkwargs)
    except Exception:  # noqa: BLE001 - no fake kernel: the trace could not run it either
        return False
    return any(free_unbacked_symbols(s) for o in tree_flatten(out)[0]
               if isinstance(o, torch.Tensor) for s in o.shape if isinstance(s, torch.SymInt))


def _line() -> str:
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not ((fn.startswith(_TORCH_DIR) and not fn.startswith(_TORCH_OPTIM_DIR))
                or fn.startswith(_OWN_DIR) or fn.endswith(_HELPERS)):
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return "?"
