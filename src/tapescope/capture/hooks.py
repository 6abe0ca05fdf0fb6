"""What autograd saves, and the backward hooks the step registers, kept where our engine can use them.

Saved tensors. A saved-tensor pack hook marks each tensor autograd saves (that is how we know what is
"saved for backward", from autograd itself) and stores it in a holder. The real engine frees a node's
saved tensors right after running it (`release_variables`), which no Python API exposes; clearing the
node's holders does the same. Which node owns a holder is learnt when the node unpacks it while it
runs (the sequence number at pack time can belong to another node: `hardtanh_` creates its node,
then clones `self` - a second node - and saves the clone); holders never unpacked are released with
the node whose number was current when they were packed, except the output an in-place op on a view
saves: it belongs to the base's CopySlices, which runs the op's node (see `pack`).

Hooks. C++ keeps backward hooks where Python cannot list them, and our engine calls nodes from Python,
where the C++ engine's hook calls do not happen. So while the step runs, the Python entry points
that register hooks (`Tensor.register_hook`, `Tensor.retain_grad`, a custom Function node's
`register_hook` / `register_prehook`) also file the hook here. Leaf tensors keep theirs in
`_backward_hooks` / `_post_accumulate_grad_hooks`, which the engine reads directly. Hooks added from
C++, or with `register_hook` on a C++ node, are not seen (module backward hooks use the custom
Function path, which is).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.autograd.function import BackwardCFunction

from ..torch_compat import node_sequence_nr, sequence_nr
from .tape import _VALUE_ATTR, Tape

__all__ = ["SavedTensors", "HookRegistry", "VARIABLE_INPUTS"]


class SavedTensors:
    """Holders of saved tensors, by the seq_nr of the node that saved them."""

    def __init__(self, tape: Tape):
        self.tape = tape
        self._by_node: dict[int, list] = {}
        self._running: list | None = None  # holders unpacked by the node now running

    def pack(self, t: torch.Tensor):
        tape = self.tape
        v = tape.value_of(t)
        tape.mark_saved(t)
        seq = sequence_nr() - 1
        gf = t.grad_fn
        if gf is not None and node_sequence_nr(gf) == seq:
            base = t._base if t._is_view() else None
            base_fn = base.grad_fn if base is not None else None
            if base_fn is not None and base_fn.name().endswith("CopySlices"):
                # An in-place op on a view saved its output after autograd rebased the view: the
                # newest node is the view's regenerated grad_fn, but the op's node runs inside
                # its base's CopySlices, which is the node that unpacks the tensor
                seq = node_sequence_nr(base_fn)
            # A saved output: packing the tensor itself would make tensor -> grad_fn -> saved
            # tensor a cycle through C++ that never frees. Autograd saves outputs without their
            # grad_fn; an unrecorded detach() keeps the storage and the value id the same way.
            with tape.unrecorded():
                t = t.detach()
            if v is not None:
                setattr(t, _VALUE_ATTR, v)
        holder = [t]
        self._by_node.setdefault(seq, []).append(holder)
        return holder

    def unpack(self, holder):
        t = holder[0]
        if t is None:
            raise RuntimeError("tapescope: a saved tensor was used after its node ran "
                               "(backward through the graph a second time?)")
        if self._running is not None:
            self._running.append(holder)
        return t

    def node_started(self) -> None:
        self._running = []

    def node_finished(self, seq_nr: int) -> None:
        """Drop the tensors the node saved, as the engine's release_variables() does."""
        for holder in self._running or ():
            holder[0] = None
        self._running = None
        for holder in self._by_node.pop(seq_nr, ()):
            holder[0] = None

    def release_unpacked(self) -> None:
        """`ctx.maybe_clear_saved_tensors()`: a custom Function drops its saved tensors while it runs
        (AOTAutograd's compiled backward does, so that its generated code frees each one at its
        last use); the holders the node unpacked let go of them too."""
        for holder in self._running or ():
            holder[0] = None

    @contextmanager
    def active(self):
        original = BackwardCFunction.maybe_clear_saved_tensors
        saved = self

        def maybe_clear_saved_tensors(ctx):
            original(ctx)
            saved.release_unpacked()

        BackwardCFunction.maybe_clear_saved_tensors = maybe_clear_saved_tensors
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            del BackwardCFunction.maybe_clear_saved_tensors  # the C method shows through again


VARIABLE_INPUTS = "_tapescope_variable_inputs"


def mark_variable_inputs(cls, args, out) -> None:
    """Which forward arguments of a custom Function were tensors, kept on its backward node.

    The C++ engine keeps this (`is_variable_input`) to drop the gradients a backward returns for
    non-tensor arguments (AOTAutograd's compiled function takes symbolic sizes); Python cannot
    read it, so it is recorded when the Function is applied."""
    backward_cls = getattr(cls, "_backward_cls", None)
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
        if node is not None and type(node) is backward_cls:
            setattr(node, VARIABLE_INPUTS, tuple(isinstance(a, torch.Tensor) for a in args))
            return


class HookRegistry:
    """Backward hooks registered while the step runs, by (node, output_nr) or node."""

    def __init__(self):
        self.tensor_hooks: dict = {}    # (node, output_nr) -> [hooks dict, ...] of non-leaf tensors
        self.retained: dict = {}        # (node, output_nr) -> weakref to the tensor to fill .grad
        self.pre_hooks: dict = {}       # node -> [fn(grad_outputs)]
        self.post_hooks: dict = {}      # node -> [fn(grad_inputs, grad_outputs)]

    @contextmanager
    def recording(self):
        reg = self
        orig_register_hook = torch.Tensor.register_hook
        orig_retain_grad = torch.Tensor.retain_grad
        orig_node_hook = BackwardCFunction.register_hook
        orig_node_prehook = BackwardCFunction.register_prehook

        def register_hook(t, hook):
            handle = orig_register_hook(t, hook)
            if t.grad_fn is not None:
                dicts = reg.tensor_hooks.setdefault((t.grad_fn, t.output_nr), [])
                if not any(d is t._backward_hooks for d in dicts):
                    dicts.append(t._backward_hooks)
            return handle

        def retain_grad(t):
            orig_retain_grad(t)
            if t.grad_fn is not None:
                reg.retained[(t.grad_fn, t.output_nr)] = weakref.ref(t)

        def node_hook(node, fn):
            reg.post_hooks.setdefault(node, []).append(fn)
            return orig_node_hook(node, fn)

        def node_prehook(node, fn):
            reg.pre_hooks.setdefault(node, []).append(fn)
            return orig_node_prehook(node, fn)

        orig_apply = torch.autograd.Function.__dict__["apply"]

        def apply(cls, *args, **kwargs):
            out = orig_apply.__get__(None, cls)(*args, **kwargs)
            mark_variable_inputs(cls, args, out)
            return out

        torch.Tensor.register_hook = register_hook
        torch.Tensor.retain_grad = retain_grad
        BackwardCFunction.register_hook = node_hook
        BackwardCFunction.register_prehook = node_prehook
        torch.autograd.Function.apply = classmethod(apply)
        try:
            yield self
        finally:
            torch.Tensor.register_hook = orig_register_hook
            torch.Tensor.retain_grad = orig_retain_grad
            BackwardCFunction.register_hook = orig_node_hook
            BackwardCFunction.register_prehook = orig_node_prehook
            torch.autograd.Function.apply = orig_apply
