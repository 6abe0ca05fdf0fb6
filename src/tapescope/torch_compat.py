r"""Every private PyTorch name tapescope uses, in one place.

tapescope follows PyTorch's internals closely (that is how it traces a step the way the real engine
runs it), so it reads names PyTorch does not promise to keep: FakeTensorMode's innards, autograd's
sequence numbers and reference counts, the dispatcher's tables, ShapeEnv's guards. Every one of them
is imported or called here and nowhere else, so that a torch release that moves one breaks one line
with a clear message, and `tests/test_torch_compat.py` (run by CI on both torch versions it installs)
says which.

A private name is used outside this file only through what it exports: a re-exported name, a
small function, or, for an attribute another module patches and restores (capture/graph_task.py,
distributed/cuda_standin.py, distributed/fidelity.py, capture/compiled.py), a function that
returns (module, name). tests/test_layers.py fails on any other module that imports a private
torch module or name, or spells one (`torch.cuda._lazy_init`). The one registry that names
patched torch attributes by string, capture/fidelity/libraries.py's LIBRARY_BRANCHES (a branch
a library takes on a FakeTensor, answered as in the eager step), has its torch entries in
PRIVATE_NAMES below, so that a torch which moves one fails here rather than silently.

Names that are public API (torch.library, torch.profiler, torch.utils.checkpoint ...) are used
directly where they are needed. `Tensor._base`, `Tensor._is_view()` and `OpOverload._schema` are
documented in PyTorch's own developer docs and used everywhere in torch; they are not wrapped.
What `git grep -n "torch\._" src/ | grep -v torch_compat.py` still lists is public by convention:
- `torch._check(cond, msg)`: the documented way a meta kernel or a custom op's fake kernel checks
  its inputs (PyTorch's torch.library and dynamic-shapes docs; capture/fidelity/fake_kernels.py
  writes a fake `torch._grouped_mm` with it, as torch's own meta registrations do);
- `torch.__version__`, `torch.__file__`: module dunders (a report's version, the installed folder);
- mentions in comments and docstrings (`torch._C._dispatch_dump_table`, `torch._C._SDPBackend`,
  `torch._grouped_mm`, ...): citations of the code a rule follows, not uses.
"""

from __future__ import annotations

import operator
import sys
from contextlib import contextmanager as _contextmanager
from dataclasses import replace as _dc_replace

import torch

# ---- FakeTensorMode (torch/_subclasses/fake_tensor.py) ------------------------------------------
from torch._subclasses.fake_tensor import (  # noqa: F401 - re-exported
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    UnsupportedOperatorException,
    in_kernel_invocation_manager,
    unset_fake_temporarily,
)
from torch._subclasses.fake_tensor import _DISPATCH_HANDLE_DIRECTLY as _FAKE_HANDLE_DIRECTLY
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS as _FAKE_META_HANDLERS

# ---- symbolic shapes (torch/fx/experimental/symbolic_shapes.py, torch/_guards.py) ----------------
from torch.fx.experimental.symbolic_shapes import (  # noqa: F401 - re-exported
    DimDynamic,
    ShapeEnv,
    free_unbacked_symbols,
    statically_known_true,
)

try:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
except ImportError:  # pragma: no cover - older torch
    GuardOnDataDependentSymNode = ()

# ---- pytrees, dispatch-mode utilities -------------------------------------------------------------
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map  # noqa: F401 - re-exported
from torch.utils._pytree import SUPPORTED_NODES as pytree_node_types  # type -> its flattening
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - re-exported
from torch.utils._mode_utils import no_dispatch  # noqa: F401

__all__ = [
    "FakeTensor", "FakeTensorMode", "in_kernel_invocation_manager", "kernel_invocation",
    "DataDependentOutputException",
    "DynamicOutputShapeException", "UnsupportedOperatorException", "GuardOnDataDependentSymNode",
    "ShapeEnv", "DimDynamic", "statically_known_true", "tree_leaves", "tree_map",
    "tree_flatten", "pytree_node_types", "free_unbacked_symbols", "unset_fake_temporarily",
    "disable_current_modes", "no_dispatch", "disable_torch_dispatch",
    "sympy_size_functions", "sequence_nr", "node_sequence_nr", "current_autograd_node", "use_count", "storage_use_count",
    "storage_key", "untyped_storage_key", "is_zerotensor", "node_input_metadata", "tensor_backward_hooks",
    "post_accumulate_grad_hooks", "inductor_cache_dir", "push_saved_tensors_hooks",
    "pop_saved_tensors_hooks",
    "mark_internal_saved_tensors_hooks", "checkpoint_input_saver", "set_graph_task_id",
    "forward_ad_level",
    "adinplaceorview_excluded", "default_device",
    "foreach_devices", "fake_cache_bypasses", "has_composite_implicit_kernel",
    "fake_mode_handles_directly", "MARKERS_RUN_AS_THEY_ARE",
    "functional_collective_ops", "FakeTensorFactory", "SizeFreeCacheCheck",
    "constant_source", "user_source_location", "hook_guard_locations",
    "dispatch_dump_table", "profiler_event_types", "sdp_priority_order", "sdp_backend_enum",
    "overrideable_sdp_enabled", "fa3_sdp_enabled", "linear_builtin", "sdpa_builtin",
    "profiler_event_tree", "profiler_running", "cpu_allocator_counts_every_thread", "schema_types", "shape_env_facts",
    "suggest_memory_format",
    "select_conv_backend", "elementwise_output_strides", "pointwise_meta_decompositions",
    "PRIVATE_NAMES", "TRITON_NAMES",
    "function_modes_suspended", "saved_tensor_hooks_suspended", "graph_task_keep_graph_query",
    "is_wrapper_subclass", "local_shard_shape", "process_group_ranks", "unset_fake_mode",
    "fake_mode_unset",
    "active_fake_mode", "c10d_collective_result", "clear_dtensor_caches", "StridedShard",
    "device_constructors", "OpOverload", "inductor_async_compile", "inductor_mode_options",
    "inductor_compilers", "aot_autograd", "compile_configs", "dynamo_callback_handler",
    "inductor_constant_folders", "dynamo_device_interface", "inductor_utils", "inductor_pad_mm",
    "matmul_allows_tf32", "dynamo_skip_frame", "DEVICE_CACHING_MODULES",
    "SETUP_ONCE_CACHES", "INDUCTOR_KERNEL_COMPILERS",
    "graph_task_queries", "accelerator_query", "fake_store", "replicate_with_fsdp",
    "checkpoint_wrapper_api", "TRACING_CHECK_MODULES", "dtensor_tracing_checks",
    "dtensor_meta_propagation", "sharding_decisions", "strided_shard_flag_propagation",
    "mesh_strategy_expansion",
    "foreach_strategy_expansion",
    "mesh_rank_tensor_methods", "MESH_RANK_MAP", "Patched", "PATCHED", "patched", "Shortcut",
    "SHORTCUTS", "engine_grad_mode",
    "dynamo_disable_is_a_call", "disable_dynamo",
]


# ---- autograd ------------------------------------------------------------------------------------

def sympy_size_functions() -> tuple:
    """(rounding functions, PowByNatural): the sympy functions ShapeEnv writes sizes with that
    are no polynomial (FloorDiv, CeilDiv's FloorDiv, Mod, PythonMod, Max, Min) and its natural
    power (analysis/symbolic.py makes the former variables, the latter a power)."""
    from torch.utils._sympy import functions as f

    return (f.FloorDiv, f.Mod, f.PythonMod, f.Max, f.Min), f.PowByNatural


# The accessors the capture calls for every op are torch's own callables or C-level getters
# (operator.attrgetter / methodcaller), not Python functions around them: a Python frame is ~0.1 us,
# and a GPT-2 profile asks ~25,000 of these.

# sequence_nr(): the sequence number the next autograd node will get (this thread's counter)
sequence_nr = torch.autograd._get_sequence_nr
node_sequence_nr = operator.methodcaller("_sequence_nr")  # (node) -> its sequence number
# current_autograd_node(): the node the C++ engine is running on this thread, or None
current_autograd_node = torch._C._current_autograd_node
# node_input_metadata(node): what a node expects of each gradient it receives (shape, dtype, device)
node_input_metadata = operator.attrgetter("_input_metadata")
# use_count(t): the TensorImpl's reference count (its Python object holds one)
use_count = operator.methodcaller("_use_count")


def storage_use_count(t: torch.Tensor) -> int:
    """The StorageImpl's reference count, less the UntypedStorage object made to ask."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def storage_key(t: torch.Tensor) -> int:
    """An id of t's storage, the same for every tensor sharing it while it lives."""
    return t.untyped_storage()._cdata


# untyped_storage_key(st): the same id, from an UntypedStorage object
untyped_storage_key = operator.attrgetter("_cdata")
is_zerotensor = operator.methodcaller("_is_zerotensor")
# tensor_backward_hooks(t): the dict of hooks `register_hook` put on a tensor (None if none)
tensor_backward_hooks = operator.attrgetter("_backward_hooks")


