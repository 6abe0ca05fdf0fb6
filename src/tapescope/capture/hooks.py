"""What autograd saves, and the backward hooks the step registers, kept where our engine can use them.

Saved tensors. A saved-tensor pack hook marks each tensor autograd saves (that is how we know what is
"saved for backward", from autograd itself) and stores it in a holder. The real engine frees a node's
saved tensors right after running it (`release_variables`), which no Python API exposes; clearing the
node's holders does the same. Which node owns a holder is learnt when the node unpacks it while it
runs (the sequence number at pack time can belong to another node: `hardtanh_` creates its node,
then clones `self` - a second node - and saves the clone); holders never unpacked are released with
the node whose number was current when they were packed, except the output an in-place op on a view
saves: it belongs to the base's CopySlices, which runs the op's node (see `pack`), and the inputs
torch.utils.checkpoint saves from Python (`_make_saved_tensor`): they belong to its checkpoint
frame, not to any node, and live as long as it does (see `_saved_by_checkpoint_frame`).

Other saved-tensor hooks. Code the step runs may push its own hooks above ours (torch.utils.checkpoint
does, to drop what it saves and recompute it; so does save_on_cpu). A SavedVariable then holds what
that hook packed, and the real engine releases it, with the hook functions, when the node runs. So
every hook pushed during the step is wrapped: what it packs goes into one of our holders, released
like the others, and the wrapper lets go of the hook when its context exits. Holders are registered
weakly, so a graph dropped without a backward (the one checkpoint builds while recomputing) frees
what it saved. A holder that a hook unpacks inside its own unpack (checkpoint reading the inputs it
saved, to recompute) belongs to that hook's object, not to the node running.

Hooks. C++ keeps backward hooks where Python cannot list them, and our engine calls nodes from Python,
where the C++ engine's hook calls do not happen. So while the step runs, the Python entry points
that register hooks (`Tensor.register_hook`, `Tensor.retain_grad`, a custom Function node's
`register_hook` / `register_prehook`) also file the hook here. Leaf tensors keep theirs in
`_backward_hooks` / `_post_accumulate_grad_hooks`, which the engine reads directly. A hook filed on
a C++ node (`node.register_prehook`: torch.distributed.pipelining's split backward captures
gradients so) goes through no Python method of the node, but torch files it by calling the Python
`Function._register_hook(dict, hook)` with the node's own dict of hooks: once the step has filed
one, the engine reads a C++ node's hooks by filing a probe on it and reading the dict torch hands
over (`cpp_node_hooks`). Hooks added from C++ code are not seen.
"""

from __future__ import annotations

import re
import sys
import weakref
from contextlib import contextmanager

import torch
from torch.autograd.function import BackwardCFunction

from ..errors import user_error
from ..torch_compat import (checkpoint_input_saver, disable_torch_function,
                            mark_internal_saved_tensors_hooks,
                            node_hook_registrar, node_sequence_nr, patched,
                            pop_saved_tensors_hooks, push_saved_tensors_hooks, sequence_nr,
                            storage_key)
from .tape import _VALUE_ATTR, Tape

__all__ = ["SavedTensors", "HookRegistry", "VARIABLE_INPUTS"]

_KEPT_WITH_NODE = "tapescope: saved without a hook"


class _Held:
    """What a SavedVariable holds while the step runs: a tensor (our own hook) or what another
    saved-tensor hook packed, with that hook's unpack function. Clearing it is our
    `release_variables()`; it is weakly registered, so it also dies with its SavedVariable (a
    graph dropped without a backward, like the graph a checkpoint builds while recomputing)."""

    __slots__ = ("value", "unpack", "claimed", "saved_as", "__weakref__")

    def __init__(self, value, unpack=None, saved_as=None):
        self.value, self.unpack, self.claimed = value, unpack, False
        # (version, output_nr, owner) for SavedVariable::unpack's version check; None for what
        # another hook packed (the C++ check is skipped when saved-tensor hooks are set)
        self.saved_as = saved_as

    def release(self) -> None:
        self.value = self.unpack = None


class _WrappedPack:
    """A pack hook pushed during the step (torch.utils.checkpoint's, a user's), wrapped so that
    what it packs is held in a _Held we can release. Attributes are read through to the hook
    (checkpoint looks for `_checkpoint_internal` / `_user_hooks` on the hook on top of the stack).
    It lets go of the hook when the hook's context exits: a SavedVariable keeps its pack hook
    until it is released, and our engine never releases SavedVariables, so holding the hook would
    keep alive whatever it refers to (a checkpoint frame and the inputs it saved) for too long."""

    __slots__ = ("inner", "inner_unpack", "saved")

    def __init__(self, inner, inner_unpack, saved):
        self.inner, self.inner_unpack, self.saved = inner, inner_unpack, saved

    def __call__(self, t):
        return self.saved._pack_wrapped(self, t)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "inner"), name)


