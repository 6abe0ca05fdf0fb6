"""The recorder: a FakeTensorMode that writes a Trace of every aten op it runs.

Why a FakeTensorMode subclass and not a second TorchDispatchMode stacked on top: every op would then
cross the Python dispatcher twice, which costs about 15% of the whole trace. Overriding
`__torch_dispatch__` records each op on the way out of the fake kernel at almost no cost.

What it records, and how, so that the numbers follow real execution:
- storage identity from `untyped_storage()` (views and in-place results share it), and storage death
  from a weakref on the storage object, which fires exactly when the last reference goes, as the real
  allocator's free would. The recorder holds no tensor, so it cannot delay a free or change what
  autograd decides from reference counts (AccumulateGrad steals a gradient only if nobody else holds it);
- only top-level ops: FakeTensorMode re-enters itself to run decompositions, and those inner ops are
  an artefact of fake execution, not ops the real step runs;
- the forward seq_nr from autograd's own counter and the backward node from the engine (see OpRecord);
- recomputation: an op that runs during backward, inside a node, with grad mode on is a forward op
  run again (activation checkpointing: the engine runs nodes with grad mode off, checkpoint turns
  it on to recompute). It is recorded as a forward op (its own node, module, line, the forward
  fidelity rules) with `recompute=True`.
"""

from __future__ import annotations

import os
import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import passes_user_calls, source_dirs
from ..losses import choose_default_loss, default_loss, sum_of
from ..options import check_device_build, unbuilt_device_types
from ..torch_compat import (MARKERS_RUN_AS_THEY_ARE, FakeTensor, SizeFreeCacheCheck,
                            adinplaceorview_excluded, c10d_collective_result,
                            current_autograd_node, disable_dynamo,
                            disable_torch_function, dynamo_disable_is_a_call,
                            fake_mode_handles_directly, is_wrapper_subclass, kernel_invocation,
                            node_sequence_nr, patched, sequence_nr, storage_key,
                            untyped_storage_key)
from .fidelity import BACKWARD_OP, FORWARD_OP, Alloc, FidelityContext, Free, Output, RuleSet
from .fidelity.literals import literal_ops
from .records import (BACKWARD, BUILDS_GRAPH, FORWARD, WORKSPACE, Frame, KernelLaunch, OpRecord,
                      Segment, StorageRecord, TensorRef, Trace)
from .replay import DispatchReplay
from .view_replay import ViewRegeneration, writes_first_argument

__all__ = ["Tape", "ModuleStack"]

_VALUE_ATTR = "_tapescope_value"  # the dataflow value id, kept on our own fake tensors

# Dispatcher-level queries that FakeTensor issues for itself; they are not ops of the program.
_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
_NOT_OPS = {_PRIM_DEVICE, torch.ops.prim.layout.default}
_NOT_OP_NAMESPACES = ("prim", "profiler")  # metadata queries and record_function markers
# an op whose tensor types are all among these is FakeTensorMode's (else a subclass handles it);
# a set test, not a generator over `types`: it runs for every op (classes hash by identity)
_PLAIN_TYPES = frozenset((FakeTensor, torch.Tensor))


def _device_answer(t: FakeTensor) -> torch.device:
    """`prim.device` of a fake tensor as FakeTensorMode answers it (fake_tensor.py,
    `_device_handler`): meta inside a kernel invocation, else its fake device
    (torch_compat.SHORTCUTS)."""
    return _META if t.fake_mode.in_kernel_invocation else t.fake_device