def push_saved_tensors_hooks(pack, unpack) -> None:
    """Push a (pack, unpack) pair on this thread's default saved-tensor hooks stack (what
    torch.autograd.graph.saved_tensors_hooks.__enter__ does, without the object)."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


def mark_internal_saved_tensors_hooks(pack) -> None:
    """Make torch.utils.checkpoint look past this pack hook when it looks for the user's hooks
    (`_current_user_saved_tensors_hooks`: a hook with `_checkpoint_internal` defers to its
    `_user_hooks`), and find none below it."""
    pack._checkpoint_internal, pack._user_hooks = True, None


def checkpoint_input_saver():
    """The code of the method torch.utils.checkpoint saves a checkpointed region's inputs with
    (`_CheckpointFrame.save_inputs`, torch >= 2.14: `_make_saved_tensor`, a SavedVariable the
    frame holds, owned by no autograd node); None on a torch that saves them in a node of their
    own (`_NoopSaveInputs`)."""
    import torch.utils.checkpoint

    save_inputs = getattr(torch.utils.checkpoint._CheckpointFrame, "save_inputs", None)
    return None if save_inputs is None else save_inputs.__code__


def set_graph_task_id(gid):
    """Make `gid` what torch.utils.checkpoint reads as the running backward's graph task id (it
    recomputes a checkpointed region once per id); returns the previous one. The C++ engine's
    id cannot be set, so this fills GraphExecGroup's slot, which checkpoint reads first. Older
    torch has no such slot: checkpoint then reads -1 outside the C++ engine and recomputes once
    per unpacked tensor (tapescope's peak would include those extra recomputations)."""
    setter = getattr(torch._C, "_set_graph_exec_group", None)
    if setter is None:  # pragma: no cover - older torch
        return None
    previous = torch._C._get_graph_exec_group()
    setter(gid)
    return previous


def node_hook_registrar():
    """(class, name) of the Python function torch calls to file a hook on any autograd node, a
    C++ node included: `registerFunctionHook` / `registerFunctionPreHook`
    (python_cpp_function.cpp) call `Function._register_hook(dict, hook)` with the dict of
    Python hooks the node already has (None if it has none) and keep the dict it returns. That
    dict is the only way Python can read a C++ node's hooks."""
    from torch.autograd.function import _HookMixin

    return _HookMixin, "_register_hook"


def post_accumulate_grad_hooks(t: torch.Tensor):
    return getattr(t, "_post_accumulate_grad_hooks", None)


def forward_ad_level() -> int:
    """>= 0 while a forward-mode AD level is active."""
    return torch.autograd.forward_ad._current_level


_ADINPLACEORVIEW = torch._C.DispatchKey.ADInplaceOrView


def adinplaceorview_excluded() -> bool:
    """True below an autograd kernel (it excludes ADInplaceOrView for the ops it calls)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(_ADINPLACEORVIEW)


# ---- defaults, optimizers, autocast ----------------------------------------------------------------

default_device = torch._C._get_default_device  # () -> the default device (see sequence_nr)


def foreach_devices() -> list:
    """Device types whose optimizers default to foreach kernels for plain tensors."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return _get_foreach_kernels_supported_devices()


def fake_mode_handles_directly(func) -> bool:
    """Whether FakeTensorMode.dispatch answers `func` before it looks at the argument types (its
    metadata handlers and the ops it runs as they are, fake_tensor.py `dispatch`)."""
    return func in _FAKE_META_HANDLERS or func in _FAKE_HANDLE_DIRECTLY


def _markers_run_as_they_are() -> frozenset:
    """The record_function markers (torch.optim wraps each step in one) that FakeTensorMode
    answers by running the op itself inside a kernel invocation, and nothing else: the exit from
    `_DISPATCH_HANDLE_DIRECTLY` (fake_tensor.py `dispatch`), the enter from its fake impl
    (fake_impls.py `_record_function_enter_new`: `with in_kernel_invocation_manager(fake_mode):
    return func(name, args)`), each only while torch still registers it so."""
    from torch._subclasses.fake_impls import op_implementations_dict

    profiler = torch.ops.profiler
    found = set()
    exit_ = getattr(getattr(profiler, "_record_function_exit", None), "_RecordFunction", None)
    if exit_ is not None and exit_ in _FAKE_HANDLE_DIRECTLY:
        found.add(exit_)
    enter = getattr(getattr(profiler, "_record_function_enter_new", None), "default", None)
    impl = op_implementations_dict.get(enter) if enter is not None else None
    if impl is not None and impl.__name__ == "_record_function_enter_new":
        found.add(enter)
    return frozenset(found)


MARKERS_RUN_AS_THEY_ARE = _markers_run_as_they_are()


def functional_collective_ops(names) -> frozenset:
    """The `_c10d_functional` ops of these names (their default overloads) that this torch has."""
    ops = set()
    for name in names:
        try:
            ops.add(getattr(torch.ops._c10d_functional, name).default)
        except (AttributeError, RuntimeError):  # a torch without torch.distributed, or the op
            pass
    return frozenset(ops)


def fake_cache_bypasses() -> dict:
    """FakeTensorMode's counter of ops it refused to cache, by reason (class-level)."""
    return FakeTensorMode.cache_bypasses


def has_composite_implicit_kernel(func) -> bool:
    """Whether `func` has a CompositeImplicitAutograd kernel: FakeTensorMode refuses to cache a
    view op that has one (fake_tensor.py, `_validate_cache_key`, by this same test)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd)


class FakeTensorFactory:
    """`make(meta, device)`: the FakeTensor that `FakeTensor(mode, meta, device)` makes, for a
    `device` a fake tensor of this mode already carries (FakeTensor has normalised it), at about
    a third of the cost (~4 us instead of ~12 us).

    `FakeTensor.__new__` is torch's Python (fake_tensor.py): it parses its keyword arguments,
    normalises the device twice, and sets five memo descriptors, each writing three attributes
    through `__set__`; `FakeTensor.__init__` then asks whether an export is running. What it leaves
    is a `Tensor._make_subclass` of the meta tensor with the fake device's dispatch keys, the
    mutable-data-pointer guard, and plain instance attributes. This makes the same: the attributes
    are copied from a FakeTensor the real constructor made for this mode, so an attribute a torch
    release adds is copied too, and the result is compared with the real constructor's once, here
    (attributes, type, dispatch keys, device, requires_grad). `make` falls back to the real
    constructor where it does more: an export running (its leak tracker), FakeTensorConfig.debug
    (a traceback per tensor), or a check that found a difference (`exact` False).
    """

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        with no_dispatch():
            meta = torch.empty((2, 3), device="meta")
            real = FakeTensor(mode, meta, torch.device("cpu"))
            self._state = dict(real.__dict__)
            try:
                mine = self._build(meta, real.fake_device)
                self.exact = (type(mine) is type(real)
                              and list(mine.__dict__) == list(real.__dict__)
                              and all(mine.__dict__[k] is v for k, v in real.__dict__.items())
                              and torch._C._dispatch_keys(mine) == torch._C._dispatch_keys(real)
                              and mine.device == real.device
                              and mine.requires_grad == real.requires_grad)
            except Exception:  # noqa: BLE001 - internals moved: use the real constructor
                self.exact = False

    def make(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        if not self.exact or FakeTensorConfig.debug or torch.compiler.is_exporting():
            return FakeTensor(self.mode, meta, device)
        return self._build(meta, device)

    def alias(self, base: FakeTensor, device: torch.device) -> FakeTensor:
        """`make(base.as_strided(base's own sizes, strides and offset), device)` without
        requires_grad, for `base` a fake tensor of this mode, inside a kernel invocation (a
        detach: ~520 a GPT-2 profile). `Tensor._make_subclass` detaches what it is given, so given
        `base` it makes the same alias of base's storage (sharing its version counter) without the
        as_strided's own alias: ~1 us instead of ~5."""
        if not self.exact or FakeTensorConfig.debug or torch.compiler.is_exporting():
            return self.make(base.as_strided(base.shape, base.stride(), base.storage_offset()),
                             device)
        return self._build(base, device, False)

    def _build(self, meta, device, requires_grad=None):
        if requires_grad is None:
            requires_grad = meta.requires_grad
        t = torch.Tensor._make_subclass(FakeTensor, meta, requires_grad, dispatch_device=True,
                                        device_for_backend_keys=device)
        if not self.mode._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(t)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
        # the attributes as one copy of the model FakeTensor's dict, set as the new tensor's
        # (empty) dict: ~0.3 us where filling the dict the first read of `__dict__` makes, key by
        # key, is ~0.7 us (a FakeTensor carries ~20; ~2,800 are made a GPT-2 profile)
        state = self._state.copy()
        state["_fake_device"] = device
        t.__dict__ = state
        return t


class SizeFreeCacheCheck(FakeTensorMode):
    """FakeTensorMode, whose check of a new cache entry rebuilds the output at sizes 0 where its
    answer cannot depend on the sizes.

    Before it caches an op's output, FakeTensorMode rebuilds the output from the entry it is about
    to store (fake_tensor.py, `_get_output_info_for_cache_entry`) and asks two things of it: are
    the rebuilt tensor's dispatch keys the output's (else "dispatch_key_set mismatch"), and did
    rebuilding meet a data-dependent size (a GuardOnDataDependentSymNode: "data dependent
    symnode")? On symbolic sizes the rebuild, `empty_strided` (+ `set_` for a view), is SymInt
    arithmetic in Python: ~0.4 ms an op, a third of a symbolic profile's FakeTensorMode misses
    (llama: 0.1 s of 0.33 s). Neither answer depends on the sizes where no size, stride, offset or
    storage size of the output holds an unbacked symbol: a TensorImpl's dispatch keys are fixed
    when it is made, from its device, inference mode and the conj / neg bits (FakeTensor's
    `_make_subclass` swaps the backend key for the fake device's), and only an unbacked symbol,
    having no hint, can raise a data-dependent error. There the rebuild is FakeTensorMode's own
    code on the same metadata with every size 0 and unit strides; elsewhere (and on concrete
    sizes, no ShapeEnv) it is FakeTensorMode's rebuild unchanged. What is cached, and what a
    cache hit returns, are unchanged.
    """

    _size_free_rebuild = False  # set for the one rebuild of a check (an instance attribute then)

    def _get_output_info_for_cache_entry(self, state, key, func, args, kwargs, output):
        # (concrete sizes: the rebuild is cheap, and left as FakeTensorMode's)
        if self.shape_env is not None and isinstance(output, FakeTensor) \
                and not free_unbacked_symbols((output, output.untyped_storage().nbytes())):
            self._size_free_rebuild = True
        try:
            return super()._get_output_info_for_cache_entry(state, key, func, args, kwargs, output)
        finally:
            self._size_free_rebuild = False

    def _output_from_cache_entry(self, state, entry, key, func, args):
        if self._size_free_rebuild:
            self._size_free_rebuild = False  # the check's rebuild: one output, one entry
            (info,) = entry.output_infos
            meta = info.metadata
            if meta is not None:
                n = len(meta.shape)
                meta = _dc_replace(meta, shape=(0,) * n, stride=(1,) * n, storage_offset=0,
                                   storage_bytes=None)
                entry = _dc_replace(entry, output_infos=(_dc_replace(info, metadata=meta),))
        return super()._output_from_cache_entry(state, entry, key, func, args)


# ---- ShapeEnv: sources and the source line a guard remembers --------------------------------------

def constant_source(name: str):
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


def inductor_cache_dir() -> str:
    """The folder inductor writes its generated Python to (TORCHINDUCTOR_CACHE_DIR or its
    default under the temporary folder)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def user_source_location(framework_loc, user_loc: str):
    from torch._guards import SLoc

    return SLoc(framework_loc, user_loc)


def hook_guard_locations(shape_env, make_location) -> None:
    """Make each guard `shape_env` records remember the location `make_location(original)` gives
    (ShapeEnv finds user frames only under dynamo). Sets an instance attribute: no other ShapeEnv
    is affected."""
    original = shape_env._get_sloc
    shape_env._get_sloc = lambda framework_loc=None: make_location(original(framework_loc))


def shape_env_facts(shape_env, symbols: dict) -> tuple[list, dict, dict]:
    """(guards, replacements, ranges) of a ShapeEnv as plain data: guards as (sympy expr, user
    location); replacements name -> sympy expr for the given symbols; ranges name -> (low, high)
    with None for unbounded."""
    guards = [(g.expr, g.sloc.maybe_user_loc, str(g.sloc)) for g in shape_env.guards]
    replacements = {n: shape_env.replacements.get(s) for n, s in symbols.items()
                    if shape_env.replacements.get(s) is not None}
    ranges = {}
    for n, s in symbols.items():
        vr = shape_env.var_to_range.get(s)
        lo = int(vr.lower) if vr is not None and vr.lower.is_Integer else None
        hi = int(vr.upper) if vr is not None and vr.upper.is_Integer else None
        ranges[n] = (lo, hi)
    return guards, replacements, ranges


# ---- the dispatcher, the profiler, attention --------------------------------------------------------

def dispatch_dump_table(op: str) -> str:
    return torch._C._dispatch_dump_table(op)


def profiler_event_types():
    from torch._C._profiler import _EventType

    return _EventType


def profiler_event_tree(prof) -> list:
    """The roots of a finished torch.profiler.profile's event tree (ops, allocations, children)."""
    return prof.profiler.kineto_results.experimental_event_tree()


@_contextmanager
def cpu_allocator_counts_every_thread():
    """Within it, the CPU allocator's running total (an allocation event's `total_allocated`)
    also counts the frees of threads the profiler does not follow. Yields whether it could.

    c10's ProfiledCPUMemoryReporter keeps the total, and its table of block sizes, only on a
    thread where memory profiling is on (a thread-local state): a block freed on any other thread
    is neither reported nor taken off the total, which then stays high by its size for good
    (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter::Delete). gloo's worker threads are such
    threads once a collective's work has run: the work object they still hold keeps the
    collective's tensors, and when the program has already dropped its own references the free
    happens there. c10's flag `caffe2_report_cpu_memory_usage` makes the reporter keep the total
    on every thread (it also logs each block at INFO, below c10's default log level); torch has
    no Python setter for c10 flags, so it is set in libc10 itself, and restored."""
    import ctypes
    import os

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):  # another build of torch: the total stays per-thread
        yield False
        return
    before = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = before