class SavedTensors:
    """Holders of saved tensors, by the seq_nr of the node that saved them."""

    def __init__(self, tape: Tape):
        self.tape = tape
        self._by_node: dict[int, list] = {}   # seq_nr -> [weakref to _Held]
        self._running: list[list] = []        # per node running (innermost last): _Held it unpacked
        self._in_hook = 0                     # > 0 while a wrapped hook's unpack runs

    def _owner_seq(self, t: torch.Tensor) -> int:
        """The seq_nr of the node a tensor is saved for, as far as pack time can tell."""
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
        return seq

    def _register(self, held: _Held, seq: int) -> _Held:
        self._by_node.setdefault(seq, []).append(weakref.ref(held))
        return held

    def pack(self, t: torch.Tensor):
        tape = self.tape
        v = tape.value_of(t)
        tape.mark_saved(t)
        if _saved_by_checkpoint_frame(sys._getframe(2)):
            return _frames_own(_Held(t, saved_as=(t._version, t.output_nr,
                                                  None if t.grad_fn is None else _INPUT)))
        seq = self._owner_seq(t)
        gf = t.grad_fn
        # what SavedVariable::unpack checks (it skips the check when saved-tensor hooks are set,
        # as ours are, so we make it): the version at save time, and what its message names
        version, output_nr, owner = t._version, t.output_nr, (None if gf is None else _INPUT)
        if gf is not None and node_sequence_nr(gf) == sequence_nr() - 1:
            # A saved output: packing the tensor itself would make tensor -> grad_fn -> saved
            # tensor a cycle through C++ that never frees. Autograd saves outputs without their
            # grad_fn; an unrecorded detach() keeps the storage and the value id the same way.
            # (Through the replay front, as the model copy's detaches: FakeTensorMode's result,
            # ~15 us where its dispatch takes ~90 us; one per saved output)
            with tape.unrecorded(), tape.unrecorded_through_front():
                t = t.detach()
            if v is not None:
                setattr(t, _VALUE_ATTR, v)
            owner = gf.name()  # a saved output names the node that saved it (saved_for)
        return self._register(_Held(t, saved_as=(version, output_nr, owner)), seq)

    def keep_with_node(self, node, value) -> None:
        """Autograd saved `value` for `node` without calling any pack hook (SavedVariable skips
        the hooks for a wrapped Python number): it lives as long as the node does (in the
        node's own metadata dict) and is released when the node runs, as release_variables()
        releases it."""
        held = _Held(value)
        node.metadata.setdefault(_KEPT_WITH_NODE, []).append(held)
        self._register(held, node_sequence_nr(node))

    def unpack(self, held: _Held):
        t = held.value
        if t is None:
            # PyTorch's own refusal (torch/csrc/autograd/saved_variable.cpp, ERR_BACKWARD_TWICE)
            raise user_error(RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward."))
        if held.saved_as is not None:
            with disable_torch_function():  # SavedVariable::unpack's C++ check: no mode sees it
                modified = t._version != held.saved_as[0]
            if modified:
                raise user_error(RuntimeError(_modified_message(t, *held.saved_as)))
        self._claim(held)
        return t

    def _claim(self, held: _Held) -> None:
        """The node running now owns what it unpacks, except what a saved-tensor hook unpacks
        inside its own unpack (torch.utils.checkpoint reading the inputs it saved to recompute
        from): that belongs to the hook's object and lives as long as it does."""
        if self._in_hook:
            held.claimed = True
        elif self._running and not held.claimed:
            self._running[-1].append(held)

    def _pack_wrapped(self, hook: _WrappedPack, t: torch.Tensor):
        inner, unpack = hook.inner, hook.inner_unpack
        if inner is None:
            raise RuntimeError("tapescope: a saved-tensor pack hook was called after its context "
                               "exited")
        # A pack hook runs inside the autograd kernel of the op that saves, so what it dispatches
        # is inside that op - except when torch.utils.checkpoint saves its own inputs from Python
        # (`_make_saved_tensor`, its only caller), outside any op.
        inside_op = not _saved_by_checkpoint_frame(sys._getframe(2))
        self.tape.in_pack_hook += inside_op
        try:
            packed = inner(t)
        finally:
            self.tape.in_pack_hook -= inside_op
        if isinstance(packed, torch.Tensor) and storage_key(packed) == storage_key(t):
            self.tape.mark_saved(t)  # the hook keeps the tensor itself: it is saved
        if not inside_op:
            return _frames_own(_Held(packed, unpack))
        return self._register(_Held(packed, unpack), self._owner_seq(t))

    def _unpack_wrapped(self, held: _Held):
        unpack = held.unpack
        if unpack is None:
            # PyTorch's own refusal (torch/csrc/autograd/saved_variable.cpp, ERR_BACKWARD_TWICE)
            raise user_error(RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved "
                "tensors after they have already been freed). Saved intermediate values of the "
                "graph are freed when you call .backward() or autograd.grad(). Specify "
                "retain_graph=True if you need to backward through the graph a second time or "
                "if you need to access saved tensors after calling backward."))
        self._claim(held)
        self._in_hook += 1
        try:
            return unpack(held.value)
        finally:
            self._in_hook -= 1

    def node_started(self) -> None:
        self._running.append([])

    def node_finished(self, seq_nr: int, release: bool = True) -> None:
        """Drop the tensors the node saved, as the engine's release_variables() does (unless the
        graph is kept: retain_graph=True)."""
        unpacked = self._running.pop()
        if not release:
            return
        for held in unpacked:
            held.release()
        for ref in self._by_node.pop(seq_nr, ()):
            held = ref()
            if held is not None and not held.claimed:
                held.release()

    def release_unpacked(self) -> None:
        """`ctx.maybe_clear_saved_tensors()`: a custom Function drops its saved tensors while it runs
        (AOTAutograd's compiled backward does, so that its generated code frees each one at its
        last use); the holders the node unpacked let go of them too."""
        for held in self._running[-1] if self._running else ():
            held.release()

    @contextmanager
    def active(self):
        """Our hooks at the bottom of the saved-tensor hook stack, and every hook pushed above
        them during the step wrapped (see _WrappedPack)."""
        pack, unpack = _bare(self.pack), _bare(self.unpack)
        # torch.utils.checkpoint looks past its own hooks for the user's
        # (`_current_user_saved_tensors_hooks`), and behaves differently when it finds some
        # (selective checkpointing routes what it caches through them). Ours are not the user's:
        # in a real step there are none, so we present ours as internal, with no user hooks below.
        mark_internal_saved_tensors_hooks(pack)
        cls = torch.autograd.graph.saved_tensors_hooks
        enter = cls.__enter__
        exit_ = cls.__exit__
        saved = self

        def wrapped_enter(hooks):
            inner_pack, inner_unpack = hooks.pack_hook, hooks.unpack_hook
            hooks._tapescope_pack = _WrappedPack(inner_pack, inner_unpack, saved)
            hooks.pack_hook, hooks.unpack_hook = hooks._tapescope_pack, saved._unpack_wrapped
            try:
                return enter(hooks)  # torch's own push, with our wrappers
            finally:
                hooks.pack_hook, hooks.unpack_hook = inner_pack, inner_unpack

        def wrapped_exit(hooks, *args):
            try:
                return exit_(hooks, *args)
            finally:
                wrapper = hooks.__dict__.pop("_tapescope_pack", None)
                if wrapper is not None:
                    wrapper.inner = wrapper.inner_unpack = None

        original_clear = BackwardCFunction.maybe_clear_saved_tensors

        def maybe_clear_saved_tensors(ctx):
            original_clear(ctx)
            saved.release_unpacked()

        push_saved_tensors_hooks(pack, unpack)
        try:
            # (maybe_clear_saved_tensors is a C method BackwardCFunction inherits: it shows
            # through again on exit)
            with patched(cls, __enter__=wrapped_enter, __exit__=wrapped_exit), \
                    patched(BackwardCFunction, maybe_clear_saved_tensors=maybe_clear_saved_tensors):
                yield
        finally:
            pop_saved_tensors_hooks()