def _foreign_subclass(t: type) -> bool:
    """Whether an argument of type `t` makes FakeTensorMode decline an op: fake_tensor.py's
    `_check_for_subclass_arg`, on the type (it reads nothing else of the argument)."""
    if issubclass(t, FakeTensor) or not issubclass(t, torch.Tensor) or t is torch.Tensor:
        return False
    return not (issubclass(t, torch.nn.Parameter)
                and t.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


_DETACH = torch.ops.aten.detach.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


@dataclass(frozen=True, slots=True)
class _OpTraits:
    """What the dispatch stages ask about an op, answered once per distinct op of a tape: each
    `func in table` hashes the OpOverload in Python (~0.1 us) and `func.namespace` is a Python
    property, ~10 of them an op before; one dict lookup now."""

    not_op: bool         # a metadata query or marker (_NOT_OPS, _NOT_OP_NAMESPACES)
    c10d: bool           # a collective (distributed/)
    kernel: bool         # the capture has its own fake kernel (KERNEL rules)
    forward_rule: bool   # FORWARD_OP rules name it
    backward_rule: bool  # BACKWARD_OP rules name it
    check: bool          # CHECK rules
    output: bool         # OUTPUT rules
    workspace: bool      # WORKSPACE rules
    router: bool         # data_values.py assumes its selections (DataValues.routers)
    as_it_is: bool       # a marker FakeTensorMode runs as it is (MARKERS_RUN_AS_THEY_ARE)
    reads_data: bool     # its result is data (`.item()`): DataValues.before may answer it
    writes_first: bool   # it writes its first argument (view_replay.after_op's ops)
    values: object       # DataValues.op_kind(func) (None without data values)

    @classmethod
    def of(cls, func, rules: RuleSet, values) -> "_OpTraits":
        ns = func.namespace
        return cls(not_op=func in _NOT_OPS or ns in _NOT_OP_NAMESPACES, c10d=ns == "c10d",
                   kernel=func in rules.kernels, forward_rule=func in rules.forward_targets,
                   backward_rule=func in rules.backward_targets,
                   check=func in rules.check_targets, output=func in rules.output_targets,
                   workspace=func in rules.workspace_targets,
                   router=values is not None and func in values.routers,
                   as_it_is=func in MARKERS_RUN_AS_THEY_ARE,
                   reads_data=torch.Tag.data_dependent_output in func.tags,
                   writes_first=writes_first_argument(func),
                   values=None if values is None else values.op_kind(func))
# Frames inside these folders are never "the line that issued the op" (the folders: errors.SourceDirs).
_DIRS = source_dirs()
_TORCH_DIR = _DIRS.torch
_TORCH_OPTIM_DIR = _DIRS.torch_optim  # an optimizer's update lines are worth showing
_CAPTURE_DIR = _DIRS.capture
_OWN_FILES = _DIRS.in_package("torch_compat.py")
# Where tapescope is entered from (the API, the CLI and the commands built on them): a frame there
# is above the step, so an op whose walk reaches one was issued by tapescope's own step (a built-in
# backward, the loss's division): it has no line of the user's (a backward op then shows its
# forward op's, analysis/ops.py), never the CLI's own line or the user's call of profile().
_ENTRY_POINTS = _DIRS.in_package("api.py", "cli.py", "fit.py", "layouts.py", "sweeps.py",
                                 "checkpointing/planner.py", "validate/")
_DISTRIBUTED_DIR = _DIRS.distributed  # runs the user's parallelize
_STDLIB_HELPERS = ("contextlib.py", "functools.py")
# The default loss is part of the step tapescope writes (capture/step.py): its ops point past it,
# to the user's call, as the rest of that step's do. A named loss's own line is shown.
_STEP_LOSS_CODE = (default_loss.__code__, choose_default_loss.__code__, sum_of.__code__)
_KEEP, _SKIP, _STOP = 0, 1, 2  # what the frame walk does at a frame
# `_user_frame`'s depth, from `_record` called by `_recorded`, of the frame above
# `_torch_dispatch` (the only caller of `_dispatch`, the only caller of `_recorded`): the three
# frames below it are this file's, which the walk skips (~0.6 us an op, ~4,900 ops a GPT-2 profile)
_ABOVE_TORCH_DISPATCH = 5


def _generated_code_dir() -> str:
    """Where inductor writes the Python it generates (a compiled step's ops run from files named
    by a hash there: no line of the user's)."""
    from ..torch_compat import inductor_cache_dir

    return os.path.join(inductor_cache_dir(), "")


class ModuleStack(list):
    """The fqns of the modules whose forward is running, innermost last (capture.modules fills
    it; the tape reads it to name each op's module)."""

    @contextmanager
    def entered(self, name: str):
        self.append(name)
        try:
            yield
        finally:
            self.pop()


class _LiveStorage(weakref.ref):
    """A weakref to a storage the tape follows, whose callback records the storage's death. It
    carries the storage's key and id itself: one object a storage, where a closure with its
    defaults, cells and a list were five, each kept for the storage's life for the cyclic
    collector to walk (~1,700 storages a GPT-2 profile)."""

    __slots__ = ("key", "sid")


class HeldBytes:
    """A token for bytes the tape recorded outside any op (`Tape.bytes_outside_ops`): they are
    freed on the tape when the token goes."""

    __slots__ = ("__weakref__",)


class Tape(SizeFreeCacheCheck):
    """Fake execution that records a Trace. Use one Tape per profile; nothing is shared.

    Collaborators, given by the capture session: `rules` (the fidelity rules of the traced
    device) and `fidelity` (their per-capture context), `views` (autograd's view regeneration,
    which the backward rules and the engine also read) and `modules` (the forward module stack).
    The trace it writes is `self.trace`; nothing else writes it.
    """

    def __init__(self, *, rules: RuleSet, fidelity: FidelityContext, views: ViewRegeneration,
                 modules: ModuleStack, shape_env=None):
        super().__init__(allow_non_fake_inputs=False, shape_env=shape_env)
        self.trace = Trace(device=fidelity.device)
        self.rules, self.fidelity, self.views, self.modules = rules, fidelity, views, modules
        self._tape_recording = False
        self._tape_backward_node = None  # set by tapescope's engine; else the C++ engine's node
        self.in_pack_hook = 0  # > 0 while a saved-tensor pack hook other than ours runs in an op
        self._tape_depth = 0
        self._tape_front_unrecorded = False  # see unrecorded_through_front
        # StorageImpl address -> the weakref that records its death, with its storage id (which
        # changes when the storage is resized)
        self._tape_live: dict[int, _LiveStorage] = {}
        self._tape_on_free = self._storage_freed  # the one callback of every _LiveStorage
        self._tape_phase = FORWARD
        self._tape_step = 0
        self._tape_open = None  # (step, phase, label) of the segment being recorded
        self._tape_segment_start = (0, 0)
        self._tape_last_seq = self.trace.seq_base = sequence_nr()
        self._tape_next_value = 0
        self._tape_frames: dict = {}  # (id(code object), f_lasti) -> Frame (see _user_frame)
        # value -> the TensorRef last recorded for it: a tensor is an input to several ops after
        # the op that made it, and its ref is the same each time (see _in_ref). Keyed by the value
        # alone, an int: a (value, storage) pair was a tuple kept for the capture's life, ~7,000
        # a GPT-2 profile for the cyclic collector to walk
        self._tape_refs: dict = {}
        # shape -> the one tuple every TensorRef of that shape holds (concrete sizes only: a
        # SymInt does not hash). A step has few distinct shapes and a ref per op output: shared,
        # the ~5,000 refs of a GPT-2 profile hold ~60 tuples, not one each, which the cyclic
        # collector counted as allocations (a young collection per ~700) and a 70B trace kept
        self._tape_shapes: dict = {}
        # id(code object) -> what the frame walk does at its frames (_KEEP, _SKIP, _STOP). By id:
        # a code object's hash is computed anew each time from its bytecode, constants and names
        # (0.2-0.5 us; ~8 frames walked an op); its equality ignores the file it comes from. The
        # code objects are kept alive in `_tape_codes`, so no id is reused while the tape lives
        self._tape_internal_code: dict = {}
        self._tape_codes: list = []
        self._generated: str | None = None  # inductor's generated code, once a compiled graph ran
        self._tape_replay = DispatchReplay(self)
        # op -> _OpTraits (the rules and the data values are the capture's: fixed for its life)
        self._tape_traits: dict = {}
        self._tape_unbuilt = unbuilt_device_types()  # empty on a CUDA build: no check at all
        # which CUDA stream is current (distributed.cuda_standin.StreamLog, or None: every op on
        # the default stream)
        self.streams = None

    def hand_over(self) -> None:
        """The capture is over and its trace handed to the caller: the tape lets go of the trace
        and of what it kept to record it (refs by value, frames, shapes), leaving an empty
        trace in its place.

        Why: every fake tensor names the tape (its `fake_mode`), and some outlive the capture in
        a cycle the collector cannot see whole. FSDP2's `reset_sharded_param` keeps
        `_sharded_param_data = local_tensor.view(-1)`: the view's autograd meta holds its base's
        TensorImpl from C++ (twice: forward and backward view info), and a TensorImpl held from
        C++ keeps its Python object alive with a reference the collector cannot attribute. The
        sharded parameters' local tensors stay alive until three full collections have peeled
        the FSDP state, modules and views off them in turn (measured: 475, 278, then 2,119
        objects freed), and with them the tape. Without this the tape kept its whole trace
        (1.2M objects at 70B) alive through a search worker's next candidates, whose full
        collections walked it again (~1 s a candidate). The tape's shell and the rank's fake
        model still wait for those collections; the trace goes with the last reference the
        caller drops, by reference counting."""
        self.trace = Trace(device=self.fidelity.device)
        self._tape_refs, self._tape_shapes, self._tape_frames = {}, {}, {}
        self._tape_internal_code, self._tape_codes = {}, []

    def __deepcopy__(self, memo):
        """The tape itself: a fake tensor's `__dict__` names its mode, and `copy.deepcopy` of a
        model (an EMA made in a step's setup) copies that dict. A second mode would hold the copy
        ("Mixing fake modes NYI" at its first op with the model); the copy's storage is made by
        the tensor's own clone, recorded here as any allocation."""
        return self

    @property
    def current_phase(self) -> str:
        """The phase being recorded (forward, backward, optimizer)."""
        return self._tape_phase

    def set_backward_node(self, node) -> None:
        """The autograd node whose backward is running (None when the backward is done): the ops
        until the next call belong to it, as in the C++ engine."""
        self._tape_backward_node = node
        if node is not None:  # nodes made while recomputing are not reachable from the loss
            self.trace.node_names.setdefault(node_sequence_nr(node), node.name())

    @contextmanager
    def unrecorded(self):
        """Ops inside are run but not recorded (tapescope's own bookkeeping)."""
        was, self._tape_recording = self._tape_recording, False
        try:
            yield
        finally:
            self._tape_recording = was

    @contextmanager
    def unrecorded_through_front(self):
        """Unrecorded ops inside (the fake copy of the model: an `empty_strided` and, for a
        Parameter, a `detach` per tensor; the `detach` of a saved output, hooks.py) go through
        the replay front (replay.py) as recorded ops do, not straight to FakeTensorMode: ~15 us
        an op instead of ~100 us. Only ops the front would replay while recording (plain fake
        tensors, no constants, no fake kernel of ours, not c10d), with FakeTensorMode's result
        and bypass rules unchanged."""
        was, self._tape_front_unrecorded = self._tape_front_unrecorded, True
        try:
            yield
        finally:
            self._tape_front_unrecorded = was

    def adopt(self, t: torch.Tensor) -> None:
        """A real tensor the step made outside the dispatcher (see rng_state.py): its storage is
        alive from now (tagged with the last op, as a free is) until it dies."""
        if not self._tape_recording:
            return
        index = len(self.trace.ops) - 1
        sid, new = self._storage_of(t, index)
        if new:
            self.trace.events.append((index, sid, 1))

    def mark_saved(self, t: torch.Tensor) -> None:
        """Autograd saved `t` for backward."""
        v = getattr(t, _VALUE_ATTR, None)
        if v is not None:
            self.trace.saved_values.add(v)

    def mark_role(self, t: torch.Tensor, role: str, owner: str | None = None) -> bool:
        """Mark the storage of a tensor the tape has seen as playing `role` (gradient, optimizer
        state) for parameter `owner`; False if the tape never saw it."""
        sid = self.storage_id(t)
        if sid is None:
            return False
        self.trace.storages[sid].roles.add(role)
        if owner is not None:
            self.trace.storage_owner.setdefault(sid, owner)
        return True

    # ---- phases -----------------------------------------------------------------------------

    @contextmanager
    def phase(self, step: int, phase: str, label: str | None = None):
        """Record ops of one phase of one step as a Segment. Phases nest (a user's step: the
        optimizer stepping inside a backward hook, a forward inside the step's own code): the
        inner one ends the outer one's segment, and a new segment of the outer phase begins
        when it returns, so segments stay a flat sequence in time order."""
        outer = self._tape_open
        if outer is not None:
            self._close_segment()
        self._open_segment(step, phase, label)
        try:
            yield
        finally:
            self._close_segment()
            if outer is not None:
                self._open_segment(*outer)

    def _open_segment(self, step: int, phase: str, label: str | None) -> None:
        t = self.trace
        self._tape_step, self._tape_phase = step, phase
        self._tape_last_seq = sequence_nr()
        self._tape_open = (step, phase, label)
        self._tape_segment_start = (len(t.ops), len(t.events))
        self._tape_recording = True

    def _close_segment(self) -> None:
        t = self.trace
        step, phase, label = self._tape_open
        op0, ev0 = self._tape_segment_start
        self._tape_recording = False
        self._tape_open = None
        t.segments.append(Segment(step, phase, label or phase, range(op0, len(t.ops)),
                                  range(ev0, len(t.events))))

    @contextmanager
    def compiled_call(self, label: str):
        """Ops recorded inside are one run of a compiled graph's code (`Trace.compiled_calls`);
        yields `launched(kernel, args)`, which the generated kernels call as they are launched
        (`Trace.kernel_launches`)."""
        if self._generated is None:
            self._generated = _generated_code_dir()
        start = len(self.trace.ops)
        call = len(self.trace.compiled_calls)
        try:
            yield lambda kernel, args, stream: self._kernel_launched(call, kernel, args, stream)
        finally:
            if self._tape_recording:
                self.trace.compiled_calls.append((label, start, len(self.trace.ops)))

    def _kernel_launched(self, call: int, kernel, args, stream) -> None:
        """A generated kernel (capture.compiled's stand-in: its name, figures and the argument
        positions it stores to) launched on `args` (positional, as the wrapper passed them)."""
        if not self._tape_recording:
            return
        ids, dtype = {}, None
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                dtype = dtype or a.dtype
                entry = self._tape_live.get(untyped_storage_key(a.untyped_storage()))
                if entry is not None:  # every buffer a wrapper passes was made or given to it
                    ids[i] = entry.sid
        self.trace.kernel_launches.append(KernelLaunch(
            len(self.trace.ops), call, kernel.name, int(stream or 0), kernel.num_bytes,
            kernel.flops, dtype or torch.float32, tuple(ids.values()),
            tuple(ids[i] for i in kernel.writes if i in ids)))

    # ---- tensors ----------------------------------------------------------------------------

    def _new_value(self) -> int:
        v = self._tape_next_value
        self._tape_next_value = v + 1
        return v

    def _storage_of(self, t: torch.Tensor, created_by: int | None) -> tuple[int, bool]:
        """Storage id of t's storage, registering it (and a weakref that records its death)."""
        try:
            st = t.untyped_storage()
        except NotImplementedError:  # sparse, nested, quantized ...: no storage to follow
            raise self._layout_error(t) from None
        key = untyped_storage_key(st)
        entry = self._tape_live.get(key)
        if entry is not None:
            return entry.sid, False
        trace = self.trace
        sid = len(trace.storages)
        trace.storages.append(StorageRecord(sid, st.nbytes(), t.device, created_by))
        entry = _LiveStorage(st, self._tape_on_free)
        entry.key, entry.sid = key, sid
        self._tape_live[key] = entry
        return sid, True

    def _storage_freed(self, entry: "_LiveStorage") -> None:
        """A storage the tape follows died: its death is recorded at the last op."""
        self._tape_live.pop(entry.key, None)
        if self._tape_recording:
            trace = self.trace
            trace.events.append((len(trace.ops) - 1, entry.sid, -1))

    def _stream_now(self, device: torch.device) -> int | None:
        """The stream a block allocated now, between ops, is served on: the caching allocator
        takes the stream current at the allocation (CUDACachingAllocator.cpp, `allocate` calls
        `malloc` with getCurrentCUDAStream), whatever stream the last op ran on. None where
        there is no stream to tell: the CPU allocator has none, a profile without the CUDA
        stand-in (distributed.cuda_standin) runs every op on the default one."""
        if self.streams is None or device.type != "cuda":
            return None
        return self.streams.current.id

    def storage_resized(self, st, nbytes_before: int, caller: Frame | None = None) -> None:
        """`UntypedStorage.resize_` changed a storage's size in place (FSDP frees an unsharded
        parameter with resize_(0) and allocates it again with resize_(n)), called from the line
        `caller`. The real allocator allocates the new size, copies, and frees the old block;
        so does the trace: a new StorageRecord for the same storage object, born (and the old
        one dead) after the last op recorded, on the stream current now, `resized_by` the
        caller."""
        entry = self._tape_live.get(untyped_storage_key(st))
        nbytes = st.nbytes()
        if entry is None or nbytes == nbytes_before:
            return
        trace = self.trace
        old = entry.sid
        at = len(trace.ops) - 1
        sid = len(trace.storages)
        device = trace.storages[old].device
        # FSDP2's copy-out follows its all-gather, recorded last on the all-gather stream (or the
        # previous block's reduce-scatter): neither the last op's stream nor the last op itself
        # made it, the line that called resize_ did
        trace.storages.append(StorageRecord(sid, nbytes, device, at if at >= 0 else None,
                                            set(trace.storages[old].roles),
                                            self._stream_now(device), caller))
        entry.sid = sid
        if self._tape_recording:  # an empty storage holds no memory: no event for it
            if nbytes:
                trace.events.append((at, sid, 1))
            if nbytes_before:
                trace.events.append((at, old, -1))

    def bytes_outside_ops(self, nbytes: int, device: torch.device) -> "HeldBytes":
        """Memory the real step allocates outside any op the dispatcher sees (a Python number
        wrapped as a 0-dim tensor by the argument parser, before the op it is passed to): a
        storage born now, before the next op, on the stream current now (not the last op's),
        and dead when the returned token is released or collected."""
        trace = self.trace
        sid, at = len(trace.storages), len(trace.ops) - 1
        trace.storages.append(StorageRecord(sid, nbytes, device, at if at >= 0 else None,
                                            stream=self._stream_now(device)))
        if self._tape_recording:
            trace.events.append((at, sid, 1))
        token = HeldBytes()

        def on_free(sid=sid, trace=trace):
            if self._tape_recording:
                trace.events.append((len(trace.ops) - 1, sid, -1))

        weakref.finalize(token, on_free).atexit = False
        return token

    @contextmanager
    def recording_resizes(self):
        """Tell the tape when a storage it knows is resized in place (`storage_resized`).

        `UntypedStorage.resize_` changes a storage without dispatching an op, so a dispatch mode
        never sees it; FSDP2 frees and re-allocates unsharded parameters that way. The method is
        wrapped on the class while the block runs (storages the tape does not know are resized
        as before), and restored after.
        """
        original = torch.UntypedStorage.resize_

        def resize_(st, size):
            before = st.nbytes()
            out = original(st, size)
            caller = sys._getframe(1)  # resizes are few (two per FSDP2 group and step)
            code = caller.f_code
            self.storage_resized(st, before, Frame(code.co_filename, caller.f_lineno,
                                                   code.co_name))
            return out

        with patched(torch.UntypedStorage, resize_=resize_):
            yield

    def register(self, t: torch.Tensor, name: str, role: str | None = None,
                 owner: str | None = None) -> int:
        """Name a tensor that exists before the step (parameter, buffer, input, state).

        Returns its storage id; the storage is marked with `role` for the memory categories and
        `owner` (a parameter's fqn) for the reports. A tensor subclass that wraps others (a
        DTensor and its local shard) is registered by the tensors it wraps, which hold its memory.
        """
        inner = _wrapped(t)
        if inner is not None:
            sids = [self.register(x, name, role, owner) for x in inner]
            return sids[0] if sids else -1
        sid, _ = self._storage_of(t, None)
        v = getattr(t, _VALUE_ATTR, None)
        if v is None:
            v = self._new_value()
            setattr(t, _VALUE_ATTR, v)
        self.trace.external_values.setdefault(v, name)
        if role is not None:
            self.trace.storages[sid].roles.add(role)
        if owner is not None:
            self.trace.storage_owner.setdefault(sid, owner)
        return sid

    def storage_id(self, t: torch.Tensor) -> int | None:
        """Storage id of a tensor the tape has seen, else None (for a tensor subclass that wraps
        others, the first wrapped tensor's)."""
        inner = _wrapped(t)
        if inner is not None:
            return self.storage_id(inner[0]) if inner else None
        entry = self._tape_live.get(storage_key(t))
        return None if entry is None else entry.sid

    def _in_ref(self, t: torch.Tensor) -> TensorRef:
        if not isinstance(t, FakeTensor):
            # A real tensor entering the fake program: `torch.tensor(0.)` builds one outside the
            # dispatcher and lifts it (aten.lift_fresh). The real run allocates only the lifted
            # result, so this one is not device memory: storage -1.
            return TensorRef(tuple(t.shape), t.dtype, -1, self._new_value())
        # _storage_of's lookup, inline: an op's inputs are almost always storages already known
        try:
            entry = self._tape_live.get(untyped_storage_key(t.untyped_storage()))
        except NotImplementedError:  # sparse, nested, quantized ...: no storage to follow
            raise self._layout_error(t) from None
        sid = entry.sid if entry is not None else self._storage_of(t, None)[0]
        v = getattr(t, _VALUE_ATTR, None)
        if v is None:  # a tensor made before recording began and never registered
            v = self._new_value()
            setattr(t, _VALUE_ATTR, v)
            self.trace.external_values[v] = "tensor"
        # The ref last recorded for this value, where the tensor is still in that storage with
        # that shape and dtype (`param.data = x` changes them without an op). Symbolic sizes are
        # compared never: comparing SymInts would add guards.
        refs = self._tape_refs
        if self.shape_env is not None:
            ref = refs[v] = TensorRef(tuple(t.shape), t.dtype, sid, v)
            return ref
        ref = refs.get(v)
        size = t.size()  # (the method: the `shape` property's Python-level get costs more)
        if ref is not None and ref.storage == sid and ref.dtype is t.dtype and ref.shape == size:
            return ref
        ref = refs[v] = TensorRef(self._shape(size), t.dtype, sid, v)
        return ref

    def _shape(self, size) -> tuple:
        """The tape's one tuple equal to `size` (a torch.Size of ints: it hashes and compares
        as the tuple does)."""
        shape = self._tape_shapes.get(size)
        if shape is None:
            shape = tuple(size)
            self._tape_shapes[shape] = shape
        return shape

    def _out_ref(self, t: torch.Tensor, index: int) -> TensorRef:
        sid, new = self._storage_of(t, index)
        if new:
            self.trace.events.append((index, sid, 1))
        v = self._tape_next_value
        self._tape_next_value = v + 1
        setattr(t, _VALUE_ATTR, v)
        shape = tuple(t.shape) if self.shape_env is not None else self._shape(t.size())
        ref = self._tape_refs[v] = TensorRef(shape, t.dtype, sid, v)
        return ref

    def value_of(self, t: torch.Tensor) -> int | None:
        return getattr(t, _VALUE_ATTR, None)

    # ---- where an op comes from -------------------------------------------------------------

    def user_frame(self) -> Frame | None:
        """The innermost frame of the user's code (not torch's, not tapescope's capture)."""
        return self._user_frame(2)

    def _user_frame(self, depth: int = 2) -> Frame | None:
        f = sys._getframe(depth)
        frames, internal = self._tape_frames, self._tape_internal_code
        while f is not None:
            code = f.f_code
            what = internal.get(id(code))
            if what is None:
                self._tape_codes.append(code)
                fn = code.co_filename
                what = internal[id(code)] = _STOP if fn.startswith(_ENTRY_POINTS) else _SKIP if (
                    (fn.startswith(_TORCH_DIR) and not fn.startswith(_TORCH_OPTIM_DIR))
                    or fn.startswith(_CAPTURE_DIR) or fn in _OWN_FILES
                    or fn.startswith(_DISTRIBUTED_DIR)
                    or fn.endswith(_STDLIB_HELPERS) or code in _STEP_LOSS_CODE
                    or (self._generated is not None and fn.startswith(self._generated))) \
                    else _KEEP
            if what == _SKIP:  # most frames walked (torch's, the capture's): tested first
                f = f.f_back
                continue
            if what == _STOP:
                return None
            # keyed by the instruction, not the line: `f_lineno` decodes the code's line table
            # from its start on each read (~1.5 us at line 400 of a function; an optimizer's
            # update and a model's forward are long), where `f_lasti` is read as it is. The
            # code object is kept alive (`_tape_codes`), so its id names it while the tape lives
            key = (id(code), f.f_lasti)
            frame = frames.get(key)
            if frame is None:
                frame = frames[key] = Frame(code.co_filename, f.f_lineno, code.co_name)
            return frame
        return None

    # ---- dispatch ---------------------------------------------------------------------------

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._disable_dynamo (~0.4 us an op, two more
        # frames under every op's source-line walk) to do nothing unless a compiled region runs
        # or a compiler stance says so: __torch_dispatch__ takes that wrapper itself, only then
        return False

    @passes_user_calls
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and not self._tape_unbuilt and len(args) == 1 \
                and type(args[0]) is FakeTensor:
            # `t.device` asked from C++ (~2,300 times a GPT-2 profile): FakeTensorMode's own answer
            # (fake_tensor.py, _device_handler), without the ~3 us of its dispatch; never recorded,
            # no side effect, so answered before the question of torch's dynamo wrapper
            return _device_answer(args[0])
        if dynamo_disable_is_a_call():
            return self._torch_dispatch(func, types, args, kwargs)
        return _TORCH_DISPATCH_DYNAMO_DISABLED(self, func, types, args, kwargs)

    @passes_user_calls
    def _torch_dispatch(self, func, types, args, kwargs):
        # Below the dispatcher no torch function mode sees anything in a real step: the calls
        # FakeTensorMode's kernels and our recording make (tensor attributes, strides, storages:
        # ~25,000 per GPT-2 profile) would otherwise each pass through the capture's
        # FunctionRulesMode, which is for the user's calls (10-14% of a profile's time).
        with disable_torch_function():
            return self._dispatch(func, types, args, {} if kwargs is None else kwargs)

    @passes_user_calls
    def _dispatch(self, func, types, args, kwargs):
        """One op, in named stages: declined (not an op of the program: run unrecorded), a
        TensorImpl copy (autograd's, not the program's), view regeneration, the fidelity rules'
        rewrite, values an assumption decides, the kernel (checked, run, its output layout), and
        what is recorded of it."""
        if self._tape_unbuilt:
            self._refuse_unbuilt_devices(func, args, kwargs)
        traits = self._tape_traits.get(func) or self._traits(func)
        if (self._tape_depth or not self._tape_recording or traits.not_op
                or not _PLAIN_TYPES.issuperset(types)):
            return self._declined(func, types, args, kwargs, traits)
        # (inline: _issued_by_another_mode counts the frames above this one)
        if func is _DETACH and (self.in_pack_hook or not adinplaceorview_excluded()
                                or self._issued_by_another_mode()):
            return self._impl_copy(func, types, args, kwargs)
        # a recomputed op is a forward op: the forward rules and view tracking apply
        backward = self._tape_phase == BACKWARD and not self._recomputing()
        if not backward and self.views.busy:
            out = self.views.intercept(lambda: self._run_quietly(func, types, args, kwargs),
                                       self._record, func, args, kwargs)
            if out is not None:
                return out
        rewritten, args, kwargs = self._rewritten(func, args, kwargs, backward, traits)
        if rewritten is not func:
            func, traits = rewritten, self._tape_traits.get(rewritten) or self._traits(rewritten)
        values = self.fidelity.values  # data-dependent sizes: values an assumption gives
        if traits.reads_data and values is not None and values.live:
            try:
                done, result = values.before(func, args, kwargs, traits.values)
            except Exception as e:
                self._annotate(e, func)
                raise
            if done:  # an `.item()` of a tensor whose values the assumption decided
                self._record(func, args, kwargs, result)
                return result
        out = self._kernel(func, types, args, kwargs, traits)
        self._recorded(func, args, kwargs, out, backward, traits)
        return out

    def _traits(self, func) -> _OpTraits:
        traits = self._tape_traits[func] = _OpTraits.of(func, self.rules, self.fidelity.values)
        return traits

    def _declined(self, func, types, args, kwargs, traits: _OpTraits):
        """An op that is not the program's (inside another op, outside recording, not an op),
        or one with a tensor subclass among its arguments (a DTensor, say: FakeTensorMode
        declines, the subclass runs the op on the tensors it wraps, and those come back here).
        Run unrecorded; through the replay front where it can answer."""
        if (self._tape_front_unrecorded and not self._tape_depth and not self._tape_recording
                and not (traits.not_op or traits.c10d or traits.kernel)
                and _PLAIN_TYPES.issuperset(types)
                and not (args and type(args[0]) is FakeTensor and args[0].constant is not None)):
            return self._front(func, types, args, kwargs)
        if traits.as_it_is:
            # FakeTensorMode's own answer for the record_function markers around an optimizer's
            # step, without its dispatch (~50-300 us each, ~6 a profile): the op itself, run
            # inside a kernel invocation
            with kernel_invocation(self):
                return func(*args, **kwargs)
        if not traits.kernel and any(map(_foreign_subclass, types)) \
                and not fake_mode_handles_directly(func):
            # FakeTensorMode's own answer for an argument of another tensor subclass (a DTensor:
            # every op of a parallelised step comes here first), without the ~30 us it spends
            # reaching it (a cache key attempted and refused, the arguments flattened):
            # `_dispatch_impl` returns NotImplemented for any argument `_check_for_subclass_arg`
            # names, and `types` holds the argument types the dispatcher found overloaded
            return NotImplemented
        if self._tape_depth and self.shape_env is not None and self.cache_enabled:
            return self._uncached(func, types, args, kwargs, traits)
        return self._fake_dispatch(func, types, args, kwargs, traits)

    def _uncached(self, func, types, args, kwargs, traits: _OpTraits):
        """An op run inside another (a decomposition's, a fake kernel's), under a ShapeEnv: not
        through FakeTensorMode's cache. That cache then lives on this capture's ShapeEnv alone,
        and the replay front answers the repeated outer ops, so an inner op's entry is rarely
        met again (llama: ~200 hits), while making it (the key, the check) on symbolic sizes
        costs more than running the op (0.03-0.05 s of a 0.7 s llama profile). The outer op is
        cached as before; its entry, and the refusals the front reads (`DispatchReplay.bypasses`),
        are FakeTensorMode's for that op alone, which decide whether FakeTensorMode caches it."""
        self.cache_enabled = False
        try:
            return self._fake_dispatch(func, types, args, kwargs, traits)
        finally:
            self.cache_enabled = True

    def _impl_copy(self, func, types, args, kwargs):
        """A `detach` that is not an op of the program: C++ autograd copied a TensorImpl (saving
        or unpacking a tensor), which for a Python tensor subclass goes through `detach`. A
        genuine detach comes from the autograd kernel, below which ADInplaceOrView is excluded.
        A detach made while another op runs is not an op of its own either (the profiler shows
        it inside that op): a pack hook's (checkpoint's recomputation saves `x.detach()`, inside
        the autograd kernel of the op that saves), or one a dispatch mode above ours makes while
        it handles an op (selective checkpointing detaches what it caches)."""
        self._tape_depth += 1
        try:
            out = self._run(func, types, args, kwargs)  # through the replay front: it is fast
        finally:
            self._tape_depth -= 1
        v = getattr(args[0], _VALUE_ATTR, None)
        if v is not None:
            setattr(out, _VALUE_ATTR, v)
        if self.fidelity.values is not None:
            self.fidelity.values.alias(args[0], out)  # a saved tensor keeps its values
        return out

    def _rewritten(self, func, args, kwargs, backward: bool, traits: _OpTraits):
        """(func, args, kwargs) as the device's FORWARD_OP / BACKWARD_OP rules rewrite them."""
        ctx, rules = self.fidelity, self.rules
        # the rules' tables are consulted before calling them: this runs for every op of the step
        if backward:
            ctx.node = self._backward_node()
            try:
                if rules.rewrites_any_backward or traits.backward_rule:
                    return rules.rewrite(BACKWARD_OP, ctx, func, args, kwargs)
            finally:
                # only the rules read it, while they run. Kept, it held the backward's last node,
                # an AccumulateGrad, which holds its parameter from C++, whose fake tensor holds
                # this tape: a cycle the collector cannot see, which kept every profile's trace
                # alive after the profile
                ctx.node = None
        elif rules.rewrites_any_forward or traits.forward_rule:
            return rules.rewrite(FORWARD_OP, ctx, func, args, kwargs)
        return func, args, kwargs

    def _kernel(self, func, types, args, kwargs, traits: _OpTraits):
        """The op's output: what the real kernel refuses refused (CHECK rules), the fake kernel
        run, and its output laid out as the real kernel lays it (OUTPUT rules). An error names
        the op."""
        ctx, rules = self.fidelity, self.rules
        self._tape_depth += 1
        try:
            if traits.check:
                rules.check(ctx, func, args, kwargs)
            out = self._run(func, types, args, kwargs, traits)
            if traits.output:
                out = rules.output(ctx, func, args, out)
        except Exception as e:
            self._annotate(e, func)
            raise
        finally:
            self._tape_depth -= 1
        return out

    def _recorded(self, func, args, kwargs, out, backward: bool, traits: _OpTraits) -> None:
        """What the trace keeps of an op that ran: a tensor literal, or the op with its
        storages, the values it decides (data_values.py), its kernel workspace (WORKSPACE
        rules) and the views it makes (view_replay.py)."""
        values = self.fidelity.values
        if func is _LIFT_FRESH and not isinstance(args[0], FakeTensor):
            self._record_tensor_literal(args[0], out)
            if values is not None:
                values.give_literal(out, args[0])
            return
        first_event = len(self.trace.events)
        self._record(func, args, kwargs, out, _ABOVE_TORCH_DISPATCH)
        if values is not None and (values.live or traits.router):
            try:
                values.after(func, args, kwargs, out, self._op_frame, traits.values)
            except Exception as e:
                self._annotate(e, func)
                raise
        if traits.workspace:
            self._tape_depth += 1  # a rule reads metadata; what it ran is not the program's
            self.fidelity.where = self._op_frame  # the source line a rule's assumption names
            try:
                workspace = self.rules.workspace(self.fidelity, func, args, kwargs, out)
            finally:
                self._tape_depth -= 1
            if workspace:
                self._record_workspace(workspace, _device_of(args, out), first_event)
        if not backward and args and traits.writes_first:
            self.views.after_op(func, args)

    def _issued_by_another_mode(self, depth: int = 6) -> bool:
        """Is a TorchDispatchMode other than this one handling an op further up the Python stack
        (so that the op now dispatched is one it issued, inside the op it handles)? `depth`
        frames above this op's own __torch_dispatch__ are looked at."""
        f = sys._getframe(2)  # _dispatch's caller, below this op's own __torch_dispatch__
        while f is not None and f.f_code is not _TORCH_DISPATCH_CODE:
            f = f.f_back  # (torch's dynamo wrapper between them on the compiled path)
        f = f.f_back if f is not None else None
        for _ in range(depth):
            if f is None:
                return False
            if f.f_code.co_name == "__torch_dispatch__":
                mode = f.f_locals.get("self")
                return mode is not self and mode is not None
            f = f.f_back
        return False

    def _recomputing(self) -> bool:
        """During backward: is a node running with grad mode on (checkpoint recomputing)?"""
        return torch.is_grad_enabled() and self._backward_node() is not None

    def _where(self) -> str:
        module = self.modules[-1] if self.modules else None
        frame = self._user_frame(3)
        if self._tape_phase == BACKWARD:
            node = self._backward_node()
            return "" if node is None else f"in the backward of {node.name()}"
        return " ".join(filter(None, (
            None if module is None else f"in module '{module or '(root)'}'",
            None if frame is None else f"at {frame}")))

    def _layout_error(self, t: torch.Tensor) -> Exception:
        from ..errors import UnsupportedOpError

        what = "sparse" if t.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
                                        torch.sparse_bsr, torch.sparse_bsc) else str(t.layout)
        return UnsupportedOpError(
            f"the step makes a {what} tensor ({t.layout}, {self._tape_phase}) {self._where()}; "
            "tapescope follows memory through dense (strided) tensors only. Fix: profile the "
            "dense equivalent (for nn.Embedding(..., sparse=True), sparse=False: the same "
            "forward, a dense gradient).")

    def _refuse_unbuilt_devices(self, func, args, kwargs) -> None:
        """A fake tensor of a device this torch build lacks (CUDA on a CPU-only build) aborts the
        process once autograd records an op on it; refuse the op that would make or use one."""
        devices = [kwargs.get("device")] + [a.device for a in args if isinstance(a, torch.Tensor)]
        for d in devices:
            if d is not None and torch.device(d).type in self._tape_unbuilt:
                check_device_build(torch.device(d), f"{func} {self._where()} makes a tensor on "
                                                    f"{d}: it")

    def _record_workspace(self, steps, device, first_event: int) -> None:
        """Scratch the real kernel of the op just recorded allocates and frees inside it (the
        WORKSPACE steps of fidelity/registry.py), in the kernel's order relative to the op's
        outputs, whose allocations `_record` appended from event `first_event` on. Everything is
        freed before the next op."""
        trace = self.trace
        index = len(trace.ops) - 1
        outputs = trace.ops[index].outputs
        appended = trace.events[first_event:]
        del trace.events[first_event:]
        placed = {outputs[s.index].storage for s in steps
                  if type(s) is Output and s.index < len(outputs) and outputs[s.index] is not None}
        events = [e for e in appended if e[1] not in placed]
        live: dict = {}
        for step in steps:
            kind = type(step)
            if kind is Alloc:
                sid = len(trace.storages)
                trace.storages.append(StorageRecord(sid, step.nbytes, device, index, {WORKSPACE}))
                events.append((index, sid, 1))
                live[step.name] = sid
            elif kind is Free:
                events.append((index, live.pop(step.name), -1))
            else:  # Output: its allocation, if this op made that storage
                ref = outputs[step.index] if step.index < len(outputs) else None
                events.extend(e for e in appended if ref is not None and e[1] == ref.storage)
        events.extend((index, sid, -1) for sid in reversed(live.values()))
        trace.events.extend(events)

    def _fake_dispatch(self, func, types, args, kwargs, traits: _OpTraits | None = None):
        if traits is not None and not traits.kernel:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kernel = self.rules.kernels.get(func)
        if kernel is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # the capture's own fake kernel (fidelity/fake_kernels.py), run the way FakeTensorMode
        # runs a custom op's registered fake kernel: under the mode, so it makes fake tensors
        with self:
            return kernel(self.fidelity, *args, **kwargs)

    @passes_user_calls
    def _run_quietly(self, func, types, args, kwargs):
        self._tape_depth += 1
        try:
            return self._run(func, types, args, kwargs)
        finally:
            self._tape_depth -= 1

    def _record_tensor_literal(self, real, out) -> None:
        """`torch.tensor(data)` builds a real tensor outside the dispatcher and lifts it into fake
        mode. A real run dispatches empty -> lift_fresh -> detach_ for it, fewer for as_tensor
        and a scalar assigned into a tensor (LITERAL_OPS); record those."""
        names = literal_ops(self.fidelity)
        if "empty" in names:
            self._record(torch.ops.aten.empty.memory_format, (list(real.shape),),
                         {"dtype": real.dtype, "device": out.device, "pin_memory": False}, out)
        else:
            # `x[i] = 3`: C++ makes the scalar's tensor without a dispatched op (scalar_to_tensor)
            # and the real run allocates it there, just before it is lifted. Registered here it is
            # the lift's own, allocated at the lift; left to `_in_ref` it would be a storage no op
            # made, alive from the step's start, and each micro-batch of an accumulated step would
            # free one that none of them allocated (no repeat proven: capture/session.py)
            index = len(self.trace.ops)
            sid, new = self._storage_of(out, index)
            if new:
                self.trace.events.append((index, sid, 1))
        self._record(_LIFT_FRESH, (out,), {}, out)
        if "detach_" in names:
            self._record(torch.ops.aten.detach_.default, (out,), {}, out)

    @passes_user_calls
    def _run(self, func, types, args, kwargs, traits: _OpTraits | None = None):
        if traits is None:
            traits = self._tape_traits.get(func) or self._traits(func)
        if traits.c10d:
            out = c10d_collective_result(func, args)
            if out is not None:
                return out
        if func is _LIFT_FRESH and self._tape_replay.enabled:
            out = self._tape_replay.literal(args[0])
            if out is not None:
                return out
        if args and type(args[0]) is FakeTensor and args[0].constant is not None:
            done, out = self._tape_replay.constant_op(func, args, kwargs)
            if done:
                return out
        if traits.kernel:
            return self._fake_dispatch(func, types, args, kwargs)  # not FakeTensorMode's cache
        return self._front(func, types, args, kwargs)

    @passes_user_calls
    def _front(self, func, types, args, kwargs):
        """FakeTensorMode's result, from the replay front when it has the op (replay.py)."""
        replay = self._tape_replay
        key, entry = replay.find(func, args, kwargs)
        if key is not None:
            if entry is not None:
                try:
                    return replay.replay(entry, args, func, kwargs)
                except LookupError:
                    pass
            bypassed = replay.bypasses(func)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if key is not None and replay.bypasses(func) == bypassed:
            replay.learn(key, func, args, out)
        return out

    def _annotate(self, e: Exception, func) -> None:
        """Remember where an error happened, for a message that names the op, module and line."""
        if getattr(e, "tapescope_op", None) is None:
            try:
                e.tapescope_op = func
                e.tapescope_module = self.modules[-1] if self.modules else None
                e.tapescope_frame = self._user_frame()
                e.tapescope_phase = self._tape_phase
            except AttributeError:  # exception types that refuse attributes
                pass

    def _record(self, func, args, kwargs, out, depth: int = 2) -> None:
        """Append the op's OpRecord (its storages' allocations to the events). `depth`: where the
        walk for the op's source line starts (`_user_frame`), 2 = the caller of this method."""
        trace = self.trace
        index = len(trace.ops)
        tensors: list = []
        rec_args = []  # _convert, with its commonest case (a tensor) inline
        direct = 0  # arguments that are tensors themselves
        for a in args:
            if isinstance(a, torch.Tensor):
                a = self._in_ref(a)
                tensors.append(a)
                direct += 1
            elif type(a) in (list, tuple) and a:
                a = self._convert(a, tensors)
            rec_args.append(a)
        rec_args = tuple(rec_args)
        # (no keyword arguments: the op's own empty dict, which nothing else keeps, rather than a
        # second one kept for the capture's life: the collector counts each as an allocation)
        rec_kwargs = {k: self._convert(v, tensors) for k, v in kwargs.items()} if kwargs \
            else kwargs if type(kwargs) is dict else {}
        # an op whose arguments are all tensors (most) has them as its inputs: one tuple for both,
        # not two, each kept for the capture's life for the cyclic collector to walk
        inputs = rec_args if direct == len(rec_args) == len(tensors) else tuple(tensors)

        if isinstance(out, torch.Tensor):
            outputs = (self._out_ref(out, index),)
        elif isinstance(out, (tuple, list)):
            outputs = tuple(self._out_ref(o, index) if isinstance(o, torch.Tensor) else None for o in out)
        else:
            outputs = ()
        if not outputs:  # ops that return nothing (foreach, fused optimizers) write their arguments
            outputs = tuple(self._out_ref(t, index) for t in _written_tensors(func, args, kwargs))

        rec = OpRecord(index, func, self._tape_phase, self._tape_step, rec_args, rec_kwargs, outputs,
                       inputs)
        if self._tape_phase == BACKWARD and self._recomputing():
            rec.recompute = True
        if self.streams is not None:
            rec.stream = self.streams.current.id
            rec.waits = self.streams.issued(rec.stream, index)
        if self._tape_phase in BUILDS_GRAPH or rec.recompute:
            peek = sequence_nr()
            rec.seq_nr = peek - 1
            rec.owns_node = peek != self._tape_last_seq
            self._tape_last_seq = peek
            rec.module = self.modules[-1] if self.modules else None
            rec.frame = self._user_frame(depth)
        elif self._tape_phase == BACKWARD:
            node = self._backward_node()
            if node is not None:
                rec.seq_nr = node_sequence_nr(node)
                rec.grad_fn = node.name()
        else:
            rec.frame = self._user_frame(depth)
        trace.ops.append(rec)

    def _op_frame(self) -> Frame | None:
        """The user's source line of the op just recorded (a backward op: the stack's)."""
        return self.trace.ops[-1].frame or self._user_frame(3)

    def _backward_node(self):
        """The autograd node whose backward is running (our engine's, or the C++ engine's)."""
        return self._tape_backward_node or current_autograd_node()

    def _convert(self, a, tensors: list):
        if isinstance(a, torch.Tensor):
            r = self._in_ref(a)
            tensors.append(r)
            return r
        if type(a) in (list, tuple) and a:
            if any(isinstance(x, torch.Tensor) for x in a):
                out = []
                for x in a:
                    if isinstance(x, torch.Tensor):
                        x = self._in_ref(x)
                        tensors.append(x)
                    out.append(x)
                return tuple(out)
            if type(a[0]) in (list, tuple):  # a list of tensor lists (c10d's scatter_, say):
                return tuple(self._convert(x, tensors) for x in a)  # the trace keeps no tensor
        return a


# torch's wrapper, taken where it does more than call (Tape._should_skip_dynamo)
_TORCH_DISPATCH_DYNAMO_DISABLED = disable_dynamo(Tape._torch_dispatch, recursive=True)
_TORCH_DISPATCH_CODE = Tape.__torch_dispatch__.__code__


def _wrapped(t: torch.Tensor) -> list | None:
    """The tensors a wrapper subclass (DTensor, ...) holds, per __tensor_flatten__; None for a
    tensor that holds its own memory (plain or fake)."""
    if type(t) in (torch.Tensor, FakeTensor, torch.nn.Parameter) or not is_wrapper_subclass(t):
        return None
    names, _ = t.__tensor_flatten__()
    return [x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)]


def _device_of(args, out) -> torch.device:
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor):
            return t.device
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _written_tensors(func, args, kwargs):
    """Tensors an op mutates, from its schema's write annotations (`Tensor(a!)[] self`)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        a = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))