def schema_types():
    """The TorchScript type classes an op schema's arguments are described with."""
    return torch._C


def sdp_priority_order() -> list:
    return torch._C._get_sdp_priority_order()


def sdp_backend_enum():
    return torch._C._SDPBackend


def overrideable_sdp_enabled() -> bool:
    return torch._C._get_overrideable_sdp_enabled()


def fa3_sdp_enabled() -> bool:
    return bool(getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)())


# The builtins behind F.linear and F.scaled_dot_product_attention: a TorchFunctionMode sees them as
# `func`, whatever name the model imported them under.
linear_builtin = torch._C._nn.linear
sdpa_builtin = torch._C._nn.scaled_dot_product_attention


# No torch function mode or subclass handler sees the calls made inside (a context manager).
disable_torch_function = torch._C.DisableTorchFunction
# Autocast's dispatch keys excluded inside (a context manager): what an autocast wrapper's
# ExcludeDispatchKeyGuard does around the op it runs on the cast arguments; the autocast state,
# nesting and cast cache stay as they are.
disable_autocast = torch._C._DisableAutocast
# Whether autocast has a dtype policy for a device type (a string): the check torch.autocast makes
is_autocast_available = torch._C._is_autocast_available
# No torch dispatch mode or subclass handler sees the ops run inside (the C++ guard that
# in_kernel_invocation_manager holds, without its meta-key and generator work)
disable_torch_dispatch = torch._C._DisableTorchDispatch


_DisableTorchDispatch, _PreserveDispatchKeyGuard = (torch._C._DisableTorchDispatch,
                                                     torch._C._PreserveDispatchKeyGuard)
_meta_in_tls, _set_meta_in_tls = (torch._C._meta_in_tls_dispatch_include,
                                  torch._C._set_meta_in_tls_dispatch_include)


class kernel_invocation:
    """`with kernel_invocation(mode):` is `with in_kernel_invocation_manager(mode):`
    (fake_tensor.py) as a class: the same guards entered in the same order (no torch dispatch,
    the fake mode's in-kernel flag, the meta key included in TLS under a key-set guard),
    restored in reverse, in ~0.95 us where torch's generator context takes ~1.55 us (the replay
    front enters one for each replayed op that views an argument: ~1,200 a GPT-2 profile).
    tests/test_torch_compat.py compares the state inside and after with torch's."""

    __slots__ = ("mode", "prev", "no_dispatch", "keys")

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self) -> None:
        mode = self.mode
        self.prev = prev = mode.in_kernel_invocation
        meta_in_tls = _meta_in_tls()
        if meta_in_tls != prev:  # torch's own sanity check
            raise AssertionError(f"{meta_in_tls}, {prev}")
        self.no_dispatch = guard = _DisableTorchDispatch()
        guard.__enter__()
        mode.in_kernel_invocation = True
        self.keys = guard = _PreserveDispatchKeyGuard()
        guard.__enter__()
        _set_meta_in_tls(True)

    def __exit__(self, *exc) -> None:
        self.mode.in_kernel_invocation = self.prev
        self.keys.__exit__(None, None, None)
        self.no_dispatch.__exit__(None, None, None)


def without_torch_function(fn):
    """Run `fn` with no torch function mode: for work the C++ engine does in C++ in a real step
    (gradient validation, layout checks), which no mode sees there."""
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with disable_torch_function():
            return fn(*args, **kwargs)
    return run