_SAVE_INPUTS = checkpoint_input_saver()


def _saved_by_checkpoint_frame(caller) -> bool:
    """Whether a pack hook was called by torch.utils.checkpoint saving its own inputs from Python
    (`_CheckpointFrame.save_inputs` -> `_make_saved_tensor`; `caller` is the Python frame below
    the hook: save_inputs, or its list comprehension's frame on Python < 3.12), outside any op.
    Such a SavedVariable belongs to no autograd node: the frame keeps it (`saved_args`) until the
    frame dies, once the last node of the checkpointed region has released its saved tensors.
    The node whose sequence number is current at that moment is whatever the step recorded last
    - the previous micro-batch's last node when a pipeline stage's first block takes the
    activation it received (a leaf) - and that node may run before this region recomputes."""
    if _SAVE_INPUTS is None:
        return False
    code = caller.f_code
    if code is not _SAVE_INPUTS and code.co_name == "<listcomp>" and caller.f_back is not None:
        code = caller.f_back.f_code
    return code is _SAVE_INPUTS


def _frames_own(held: _Held) -> _Held:
    """A holder of a checkpoint frame's input: released by no node (it dies with the frame's
    SavedVariable), and not claimed by the node that unpacks it to recompute."""
    held.claimed = True
    return held


def _bare(method):
    """A plain function calling `method` (a bound method cannot carry attributes)."""
    return lambda x: method(x)


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


