"""An in-place op on a view: what autograd does for a plain tensor, not for a subclass.

After an in-place op on a differentiable view, autograd rebases the view: its base gets a
CopySlices node, and the view's grad_fn is regenerated (variable.cpp, VariableHooks::grad_fn).
For a plain strided tensor it regenerates it as AsStridedBackward0 from the view's geometry: no
op runs in the forward, and in the backward `as_strided_backward` runs new_zeros (the base's
storage size), as_strided, copy_, as_strided. For a tensor subclass such as FakeTensor it replays
the view ops on the base instead (a `view` in the forward, ViewBackward0 in the backward). So here:

- forward: the view ops autograd replays right after the in-place op are run but not recorded
  (`ViewRegeneration.intercept`);
- backward: for a view regenerated from a single view op, the engine runs what
  AsStridedBackward0 runs (`as_strided_backward`), which allocates the base-sized buffer the real
  step allocates, and the base's CopySlices takes its view with as_strided (the fidelity rule in
  capture/fidelity/views.py).

The real AsStridedBackward0's overlap handling (index_add_ for expanded or self-overlapping
geometries) is not emulated: those views keep the replayed node. tests/test_engine.py compares
the op sequence with the real step's.
"""

from __future__ import annotations

import torch

from ..torch_compat import statically_known_true

__all__ = ["ViewRegeneration", "as_strided_backward", "emulable"]


def _geometry(t) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _values(geometry) -> tuple:
    sizes, strides, offset = geometry
    return (*sizes, *strides, offset)


def _same(a, b) -> bool:
    """Equal geometries, compared without placing a guard on symbolic sizes."""
    va, vb = _values(a), _values(b)
    return len(va) == len(vb) and all(
        x == y if isinstance(x, int) and isinstance(y, int)
        else isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt) and x.node.expr == y.node.expr
        for x, y in zip(va, vb))


def writes_first_argument(func) -> bool:
    """Whether `func` writes its first argument (its schema's `Tensor(a!) self`): the ops
    `ViewRegeneration.after_op` is for. An operator without a schema (a higher-order one)
    writes none."""
    schema = getattr(func, "_schema", None)
    args = schema.arguments if schema is not None else ()
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class ViewRegeneration:
    """Follows the view replay after each in-place op on a differentiable view."""

    def __init__(self):
        self.nodes: dict = {}  # regenerated grad_fn -> (base geometry, view geometry)
        self.copy_slices: dict = {}  # the base's CopySlices -> the view's geometry in the base
        self._replay = None    # (base, view geometry, view, [(func, args, kwargs, out)])
        self._resolve = None   # (view, geometries): read the view's new grad_fn at the next op

    @property
    def busy(self) -> bool:
        return self._replay is not None or self._resolve is not None

    def after_op(self, func, args) -> None:
        """Call after recording a forward op that writes its first argument
        (`writes_first_argument`, which the caller asks once per op): an in-place op on a view
        starts a replay."""
        if isinstance(args[0], torch.Tensor) and args[0]._is_view() \
                and args[0].requires_grad and torch.is_grad_enabled() \
                and args[0]._base is not None:
            view = args[0]
            self._replay = (view._base, _geometry(view), view, [])

    def intercept(self, run, record, func, args, kwargs):
        """The output of autograd's replay of a view op (run, not recorded), else None; `run()`
        runs the op, `record(func, args, kwargs, out)` records one."""
        if self._resolve is not None:
            view, geometries = self._resolve
            self._resolve = None
            if view.grad_fn is not None:
                self.nodes[view.grad_fn] = geometries
        if self._replay is None:
            return None
        base, target, view, ops = self._replay
        if func.is_view and args and (args[0] is base or (ops and args[0] is ops[-1][3])):
            out = run()
            ops.append((func, args, kwargs, out))
            if _same(_geometry(out), target):
                self._replay = None
                if len(ops) == 1:
                    self._resolve = (view, (_geometry(base), target))
                    if base.grad_fn is not None and base.grad_fn.name().endswith("CopySlices"):
                        sizes, strides, offset = target
                        self.copy_slices[base.grad_fn] = (sizes, strides,
                                                          offset - base.storage_offset())
            return out
        self._replay = None  # not autograd's replay: the views were the program's own
        for op in ops:
            record(*op)
        return None


def _known(condition) -> bool:
    """True when it holds for every size (no guard placed on symbolic sizes)."""
    return statically_known_true(condition) if isinstance(condition, torch.SymBool) else condition


def _min_storage_size(sizes, strides, offset):
    if any(_known(s == 0) for s in sizes):
        return 0
    return offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))


def emulable(geometries) -> bool:
    """Geometries as_strided_backward handles without its overlap path: positive strides (a
    stride 0 only on a size-1 dimension) and no empty dimension, known for every size."""
    (_, in_strides, _), (out_sizes, out_strides, _) = geometries
    return all(_known(st > 0) for st in in_strides) and all(
        _known(st > 0) or _known(s <= 1) for s, st in zip(out_sizes, out_strides)) and not any(
        _known(s == 0) for s in out_sizes)


def as_strided_backward(grad, geometries):
    """FunctionsManual.cpp as_strided_backward for non-overlapping geometries."""
    (in_sizes, in_strides, in_offset), (out_sizes, out_strides, out_offset) = geometries
    shared = torch.sym_min(in_offset, out_offset)
    in_eff, out_eff = in_offset - shared, out_offset - shared
    size = torch.sym_max(_min_storage_size(in_sizes, in_strides, in_eff),
                         _min_storage_size(out_sizes, out_strides, out_eff))
    storage = grad.new_zeros((size,))
    storage.as_strided(out_sizes, out_strides, out_eff).copy_(grad)
    return storage.as_strided(in_sizes, in_strides, in_eff)