class engine_grad_mode:
    """`with engine_grad_mode(False):` is `with torch.no_grad():` as the C++ engine's GradMode
    guard sets it: unseen by torch function modes. torch.set_grad_enabled calls
    torch._C._set_grad_enabled, which passes through every function mode (the capture's
    FunctionRulesMode: ~2 us a switch, two a backward node, ~1,000 a GPT-2 backward); in a real
    step the engine switches in C++, where no mode sees it."""

    __slots__ = ("mode", "prev")

    def __init__(self, mode: bool):
        self.mode = mode

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        with disable_torch_function():
            torch._C._set_grad_enabled(self.mode)

    def __exit__(self, *exc) -> None:
        with disable_torch_function():
            torch._C._set_grad_enabled(self.prev)


# torch wraps each dispatch mode's __torch_dispatch__ in this (utils/_python_dispatch.py,
# TorchDispatchMode.__init_subclass__, unless the class's _should_skip_dynamo says False)
disable_dynamo = torch._disable_dynamo
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def dynamo_disable_is_a_call() -> bool:
    """Would torch._disable_dynamo's wrapper (torch/_dynamo/eval_frame.py, `_fn`) do nothing but
    call the function it wraps? Yes while no dynamo frame callback is set (no compiled region
    runs) and torch.compiler's stance installs none for disabled code (only
    "eager_on_recompile" does). Exporting changes nothing for a __torch_dispatch__."""
    if _eval_frame_callback() is not None:
        return False
    # imported once the first mode dispatched (torch's own wrapper imports it); read from
    # sys.modules: an import statement costs ~0.15 us a call, ~5,200 calls a GPT-2 profile
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        import torch._dynamo.eval_frame as eval_frame

    return eval_frame._stance.stance == "default" or eval_frame._callback_from_stance(None) is None


# The operator objects (torch.ops.aten.mm, aten.mm.default, higher-order ops): immutable handles
# to the dispatcher, never state a model owns (copying one breaks its __getattr__).
OPERATOR_TYPES = (torch._ops.OpOverloadPacket, torch._ops.OperatorBase)
OpOverload = torch._ops.OpOverload  # one overload of an op: aten.mm.default


# ---- subclasses, autograd's graph task, torch.distributed (capture/graph_task.py, distributed/) ---

def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass that wraps others and says which (__tensor_flatten__): DTensor, ..."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def local_shard_shape(global_shape, mesh_shape, coordinate, placements) -> tuple:
    """The local shape of a DTensor on the rank at `coordinate` of its mesh (DTensor's own rule,
    the one FSDP2 and tensor parallelism shard by)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return tuple(_compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate),
                                                        placements, skip_offset=True)[0])


def process_group_ranks() -> dict:
    """ProcessGroup -> {global rank: group rank} for every group this process created."""
    from torch.distributed.distributed_c10d import _world

    return dict(_world.pg_group_ranks)


_unset_dispatch_mode, _set_dispatch_mode = (torch._C._unset_dispatch_mode,
                                            torch._C._set_dispatch_mode)
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


class fake_mode_unset:
    """`with fake_mode_unset():` is `with unset_fake_temporarily():` (fake_tensor.py) as a
    class: the same two calls (the fake mode taken off its dispatch slot, put back after), in
    ~0.5 us where torch's generator context takes ~1.9 us. The data values (capture/
    data_values.py) enter one for each op they run on real values: ~700 a GPT-2 profile, where
    the optimizer's step counters have values. tests/test_torch_compat.py compares the state
    inside and after with torch's."""

    __slots__ = ("old",)

    def __enter__(self):
        self.old = old = _unset_dispatch_mode(_FAKE_MODE_KEY)
        return old

    def __exit__(self, *exc) -> None:
        if self.old is not None:
            _set_dispatch_mode(self.old)