_INPUT = object()


def _modified_message(t: torch.Tensor, saved_version: int, output_nr: int, owner) -> str:
    """SavedVariable::unpack's message (torch/csrc/autograd/saved_variable.cpp), word for word:
    the node it names is the saving node for a saved output, the tensor's current grad_fn for a
    saved input, none for a leaf; this torch prints a node's name without its Backward suffix."""
    if owner is _INPUT:
        owner = t.grad_fn.name() if t.grad_fn is not None else None
    name = None if owner is None else re.sub(r"Backward\d*$", "", owner)
    which = "" if name is None else f", which is output {output_nr} of {name},"
    hint = (" Hint: the backtrace further above shows the operation that failed to compute its "
            "gradient. The variable in question was changed in there or anywhere later. Good luck!"
            if torch.is_anomaly_enabled() else
            " Hint: enable anomaly detection to find the operation that failed to compute its "
            "gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).")
    return ("one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} [{', '.join(str(s) for s in t.shape)}]]{which} is at "
            f"version {t._version}; expected version {saved_version} instead.{hint}")


def _probe_hook(*_):
    """Filed and removed at once by `HookRegistry.cpp_node_hooks`; never called."""


class HookRegistry:
    """Backward hooks registered while the step runs, by (node, output_nr) or node."""

    def __init__(self):
        self.tensor_hooks: dict = {}    # (node, output_nr) -> [hooks dict, ...] of non-leaf tensors
        self.retained: dict = {}        # (node, output_nr) -> weakref to the tensor to fill .grad
        self.pre_hooks: dict = {}       # node -> [fn(grad_outputs)]
        self.post_hooks: dict = {}      # node -> [fn(grad_inputs, grad_outputs)]
        self.on_cpp_nodes = False       # a hook was filed on a C++ node: read them (cpp_node_hooks)
        self._custom_node_filing = 0    # inside a custom Function node's register_(pre)hook
        self._probe: list | None = None  # the dict torch hands over while a probe is filed

    def cpp_node_hooks(self, node, pre: bool) -> list:
        """The Python hooks filed on C++ node `node` (pre-hooks, or post-hooks), read as torch
        keeps them: file a probe, note the dict torch passes to `_register_hook` (the node's
        dict, or None when it has none), remove the probe. [] unless the step filed a hook on a
        C++ node, or for a custom Function's node (filed in `pre_hooks` / `post_hooks`)."""
        if not self.on_cpp_nodes or isinstance(node, BackwardCFunction):
            return []
        self._probe = found = []
        try:
            handle = (node.register_prehook if pre else node.register_hook)(_probe_hook)
        finally:
            self._probe = None
        handle.remove()
        return [h for h in found[0].values()] if found and found[0] else []

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
            reg._custom_node_filing += 1
            try:
                return orig_node_hook(node, fn)
            finally:
                reg._custom_node_filing -= 1

        def node_prehook(node, fn):
            reg.pre_hooks.setdefault(node, []).append(fn)
            reg._custom_node_filing += 1
            try:
                return orig_node_prehook(node, fn)
            finally:
                reg._custom_node_filing -= 1

        registrar, registrar_name = node_hook_registrar()
        orig_filing = registrar.__dict__[registrar_name]

        def file_hook(hooks_dict, hook):
            if reg._probe is not None:
                reg._probe.append(hooks_dict)
            elif not reg._custom_node_filing:
                reg.on_cpp_nodes = True
            return orig_filing.__func__(hooks_dict, hook)

        orig_apply = torch.autograd.Function.__dict__["apply"]

        def apply(cls, *args, **kwargs):
            out = orig_apply.__get__(None, cls)(*args, **kwargs)
            mark_variable_inputs(cls, args, out)
            return out

        with patched(torch.Tensor, register_hook=register_hook, retain_grad=retain_grad), \
                patched(BackwardCFunction, register_hook=node_hook,
                        register_prehook=node_prehook), \
                patched(registrar, **{registrar_name: staticmethod(file_hook)}), \
                patched(torch.autograd.Function, apply=classmethod(apply)):
            yield self