def unset_fake_mode():
    """A context in which no fake mode is active (DeviceMesh's rank bookkeeping runs there)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# c10d's in-place collectives (they write their output arguments and return them with a Work):
# the result torch's Meta registration gives them (torch/distributed/_meta_registrations.py),
# made without FakeTensorMode's generic dispatch, which takes 10-15 ms for a scatter_ of a
# list of lists (DTensor's distribute_tensor issues one per tensor-parallel parameter). With the
# fake process group nothing moves either way. name -> whether the result leads with args[0].
_C10D_RESULTS = {"broadcast_": True, "allreduce_": True, "allgather_": True,
                 "_allgather_base_": True, "reduce_scatter_": True, "_reduce_scatter_base_": True,
                 "scatter_": True, "alltoall_": True, "reduce_": False, "gather_": False,
                 "alltoall_base_": False, "barrier": False, "send": False, "recv_": False,
                 "recv_any_source_": False}


def c10d_collective_result(func, args):
    """(outputs, FakeWork) or FakeWork for a c10d collective on fake tensors; None for others."""
    first = _C10D_RESULTS.get(func.overloadpacket.__name__)
    if first is None:
        return None
    from torch._C._distributed_c10d import FakeWork

    work = FakeWork().boxed()
    return (args[0], work) if first else work


def clear_dtensor_caches() -> None:
    """Empty DTensor's process-wide caches: sharding decisions (Python and the C++ fast path),
    redistribution plans, transform infos, output metadata, mesh topologies."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
                   getattr(MeshTopoInfo, "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


try:  # the placement FSDP2 gives a parameter it shards over a tensor-parallel dimension
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
except ImportError:  # pragma: no cover - a torch without it, or without torch.distributed
    class StridedShard:  # never an instance: the rule falls back to DTensor's own
        pass


# ---- torch.distributed: the fake world, checkpoint_wrapper, DDP (distributed/, capture/) ---------

def fake_store():
    """A store for torch's fake process group (collectives complete at once, move no data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def context_parallel_module():
    """torch's context-parallel implementation (its ring handlers, `custom_ops`, `aten`):
    validate/ring_attention.py runs its ring code on the CPU."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def in_backward() -> bool:
    """Whether autograd's engine is running a backward (a graph task is current)."""
    return torch._C._current_graph_task_id() != -1


def inductor_compile_fx_module():
    """The module whose `compile_fx` torch.compile's default backend calls by name."""
    import torch._inductor.compile_fx as module

    return module


def replicate_with_fsdp():
    """FSDP2's DDP, `replicate(module, mesh=..., mp_policy=...)` (what torchtitan applies for
    data-parallel replicas)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def checkpoint_wrapper_api() -> tuple:
    """(checkpoint_wrapper, CheckpointImpl, ActivationWrapper) of torch.distributed's activation
    checkpointing; ImportError on a torch built without torch.distributed."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        ActivationWrapper, CheckpointImpl, checkpoint_wrapper)

    return checkpoint_wrapper, CheckpointImpl, ActivationWrapper


# Modules that bind `_are_we_tracing` at import (torch 2.6 - 2.14); absent ones are skipped.
TRACING_CHECK_MODULES = (
    "torch.distributed._functional_collectives",
    "torch.distributed.tensor._dispatch",
    "torch.distributed.tensor._sharding_prop",
    "torch.distributed.tensor._redistribute",
    "torch.distributed.tensor._collective_utils",
    "torch.distributed.tensor._decompositions",
)


def dtensor_tracing_checks() -> list:
    """(module, name) of each `_are_we_tracing` DTensor and the functional collectives call
    (distributed/fidelity.py answers False for the capture)."""
    import importlib

    sites = []
    for name in TRACING_CHECK_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_are_we_tracing"):
            sites.append((module, "_are_we_tracing"))
    return sites


def dtensor_meta_propagation():
    """(class, name) of the method DTensor computes an op's output metadata with, by running it on
    global-shaped fake tensors in the active fake mode."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    return ShardingPropagator, "_propagate_tensor_meta_non_cached"


def sharding_decisions():
    """(ShardingPropagator, the name of its method that makes a sharding decision with no cache,
    DTensorSpec, OpSchema, OutputSharding). DTensor's C++ fast path calls that method on a miss
    of its own cache (`_propagate_op_sharding_dispatch_slow_path`, with `try_cache` False)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    return (ShardingPropagator, "propagate_op_sharding_non_cached", DTensorSpec, OpSchema,
            OutputSharding)


def mesh_value(mesh):
    """What DeviceMesh's own equality and hash compare (its rank map, layout, device type,
    dimension names and thread: `DeviceMesh._hash_key`), a tuple of plain values that keeps no
    mesh, process group or tensor alive; None where this torch's DeviceMesh has no such key."""
    key = getattr(type(mesh), "_hash_key", None)
    return None if key is None else key(mesh)


def strided_shard_flag_propagation():
    """(module, name) of `_propagate_use_strided_shard_flag(op_strategy, op_schema)`, or None where
    this torch has none."""
    try:
        from torch.distributed.tensor import _sharding_prop
    except ImportError:
        return None
    name = "_propagate_use_strided_shard_flag"
    return (_sharding_prop, name) if hasattr(_sharding_prop, name) else None


def mesh_strategy_expansion():
    """(module, name) of `expand_to_full_mesh_op_strategy`, as DTensor's op strategies call it
    (looked up on its module at call time), or None where this torch has none."""
    try:
        from torch.distributed.tensor._ops import utils
    except ImportError:
        return None
    name = "expand_to_full_mesh_op_strategy"
    return (utils, name) if hasattr(utils, name) else None


def foreach_strategy_expansion():
    """(module, name, TupleStrategy, OpSchema) of `_expand_single_dim_strategy_to_mesh(mesh,
    op_schema, strategy_info, output_tensor_meta)` as the sharding propagator calls it (bound
    in its module by import), or None where this torch has none."""
    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor._op_schema import OpSchema, TupleStrategy
    except ImportError:
        return None
    name = "_expand_single_dim_strategy_to_mesh"
    if not hasattr(_sharding_prop, name):
        return None
    return _sharding_prop, name, TupleStrategy, OpSchema


# DeviceMesh methods that compute on the mesh's rank tensor (torch 2.14); absent ones are skipped
_MESH_TENSOR_METHODS = ("__init__", "mesh", "_compute_coordinates_from_mesh",
                        "_get_mesh_tensor_from_full_mesh", "_init_one_process_group",
                        "from_group", "_concatenate")

# The keyword `init_device_mesh` gives DeviceMesh.__init__ its rank tensor with (torch >= 2.9)
MESH_RANK_MAP = "_rank_map"


def mesh_rank_tensor_methods() -> list:
    """(class, name) of each method of DeviceMesh and its layout that computes on the mesh's rank
    tensor, where this torch has it (in the class's own __dict__)."""
    from torch.distributed.device_mesh import DeviceMesh

    sites = [(DeviceMesh, n) for n in _MESH_TENSOR_METHODS]
    try:
        from torch.distributed._mesh_layout import _MeshLayout
    except ImportError:  # pragma: no cover - torch before 2.9
        pass
    else:
        sites.append((_MeshLayout, "remap_to_tensor"))
    return [(cls, n) for cls, n in sites if n in cls.__dict__]


def device_constructors():
    """The factories `with torch.device(d)` gives a device (torch/utils/_device.py)."""
    from torch.utils._device import _device_constructors

    return _device_constructors()


def active_fake_mode():
    from torch._guards import detect_fake_mode

    return detect_fake_mode()


def profiler_running() -> bool:
    """Is a torch.profiler session on (a second cannot start)?"""
    return bool(torch.autograd.profiler._is_profiler_enabled)


# What tests/test_torch_compat.py checks on every torch CI installs: each entry must resolve.
PRIVATE_NAMES = (
    "torch.autograd.profiler._is_profiler_enabled",
    "torch._C.DisableTorchFunction", "torch._C._DisableTorchDispatch",
    "torch._C._meta_in_tls_dispatch_include", "torch._C._set_meta_in_tls_dispatch_include",
    "torch._C._PreserveDispatchKeyGuard",
    "torch._ops.OpOverloadPacket", "torch._ops.OperatorBase", "torch._ops.OpOverload",
    "torch.autograd._get_sequence_nr", "torch._C._current_autograd_node",
    "torch._C._storage_Use_Count", "torch._C._dispatch_tls_is_dispatch_key_excluded",
    "torch._C.DispatchKey.ADInplaceOrView", "torch._C._get_default_device",
    "torch._C._dispatch_dump_table", "torch._C._get_sdp_priority_order", "torch._C._SDPBackend",
    "torch._C._get_overrideable_sdp_enabled", "torch._C._nn.linear",
    "torch._C._nn.scaled_dot_product_attention", "torch.autograd.forward_ad._current_level",
    "torch._subclasses.fake_tensor.FakeTensorMode.cache_bypasses",
    # SizeFreeCacheCheck's two overrides, and the entry fields it rewrites (read at call time)
    "torch._subclasses.fake_tensor.FakeTensorMode._get_output_info_for_cache_entry",
    "torch._subclasses.fake_tensor.FakeTensorMode._output_from_cache_entry",
    "torch._subclasses.fake_tensor._DispatchCacheValidEntry.output_infos",
    "torch._subclasses.fake_tensor._DispatchCacheEntryOutputInfo.metadata",
    "torch._subclasses.fake_tensor.TensorMetadata.storage_bytes",
    "torch._C._dispatch_has_kernel_for_dispatch_key",
    "torch._C.DispatchKey.CompositeImplicitAutograd",
    "torch._subclasses.fake_tensor.in_kernel_invocation_manager",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",
    "torch._C._unset_dispatch_mode", "torch._C._set_dispatch_mode",
    "torch._C._TorchDispatchModeKey.FAKE",
    "torch._subclasses.fake_tensor._DISPATCH_META_HANDLERS",
    "torch._subclasses.fake_tensor._DISPATCH_HANDLE_DIRECTLY",
    # FakeTensorFactory (it falls back to FakeTensor's constructor without them; named here so
    # that a torch which moves one says so)
    "torch._subclasses.fake_tensor.FakeTensorConfig.debug", "torch.Tensor._make_subclass",
    "torch._C._set_throw_on_mutable_data_ptr", "torch._C._set_warn_deprecated_on_mutable_data_ptr",
    "torch._C._dispatch_keys",
    "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv.set_real_tensor_prop_unbacked_vals",
    "torch.utils._foreach_utils._get_foreach_kernels_supported_devices",
    "torch._dynamo.source.ConstantSource", "torch._guards.SLoc", "torch._C._profiler._EventType",
    "torch.utils._pytree.SUPPORTED_NODES",
    "torch.utils._python_dispatch._disable_current_modes", "torch.utils._mode_utils.no_dispatch",
    "torch.fx.experimental.symbolic_shapes.ShapeEnv._get_sloc",
    "torch.Tensor._use_count", "torch.Tensor._is_zerotensor", "torch.Tensor._backward_hooks",
    "torch.UntypedStorage._cdata", "torch._C.OptionalType", "torch._C.ListType",
    "torch.profiler.profile.profiler",
    # the compiled step (capture/compiled.py, capture/hooks.py, capture/engine.py)
    "torch._C._len_torch_function_stack", "torch._C._pop_torch_function_stack",
    "torch._C._push_on_torch_function_stack",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C._autograd._pop_saved_tensors_default_hooks",
    "torch._C._autograd._push_saved_tensors_default_hooks",
    "torch.utils.checkpoint._CheckpointFrame",
    "torch._C._autograd._get_current_graph_task_keep_graph",
    "torch._C._FunctionBase.maybe_clear_saved_tensors",
    "torch.autograd.function.BackwardCFunction.apply_boxed",
    "torch._inductor.async_compile.AsyncCompile.cpp_pybinding",
    "torch._inductor.compile_fx.compile_fx", "torch._inductor.compile_fx.compile_fx_inner",
    "torch._inductor.list_mode_options", "torch._dynamo.callback.callback_handler",
    "torch._dynamo.backends.common.aot_autograd",
    "torch._functorch.config.enable_autograd_cache", "torch._inductor.config.compile_threads",
    "torch._functorch.config.activation_memory_budget",
    "torch._functorch.config.check_custom_op_aliasing",
    "torch._inductor.config.force_disable_caches",
    "torch._prims_common.suggest_memory_format",
    "torch._C._select_conv_backend",
    "torch._prims_common.compute_elementwise_output_strides",
    "torch._decomp.global_decomposition_table",
    "torch.utils._device._device_constructors",
    # inductor's CUDA path without a GPU (capture/gpu_less.py, capture/compiled.py)
    "torch.cuda._lazy_init", "torch.cuda._DeviceGuard", "torch.cuda._exchange_device",
    "torch.cuda._maybe_exchange_device",
    "torch._dynamo.device_interface.CudaInterface",
    "torch._dynamo.device_interface.caching_worker_device_properties",
    "torch._dynamo.device_interface.caching_worker_current_devices",
    "torch._subclasses.fake_tensor.FakeTensorMode.avoid_device_init",
    "torch._inductor.constant_folding.ConstantFolder.run",
    "torch._inductor.fx_passes.joint_graph.UniformValueConstantFolder",
    "torch._inductor.runtime.hints.DeviceProperties.create",
    "torch.utils._triton.has_triton", "torch._inductor.utils.get_gpu_dram_gbps",
    "torch._inductor.utils.get_device_tflops",
    "torch._inductor.fx_passes.pad_mm.get_cached_should_pad",
    "torch._dynamo.exc.SkipFrame", "torch._dynamo.exc.BackendCompilerFailed",
    "torch._inductor.codecache.CacheBase.get_system",
    "torch._inductor.analysis.device_info",
    "torch._inductor.codegen.triton.TritonKernelOverrides._setup_libdevice_routing",
    # graph task stand-in (capture/graph_task.py) and wrapper subclasses (capture/tape.py)
    "torch._C._current_graph_task_id", "torch._C._will_engine_execute_node",
    "torch._C._get_accelerator",
    "torch.autograd.variable.Variable._execution_engine",
    "torch.utils._python_dispatch.is_traceable_wrapper_subclass",
    # distributed/ (mesh.py, ranks.py, groups.py, fidelity.py)
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch.distributed.tensor._utils._compute_local_shape_and_global_offset",
    "torch.distributed.distributed_c10d._world",
    "torch._subclasses.fake_tensor.unset_fake_temporarily", "torch._guards.detect_fake_mode",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
    "torch.distributed.device_mesh.DeviceMesh._hash_key",
    "torch.distributed._functional_collectives._are_we_tracing",
    "torch.distributed._mesh_layout._MeshLayout.remap_to_tensor",
    "torch.distributed.device_mesh.DeviceMesh._concatenate",
    "torch._C._distributed_c10d.FakeWork",
    "torch.distributed.tensor.debug._clear_sharding_prop_cache",
    "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor._sharding_prop._propagate_use_strided_shard_flag",
    "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy",
    "torch.distributed.tensor._sharding_prop._expand_single_dim_strategy_to_mesh",
    "torch.distributed.tensor._op_schema.TupleStrategy",
    "torch.distributed.tensor._op_schema.OpSchema",
    "torch.distributed._composable.replicate_with_fsdp.replicate",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointImpl",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper",
    "torch.distributed.device_mesh.DeviceMesh._compute_coordinates_from_mesh",
    "torch.distributed.device_mesh.DeviceMesh._get_mesh_tensor_from_full_mesh",
    "torch.distributed.device_mesh.DeviceMesh._init_one_process_group",
    # patched where a library branches on a FakeTensor (capture/fidelity/libraries.py)
    "torch.optim.optimizer._foreach_supported_types",
    "torch.utils._foreach_utils._foreach_supported_types",
    "torch.cuda.amp.common.amp_definitely_not_available",
    # the context-parallel truth (validate/ring_attention.py) and a user's compile (compiled.py)
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.distributed.tensor.experimental._context_parallel._attention.custom_ops",
    "torch.distributed.tensor.experimental._context_parallel._attention.aten",
    "torch.distributed.tensor.experimental._context_parallel._attention."
    "_scaled_dot_product_ring_flash_attention",
    "torch.distributed.tensor.experimental._context_parallel._attention."
    "_scaled_dot_product_ring_flash_attention_backward",
)

# Triton's names (capture/gpu_less.py): its driver registry and CUDA driver class, checked where
# triton is installed (inductor's CUDA path needs it; the CPU-only torch has none)
TRITON_NAMES = (
    "triton.runtime.driver.driver", "triton.runtime.driver.DriverConfig",
    "triton.backends.nvidia.driver.CudaDriver", "triton.backends.compiler.GPUTarget",
)

# Names tapescope only accommodates where torch has them: it never calls them, and an older torch
# without them behaves as tapescope expects (tests/test_torch_compat.py checks the supported torch
# of README's install has each, and that older torch lacks them harmlessly).
#   `_current_user_saved_tensors_hooks` (torch >= 2.14): checkpoint looks past internal hooks for the
#   user's; mark_internal_saved_tensors_hooks sets the attributes it reads. Before 2.14 checkpoint
#   never looks, so the attributes are inert.
NEWER_TORCH_NAMES = {
    "torch.utils.checkpoint._current_user_saved_tensors_hooks": (2, 14),
}


# ---- torch.compile (capture/compiled.py) ----------------------------------------------------------

from contextlib import contextmanager as _contextmanager


@_contextmanager
def function_modes_suspended():
    """No TorchFunctionMode inside (as in the user's process while compiled code runs: dynamo
    would trace a mode's own code into the graph). Restored on exit."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


@_contextmanager
def saved_tensor_hooks_suspended():
    """No default saved-tensor hooks inside (AOTAutograd would trace a pack hook's ops into the
    joint graph). Restored on exit."""
    hooks = []
    while True:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            break
        hooks.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(hooks):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def graph_task_keep_graph_query():
    """(module, name) of the query AOTAutograd's compiled backward makes of the running graph task."""
    return torch._C._autograd, "_get_current_graph_task_keep_graph"


def inductor_async_compile():
    """Inductor's AsyncCompile, whose kernel compilers capture/compiled.py stubs out."""
    from torch._inductor.async_compile import AsyncCompile

    return AsyncCompile


# AsyncCompile's kernel compilers (torch 2.14); capture/compiled.py replaces those this torch has
INDUCTOR_KERNEL_COMPILERS = ("cpp", "cpp_pybinding", "triton", "halide", "cuda", "rocm", "xpu",
                             "cutedsl", "multi_kernel", "size_hint_multi_kernel", "pallas")


def inductor_mode_options(mode, dynamic) -> dict:
    """The config patches `torch.compile(mode=...)` applies (torch._inductor.list_mode_options)."""
    from torch._inductor import list_mode_options

    return list_mode_options(mode, dynamic)


def inductor_compilers():
    """(compile_fx, compile_fx_inner): inductor's backend and its compile of each graph."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    return compile_fx, compile_fx_inner


def aot_autograd(**compilers):
    """torch._dynamo's aot_autograd backend with the given fw/bw/inference compilers."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**compilers)


def compile_configs():
    """(functorch's config, inductor's config): the modules whose `.patch(...)` sets them."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return functorch_config, inductor_config


def dynamo_callback_handler():
    """Dynamo's compilation callbacks (told of each compile's start and end)."""
    from torch._dynamo.callback import callback_handler

    return callback_handler


def inductor_constant_folders():
    """(ConstantFolder, UniformValueConstantFolder): inductor's constant folding passes."""
    from torch._inductor.constant_folding import ConstantFolder
    from torch._inductor.fx_passes.joint_graph import UniformValueConstantFolder

    return ConstantFolder, UniformValueConstantFolder


def inductor_utils():
    """torch._inductor.utils: its datasheet queries (get_device_tflops, get_gpu_dram_gbps), which
    pad_mm reads through the module (capture/gpu_less.py answers them for the named GPU)."""
    import torch._inductor.utils as utils

    return utils


def dynamo_skip_frame():
    """(BackendCompilerFailed, SkipFrame): dynamo's wrapper of a backend's error, and the
    exception that tells dynamo to run a frame eagerly."""
    from torch._dynamo.exc import BackendCompilerFailed, SkipFrame

    return BackendCompilerFailed, SkipFrame


def inductor_pad_mm():
    """torch._inductor.fx_passes.pad_mm: its benchmark verdict cache (capture/gpu_less.py)."""
    import torch._inductor.fx_passes.pad_mm as pad_mm

    return pad_mm


def matmul_allows_tf32() -> bool:
    """Whether fp32 matmuls may use TF32, as inductor's get_device_tflops reads it."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def dynamo_device_interface():
    """torch._dynamo.device_interface: CudaInterface and its worker caches (capture/gpu_less.py)."""
    import torch._dynamo.device_interface as device_interface

    return device_interface


# Modules whose functools caches hold answers about the device or what follows from them
# (capture/gpu_less.py empties them); one missing from a torch build is skipped.
DEVICE_CACHING_MODULES = (
    "torch.utils._triton", "torch._inductor.utils", "torch._inductor.runtime.hints",
    "torch._inductor.codecache", "torch._inductor.analysis.device_info",
    "torch._dynamo.device_interface", "torch._inductor.runtime.triton_heuristics",
    "torch._inductor.codegen.triton", "torch._inductor.runtime.triton_helpers")

# functools caches in those modules that are a run-once guard, not an answer: emptying one makes
# torch run its setup again. `_setup_libdevice_routing` wraps each fp64 libdevice op of
# TritonKernelOverrides around the one before, so emptied on each profile it nested one wrapper
# deeper per profile (tests/test_patches.py).
SETUP_ONCE_CACHES = (
    "torch._inductor.codegen.triton.TritonKernelOverrides._setup_libdevice_routing",)


# ---- queries tapescope answers itself (patched where named, restored by the caller) -------------

def graph_task_queries():
    """(module, names) of the C++ engine's queries about the running backward (FSDP2's `is_bw()`
    reads the first; checkpointing and hooks the second): capture/graph_task.py answers them."""
    return torch._C, ("_current_graph_task_id", "_will_engine_execute_node")


def accelerator_query():
    """(module, name) of the query `torch.accelerator` answers from: which accelerator this
    process has (distributed/cuda_standin.py answers "cuda" on a machine without one)."""
    return torch._C, "_get_accelerator"


# ---- layouts (torch/_prims_common) --------------------------------------------------------------
def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """`Tensor.suggest_memory_format()` as ATen's CPU kernels call it (channels_last when the
    strides are NHWC-like; a stride-0 channel dimension is contiguous), for fake tensors too."""
    from torch._prims_common import suggest_memory_format as suggest

    return suggest(t)


def elementwise_output_strides(sizes, operand_strides) -> tuple:
    """The strides TensorIterator gives the output of an elementwise op whose operands, broadcast
    to `sizes`, have `operand_strides` (torch/_prims_common compute_elementwise_output_strides,
    the same ordering rules: the first operand decides, a broadcast (stride 0) dimension defers
    to the next). Reads meta tensors only."""
    from torch._prims_common import compute_elementwise_output_strides

    operands = [torch.empty_strided(sizes, st, device="meta") for st in operand_strides]
    return tuple(compute_elementwise_output_strides(*operands))


def pointwise_meta_decompositions() -> tuple:
    """The pointwise aten ops whose fake (meta) kernel is a Python reference or decomposition
    (torch/_meta_registrations.py activate_meta: the meta, post_autograd and pre_autograd
    decomposition tables), functional ones."""
    from torch._decomp import global_decomposition_table

    ops = {op for typ in ("meta", "post_autograd", "pre_autograd")
           for op in global_decomposition_table[typ]}
    return tuple(op for op in ops if isinstance(op, OpOverload)
                 and torch.Tag.pointwise in op.tags and not op._schema.is_mutable
                 and not op.is_view)


def select_conv_backend(x, weight, stride, padding, dilation, transposed, output_padding,
                        groups) -> str:
    """The backend `aten::convolution` picks (Convolution.cpp `_select_conv_backend`), by its
    ConvBackend name ("Mkldnn", "Slow2d", ...); it reads only the tensors' metadata, so fake
    tensors do. It reads this machine's thread count."""
    backend = torch._C._select_conv_backend(x, weight, None, list(stride), list(padding),
                                            list(dilation), bool(transposed),
                                            list(output_padding), int(groups), None)
    return backend.name


# ---- the catalogue: every attribute of torch (and of the libraries it drives) a profile patches --
#
# tapescope changes no torch state for good, but while a profile runs it answers some of torch's
# questions itself (the C++ engine's graph-task queries, CUDA's device queries without a GPU),
# sees what no dispatch mode sees (hooks kept in C++, `UntypedStorage.resize_`) or runs a branch
# as the eager step does (DTensor's `_are_we_tracing`). Each is set by the module named in `by`
# through `patched` (below), the one context manager that sets a catalogued attribute and
# restores it on exit, error or not, and refuses one this list lacks; the list is here so that
# one can see them all, and tests/test_patches.py checks that after a normal, a failing, a
# GPU-less CUDA, a compiled and a distributed profile each is the very object it was before,
# that while a profile runs nothing else under torch is changed, and (an AST check) that no
# module sets an attribute of torch any other way. Decisions of torch that tapescope's dispatch
# copies without setting anything are catalogued beside them (SHORTCUTS). Not listed, because
# not fixed attributes:
# capture/isolation.py binds the globals and class attributes the *model's* code names to private
# copies (restored the same way), and the global module / optimizer-step hooks capture/modules.py
# and capture/program.py register through torch's public API (removed on exit).

from dataclasses import dataclass as _dataclass


@_dataclass(frozen=True)
class Patched:
    """Attributes `names` of `owner` (a dotted module or class path), set for a block by `by`."""

    owner: str
    names: tuple[str, ...]
    by: str
    why: str


PATCHED = (
    # autocast's weight-cast cache, which a FUNCTION rule that runs linear in Python keeps itself
    Patched("torch", ("clear_autocast_cache",), "capture/fidelity/linear.py",
            "autocast's __exit__ clears torch's cast cache through it; the casts the linear rule "
            "keeps (autocast_mode.cpp's cached_cast has no Python binding) are cleared with it"),
    # the context-parallel truth (validate/ring_attention.py): torch's ring code run on the CPU
    Patched("torch.distributed.tensor.experimental._context_parallel._attention",
            ("aten", "custom_ops"), "validate/ring_attention.py",
            "the CPU flash op goes to torch's own CUDA flash ring handler, whose per-block CUDA "
            "kernel is the CPU one; the truth for CP collectives, never used by a profile"),
    # a compile=True profile: the user's own torch.compile outside the model (a compiled loss)
    Patched("torch._inductor.compile_fx", ("compile_fx",), "capture/compiled.py",
            "torch.compile's default backend calls it by name; tapescope's backend answers, so "
            "the generated code runs on fake tensors (user_compiles)"),
    # the backward: tapescope's Python engine runs it, and answers what the C++ engine would
    Patched("torch._C", ("_current_graph_task_id", "_will_engine_execute_node"),
            "capture/graph_task.py", "FSDP2's is_bw(), checkpoint and hooks ask the running "
            "graph task; the Python engine's answers"),
    Patched("torch.autograd.variable.Variable", ("_execution_engine",), "capture/graph_task.py",
            "queue_callback (FSDP2's final callback) goes to the Python engine's graph task"),
    Patched("torch._C._autograd", ("_get_current_graph_task_keep_graph",), "capture/engine.py",
            "AOTAutograd's compiled backward asks whether the graph is kept (donated buffers)"),
    Patched("torch.autograd", ("backward", "grad"),
            "capture/engine.py, capture/session.py, capture/program.py",
            "a backward inside a node (reentrant checkpoint) or in a user's step runs on the "
            "Python engine"),
    # hooks C++ keeps where no mode sees them
    Patched("torch.Tensor", ("register_hook", "retain_grad"), "capture/hooks.py",
            "tensor hooks and retained gradients, which the C++ engine keeps per node"),
    Patched("torch.autograd.function.BackwardCFunction",
            ("register_hook", "register_prehook", "maybe_clear_saved_tensors"), "capture/hooks.py",
            "node hooks; what a custom Function's backward unpacked is released with it"),
    Patched("torch.autograd.function._HookMixin", ("_register_hook",), "capture/hooks.py",
            "hooks filed on C++ nodes (Node.register_prehook: pipelining's split backward) are "
            "read back through the dict torch keeps them in"),
    Patched("torch.autograd.Function", ("apply",), "capture/hooks.py",
            "which inputs of a custom Function are Variables (its backward's inputs)"),
    Patched("torch.autograd.graph.saved_tensors_hooks", ("__enter__", "__exit__"),
            "capture/hooks.py", "what a user's saved-tensor hook packs is released with its node"),
    Patched("torch.UntypedStorage", ("resize_",), "capture/tape.py",
            "FSDP2 frees and re-allocates unsharded parameters without dispatching an op"),
    Patched("torch", ("get_rng_state",), "capture/rng_state.py",
            "the real tensor it returns (checkpoint, fork_rng) is counted in the step"),
    Patched("torch.nn.Module", ("register_parameter", "register_buffer"), "capture/model.py",
            "a model built by a function is built on meta, keeping small constants' values"),
    # a library's branch on "is this a FakeTensor / is there a GPU", answered as in the eager step
    Patched("transformers.masking_utils", ("is_tracing",), "capture/fidelity/libraries.py",
            "transformers skips the eager mask checks for any FakeTensor"),
    Patched("torch.cuda.amp.common", ("amp_definitely_not_available",),
            "capture/fidelity/libraries.py", "autocast('cuda') turns itself off without a GPU"),
    Patched("torch.optim.optimizer", ("_foreach_supported_types",),
            "capture/fidelity/libraries.py", "foreach kernels are chosen for plain tensors only"),
    Patched("torch.utils._foreach_utils", ("_foreach_supported_types",),
            "capture/fidelity/libraries.py", "clip_grad_norm_'s foreach choice, likewise"),
    Patched("torch.cuda", ("is_bf16_supported",), "capture/fidelity/libraries.py",
            "autocast's bf16 check, as on the named GPU"),
    # torch.compile without compiling kernels, and inductor's CUDA path without a GPU
    Patched("torch._inductor.async_compile.AsyncCompile", INDUCTOR_KERNEL_COMPILERS,
            "capture/compiled.py",
            "kernels are generated but never compiled"),
    Patched("torch._inductor.config", ("force_disable_caches", "compile_threads"),
            "capture/compiled.py", "no compile caches, no compile workers (config.patch)"),
    Patched("torch._functorch.config", ("check_custom_op_aliasing", "activation_memory_budget"),
            "capture/compiled.py", "the partitioner's budget; no second mode around the Tape"),
    Patched("torch.cuda",
            ("is_available", "is_initialized", "_lazy_init", "device_count", "current_device",
             "set_device", "get_device_properties", "get_device_capability", "get_device_name",
             "synchronize", "_exchange_device", "_maybe_exchange_device", "_DeviceGuard",
             "get_rng_state", "set_rng_state", "is_current_stream_capturing"),
            "capture/gpu_less.py", "inductor's CUDA device queries, answered for the named GPU"),
    Patched("torch._dynamo.device_interface.CudaInterface",
            ("current_device", "set_device", "device_count", "get_device_properties",
             "synchronize", "is_bf16_supported", "exchange_device", "maybe_exchange_device"),
            "capture/gpu_less.py", "dynamo's copies of torch.cuda's functions, bound at import"),
    Patched("torch._subclasses.fake_tensor.FakeTensorMode", ("avoid_device_init",),
            "capture/gpu_less.py", "no device transfer of a constant runs for real"),
    Patched("torch._inductor.constant_folding.ConstantFolder", ("run",), "capture/gpu_less.py",
            "constant folding computes on the CPU"),
    Patched("torch._inductor.fx_passes.joint_graph.UniformValueConstantFolder", ("__init__",),
            "capture/gpu_less.py", "likewise"),
    Patched("torch._inductor.utils", ("get_device_tflops", "get_gpu_dram_gbps"),
            "capture/gpu_less.py", "inductor's datasheet figures, for the named GPU (pad_mm)"),
    Patched("torch._inductor.fx_passes.pad_mm", ("get_cached_should_pad",),
            "capture/gpu_less.py", "pad_mm's benchmark on the device: not padded"),
    Patched("triton.runtime.driver.driver", ("_active",), "capture/gpu_less.py",
            "Triton's CUDA driver for the named GPU, made without libcuda"),
    # a distributed profile: CUDA without a GPU, DTensor as in the eager step
    Patched("torch.cuda",
            ("current_device", "set_device", "device_count", "is_initialized", "Stream", "Event",
             "current_stream", "default_stream", "stream", "synchronize",
             "get_device_capability", "get_rng_state", "set_rng_state"),
            "distributed/cuda_standin.py",
            "FSDP2's and DeviceMesh's streams, events and device calls; pipelining's RNG fork"),
    Patched("torch.accelerator", ("current_stream",), "distributed/cuda_standin.py",
            "likewise"),
    Patched("torch._C", ("_get_accelerator",), "distributed/cuda_standin.py",
            "torch.accelerator answers 'cuda'"),
    *(Patched(m, ("_are_we_tracing",), "distributed/fidelity.py",
              "DTensor takes fake mode for torch.compile tracing") for m in TRACING_CHECK_MODULES),
    Patched("torch.distributed.tensor._sharding_prop.ShardingPropagator",
            ("_propagate_tensor_meta_non_cached",), "distributed/fidelity.py",
            "its metadata ops run unrecorded"),
    Patched("torch.distributed.tensor._sharding_prop.ShardingPropagator",
            ("propagate_op_sharding_non_cached",), "distributed/fidelity.py",
            "an earlier rank's decision re-bound to this rank's meshes (speed)"),
    Patched("torch.distributed.tensor._sharding_prop", ("_propagate_use_strided_shard_flag",),
            "distributed/fidelity.py", "once per op, not per list element (speed)"),
    Patched("torch.distributed.tensor._ops.utils", ("expand_to_full_mesh_op_strategy",),
            "distributed/fidelity.py", "memoised for the capture (speed)"),
    Patched("torch.distributed.tensor._sharding_prop", ("_expand_single_dim_strategy_to_mesh",),
            "distributed/fidelity.py", "a foreach op's equal elements expanded once (speed)"),
    Patched("torch.distributed.device_mesh.DeviceMesh", _MESH_TENSOR_METHODS,
            "distributed/fidelity.py", "the mesh's rank tensor is computed on for real"),
    Patched("torch.distributed._mesh_layout._MeshLayout", ("remap_to_tensor",),
            "distributed/fidelity.py", "likewise"),
    Patched("torch.distributed", ("isend", "irecv"), "distributed/fidelity.py",
            "point-to-point works hold their tensors, as gloo's and NCCL's do"),
    Patched("torch.distributed.distributed_c10d", ("isend", "irecv"), "distributed/fidelity.py",
            "likewise (P2POp compares the op with them by identity)"),
)



@_dataclass(frozen=True)
class Shortcut:
    """A decision of torch's that tapescope's own dispatch makes itself, the same way and
    faster. Nothing of torch is set (there is nothing for `patched` to apply), but the copy is
    catalogued here beside the patches: `copies` names torch's code, `by` where tapescope
    copies it. tests/test_torch_compat.py checks each against torch's own code on this
    install, so that a torch whose decision changed fails there, not in a profile's numbers."""

    name: str
    copies: str
    by: str
    why: str


SHORTCUTS = (
    Shortcut("prim.device", "torch/_subclasses/fake_tensor.py: _device_handler, "
             "FakeTensorMode's handler of prim.device",
             "capture/tape.py: _device_answer, from Tape.__torch_dispatch__",
             "`t.device` asked from C++ (~2,300 times a GPT-2 profile), answered without the "
             "~3 us of FakeTensorMode's dispatch; never recorded, no side effect"),
    Shortcut("foreign subclass", "torch/_subclasses/fake_tensor.py: _check_for_subclass_arg "
             "(FakeTensorMode._dispatch_impl returns NotImplemented for such an argument)",
             "capture/tape.py: _foreign_subclass, from Tape._declined",
             "every op of a parallelised step meets a DTensor first: NotImplemented without "
             "the ~30 us FakeTensorMode spends reaching it (a cache key tried, arguments "
             "flattened)"),
    Shortcut("_should_skip_dynamo", "torch/utils/_python_dispatch.py: "
             "TorchDispatchMode.__init_subclass__ wraps __torch_dispatch__ in "
             "torch._disable_dynamo unless _should_skip_dynamo() is False",
             "capture/tape.py: Tape._should_skip_dynamo, Tape.__torch_dispatch__ "
             "(dynamo_disable_is_a_call)",
             "the wrapper (~0.4 us an op, two more frames under every source-line walk) taken "
             "only where it does more than call: a compiled region runs, or a stance says so"),
)


# ---- the one way a catalogued attribute is set -----------------------------------------------

_NO_OWN_ENTRY = object()   # the owner had no entry of its own: what it inherits shows through
_ModuleType = type(sys)


def _loaded(dotted: str):
    """The module, class or object `dotted` names if its module is imported, else None (an
    object not loaded yet cannot be the one being patched; nothing is imported here)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        obj = sys.modules.get(".".join(parts[:i]))
        if obj is not None:
            for attr in parts[i:]:
                # a module's own entries only: its __getattr__ would import (torch._dynamo)
                obj = vars(obj).get(attr) if isinstance(obj, _ModuleType) else \
                    getattr(obj, attr, None)
            return obj
    return None


def _catalogued_names(owner, wanted) -> set:
    """Which of the names `wanted` PATCHED lists for `owner` (the very object)."""
    out = set()
    for p in PATCHED:
        if not wanted.isdisjoint(p.names) and _loaded(p.owner) is owner:
            out.update(p.names)
    return out & wanted


def _is_config_module(owner) -> bool:
    from torch.utils._config_module import ConfigModule

    return isinstance(owner, ConfigModule)


@_contextmanager
def patched(owner, **values):
    """Set `owner.NAME = value` for each of `values` while the block runs, then put back each
    as it was, error or not: an entry the owner held itself gets its very object back (a
    classmethod as stored, not as bound); one it inherited or lacked is deleted again, so that
    what shows through is what did before. A torch config module (inductor's, functorch's) is
    patched by its own `patch`, which keeps its record of user overrides right.

    The one way tapescope sets an attribute of torch or of a library it drives, here as in
    `mem_tracker`'s single `__enter__`: each (owner, name) must be in PATCHED, and
    tests/test_patches.py fails on any setattr or attribute assignment to torch elsewhere.
    Patches nest: an inner block restores the outer block's value."""
    unknown = set(values) - _catalogued_names(owner, set(values))
    if unknown:
        raise RuntimeError(f"tapescope: {getattr(owner, '__name__', owner)!s}."
                           f"{', '.join(sorted(unknown))} is not in torch_compat.PATCHED: add "
                           "an entry saying who sets it and why")
    if _is_config_module(owner):
        with owner.patch(**values):
            yield
        return
    own = vars(owner)
    saved = {name: own.get(name, _NO_OWN_ENTRY) for name in values}
    try:
        for name, value in values.items():
            setattr(owner, name, value)
        yield
    finally:
        for name, was in saved.items():
            if was is not _NO_OWN_ENTRY:
                setattr(owner, name, was)
            elif name in vars(owner):
                delattr(owner, name)


# ---- the optimizer step outside the capture's function mode (capture/optimizers.py) -----------

@_contextmanager
def function_mode_lifted(mode):
    """`mode` off the torch function mode stack inside, where it is the innermost one (the
    stack's top); otherwise nothing changes. Restored on exit, error or not."""
    n = torch._C._len_torch_function_stack()
    if not n or torch._C._get_function_stack_at(n - 1) is not mode:
        yield
        return
    torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)


def optimizer_step_hooked(optimizer) -> bool:
    """Does `optimizer.step()` run hooks (its own or every optimizer's: torch/optim/optimizer.py,
    `profile_hook_step`)? Those are the user's code."""
    from torch.optim import optimizer as _optimizer

    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or _optimizer._global_optimizer_pre_hooks
                or _optimizer._global_optimizer_post_hooks)
