"""The model's private copy: profiling never changes what the user's model holds.

The trace runs the user's own code on fake tensors. Whatever that code writes - a tensor cached in
a dict attribute on the first call, an entry of a `functools.lru_cache`, a list a closure appends
to - must land in a copy, or the user's model would hold fake tensors afterwards and fail on real
data. So before the trace, everything the model reaches that can hold state gets a private copy:

- modules: copied shallowly (code, config and hooks stay the user's), their parameters, buffers
  and tensor attributes replaced by fake tensors (each original once, so tied weights stay tied);
- state reachable from module attributes: containers (dict, list, set, deque, tuple), plain
  objects with a `__dict__`, functions with closures or mutable defaults, partials, bound methods
  (rebound to the copy of their module) and lru_cache wrappers (a fresh, empty cache around the
  same function), recursively; a tensor found there becomes a fake one (its device kept);
- state the model's code reads by name: the globals and class attributes named by the modules'
  `forward` methods and hooks, and by the methods and functions they name in turn (a few levels
  deep), and the closure cells of that code, when they are caches (lru_cache wrappers) or mutable
  containers. These names (and cells) are bound to private copies for the
  duration of the trace and restored afterwards (as the hook registry does with torch's hook
  entry points): the user's objects themselves are never written.

What cannot be copied (an object that refuses `copy.copy`) is shared and named in
`notes`; after the trace, `leaks(model)` walks what the model reaches once more and names any
place that ended up holding a fake tensor, so the profile can say so.

Not covered: state reached only through attributes of imported modules (`utils.CACHE[k] = t`),
through C extensions, or through code more than `SCAN_DEPTH` calls away from the model's methods.
"""

from __future__ import annotations

import builtins
import collections
import copy
import enum
import functools
import types
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ..errors import source_dirs
from ..torch_compat import OPERATOR_TYPES

__all__ = ["Isolation", "SCAN_DEPTH"]

SCAN_DEPTH = 3  # calls from a model method to a function whose globals are still scanned
# library code: its globals are torch's or Python's own, never a model's state (errors.SourceDirs)
_LIBRARY_DIRS = (source_dirs().torch, source_dirs().stdlib)

_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype, torch.device,
          torch.Size, torch.memory_format, torch.layout, enum.Enum, type, types.ModuleType,
          types.BuiltinFunctionType, types.BuiltinMethodType, types.CodeType,
          torch.Generator, type(Ellipsis), type(NotImplemented), slice, *OPERATOR_TYPES)
_EXACT_ATOMS = frozenset((type(None), bool, int, float, str, bytes, torch.dtype, torch.device,
                          torch.Size))  # the common case, by one set lookup
_BUILTIN_NAMES = frozenset(dir(builtins))
_MUTABLE_CONTAINERS = (dict, list, set, collections.deque, bytearray)
_LRU = type(functools.lru_cache(None)(lambda: None))
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")


class Isolation:
    """Private copies of a model and of the state its code reaches (see the module docstring).

    make_module_tensor(t): the fake of a parameter, buffer or tensor attribute of a module;
    make_state_tensor(t): the fake of a tensor found in other state (caches, closures, globals).
    """

    def __init__(self, make_module_tensor: Callable, make_state_tensor: Callable):
        self._make_module_tensor = make_module_tensor
        self._make_state_tensor = make_state_tensor
        self._memo: dict[int, object] = {}
        self._keep: list = []           # originals whose ids key the memo stay alive meanwhile
        self.notes: list[str] = []       # what could not be isolated, and why
        self._swaps: list = []           # (namespace, name, private value) bound during the trace

    # ---- the copy -----------------------------------------------------------------------

    def copy_model(self, model: nn.Module) -> nn.Module:
        fake = self._copy(model, "model")
        self._find_named_state(model)
        # the memo only pairs originals with copies while copying; kept, it would hold every fake
        # parameter alive after a parallelize step replaced it (FSDP2 shards them), and the
        # trace would count them to the end of the step
        self._memo.clear()
        self._keep.clear()
        return fake

    def _remember(self, original, private):
        self._memo[id(original)] = private
        self._keep.append(original)
        return private

    def _tensor(self, t: torch.Tensor, make: Callable) -> torch.Tensor:
        r = self._memo.get(id(t))
        if r is None:
            r = self._remember(t, make(t))
        return r

    def _copy(self, x, where: str):
        """A private copy of `x` if it can hold state, else `x` itself."""
        if type(x) in _EXACT_ATOMS or isinstance(x, _ATOMS):
            return x
        known = self._memo.get(id(x))
        if known is not None:
            return known
        if isinstance(x, torch.Tensor):
            return self._tensor(x, self._make_state_tensor)
        if isinstance(x, nn.Module):
            return self._module(x, where)
        if isinstance(x, (list, set, collections.deque, frozenset)):
            new = self._remember(x, _empty_like(x))
            items = [self._copy(v, f"{where}[]") for v in x]
            if isinstance(x, frozenset):
                new = self._remember(x, frozenset(items) if any(
                    a is not b for a, b in zip(items, x)) else x)
            else:
                _fill(new, items)
            return new
        if isinstance(x, tuple):
            items = [self._copy(v, f"{where}[{i}]") for i, v in enumerate(x)]
            if all(a is b for a, b in zip(items, x)):
                return self._remember(x, x)
            new = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            return self._remember(x, new)
        if isinstance(x, dict):
            try:
                new = copy.copy(x)  # keeps the type (OrderedDict, defaultdict's factory ...)
            except Exception as e:  # noqa: BLE001 - an exotic dict subclass
                return self._shared(x, where, e)
            self._remember(x, new)
            for k, v in x.items():
                dict.__setitem__(new, k, self._copy(v, f"{where}[{k!r}]"))
            return new
        if isinstance(x, _LRU):
            return self._remember(x, _fresh_lru(x))
        if isinstance(x, types.FunctionType):
            return self._function(x, where)
        if isinstance(x, types.MethodType):
            owner = self._copy(x.__self__, where)
            func = self._copy(x.__func__, where)
            if owner is x.__self__ and func is x.__func__:
                return self._remember(x, x)
            return self._remember(x, types.MethodType(func, owner))
        if isinstance(x, functools.partial):
            func = self._copy(x.func, where)
            args = self._copy(x.args, where)
            kwargs = self._copy(x.keywords, where)
            if func is x.func and args is x.args and kwargs is x.keywords:
                return self._remember(x, x)
            return self._remember(x, functools.partial(func, *args, **kwargs))
        if isinstance(x, (staticmethod, classmethod)):
            inner = self._copy(x.__func__, where)
            return self._remember(x, x if inner is x.__func__ else type(x)(inner))
        if hasattr(x, "__dict__"):
            return self._object(x, where)
        return x  # opaque (a C object, a callable instance): shared

    def _shared(self, x, where: str, why) -> object:
        self.notes.append(f"{where} ({type(x).__name__}) is shared with the model: tapescope "
                          f"cannot copy it ({why}); the trace writes it only if the model's "
                          "code does")
        return self._remember(x, x)

    def _object(self, x, where: str):
        """A plain object: copied when something it holds is (a cache dict, a tensor)."""
        self._remember(x, x)  # until we know: cycles back to it see the original
        state = {k: self._copy(v, f"{where}.{k}") for k, v in vars(x).items()}
        if all(state[k] is v for k, v in vars(x).items()) and not _holds_mutable(vars(x)):
            return x
        try:
            new = copy.copy(x)
        except Exception as e:  # noqa: BLE001 - objects that refuse to be copied
            self._memo.pop(id(x))
            return self._shared(x, where, e)
        try:
            vars(new).update(state)
        except TypeError as e:  # a read-only __dict__ (a mappingproxy)
            self._memo.pop(id(x))
            return self._shared(x, where, e)
        return self._remember(x, new)

    def _function(self, f: types.FunctionType, where: str):
        """A function whose closure cells or defaults hold state gets its own cells/defaults."""
        cells = f.__closure__ or ()
        contents = []
        for c in cells:
            try:
                contents.append(c.cell_contents)
            except ValueError:  # an empty cell (a name assigned later)
                contents.append(_EMPTY)
        new_contents = [v if v is _EMPTY else self._copy(v, f"{where} (closure of "
                                                             f"{f.__qualname__})")
                        for v in contents]
        defaults = self._copy(f.__defaults__, where) if f.__defaults__ else f.__defaults__
        kwdefaults = f.__kwdefaults__
        if kwdefaults:
            # the state is in the values (`*, cache={}`), not in the dict that holds them: a
            # function whose keyword defaults all stay stays itself. Its identity matters beyond
            # state: dynamo recognizes torch's functions by it (`torch.utils.checkpoint.checkpoint`
            # is traced as a higher-order op, a copy of it is a function dynamo skips)
            values = {k: self._copy(v, where) for k, v in kwdefaults.items()}
            if any(values[k] is not v for k, v in kwdefaults.items()):
                kwdefaults = values
        if (all(a is b for a, b in zip(new_contents, contents)) and defaults is f.__defaults__
                and kwdefaults is f.__kwdefaults__):
            return self._remember(f, f)
        closure = tuple(types.CellType() if v is _EMPTY else types.CellType(v)
                        for v in new_contents) or None
        new = types.FunctionType(f.__code__, f.__globals__, f.__name__, defaults, closure)
        new.__kwdefaults__ = kwdefaults
        new.__dict__.update(f.__dict__)
        new.__qualname__, new.__module__, new.__doc__ = f.__qualname__, f.__module__, f.__doc__
        return self._remember(f, new)

    def _module(self, m: nn.Module, where: str) -> nn.Module:
        new = _shallow_copy(m)
        self._remember(m, new)
        d = new.__dict__
        for k, v in list(d.items()):
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(v, torch.Tensor):
                d[k] = self._tensor(v, self._make_module_tensor)
            elif k in _HOOK_DICTS and isinstance(v, dict):
                d[k] = type(v)(v)  # our copy may gain hooks; the user's module must not
            else:
                d[k] = self._copy(v, f"{where}.{k}")
        make = self._make_module_tensor
        d["_parameters"] = {k: None if p is None else self._tensor(p, make)
                            for k, p in m._parameters.items()}
        d["_buffers"] = {k: None if b is None else self._tensor(b, make)
                         for k, b in m._buffers.items()}
        d["_modules"] = {k: None if c is None else self._module_child(c, where, k)
                         for k, c in m._modules.items()}
        if m.__dict__.get("_compiled_call_impl") is not None:
            # Module.compile() was called on it; copy.copy drops the compiled call
            # (Module.__getstate__), which would run the user's module anyway. The copy keeps the
            # mark, running its own code: capture compiles it (compile=) or says it ran eagerly
            d["_compiled_call_impl"] = new._call_impl
        return new

    def _module_child(self, c, where, name):
        known = self._memo.get(id(c))
        return known if known is not None else self._module(c, f"{where}.{name}")

    # ---- state the code names ---------------------------------------------------------------

    def _find_named_state(self, model: nn.Module) -> None:
        """Globals and class attributes the model's code names that can hold state: bound to
        private copies during the trace (see `shadows`).

        The code followed: each module class's `forward` and forward hooks, then every method of
        the class, global function or closure that code names, `SCAN_DEPTH` calls deep."""
        classes = []  # user classes of the model's modules, most derived first
        for m in model.modules():
            for cls in type(m).__mro__:
                if cls not in classes and not _is_library_class(cls):
                    classes.append(cls)
        members: dict = {}  # attribute name -> [(class, raw value)] over the model's classes
        for cls in classes:
            for name, v in vars(cls).items():
                if not name.startswith("__"):
                    members.setdefault(name, []).append((cls, v))
        work = []  # (function, depth)
        for cls in classes:
            fwd = vars(cls).get("forward")
            if isinstance(fwd, types.FunctionType):
                work.append((fwd, 0))
        for m in model.modules():
            for hooks in (m._forward_hooks, m._forward_pre_hooks):
                work.extend((h, 0) for h in hooks.values() if isinstance(h, types.FunctionType))
        # a function is scanned once per (code, globals, closure cells): closures of one code
        # object (hooks made by one factory) each hold their own state, and code objects compare
        # equal across files (their equality ignores co_filename)
        seen_functions, seen_ns = set(), set()
        while work:
            f, depth = work.pop()
            if not isinstance(f, types.FunctionType) or _is_library_code(f.__code__):
                continue
            key = (id(f.__code__), id(f.__globals__), tuple(map(id, f.__closure__ or ())))
            if key in seen_functions:
                continue
            seen_functions.add(key)
            g = f.__globals__
            names = _global_names(f.__code__)
            for name in names:
                for cls, v in members.get(name, ()):  # self.name / type(self).name / Cls.name
                    raw = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
                    if isinstance(v, property):
                        work.extend((h, depth + 1) for h in (v.fget, v.fset) if h is not None)
                    elif isinstance(raw, types.FunctionType):
                        work.append((raw, depth + 1))
                    elif _stateful(raw) and (id(cls), name) not in seen_ns:
                        seen_ns.add((id(cls), name))
                        self._swaps.append((cls, name, self._copy(v, f"{cls.__qualname__}.{name}")))
                if name not in g:
                    continue
                v = g[name]
                key = (id(g), name)
                if _stateful(v) and key not in seen_ns:
                    seen_ns.add(key)
                    self._swaps.append((g, name, self._copy(v, f"global {name} of "
                                                              f"{g.get('__name__', '?')}")))
                elif isinstance(v, types.FunctionType) and depth < SCAN_DEPTH:
                    work.append((v, depth + 1))
            for name, cell in zip(f.__code__.co_freevars, f.__closure__ or ()):
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                if _stateful(v) and id(cell) not in seen_ns:
                    # a cache or container the code reaches through its closure (a cache made
                    # inside the function that defines the model): the cell is bound to a private
                    # copy, as a global is
                    seen_ns.add(id(cell))
                    self._swaps.append((cell, name, self._copy(
                        v, f"{name} (closure of {f.__qualname__})")))
                elif isinstance(v, types.FunctionType) and depth < SCAN_DEPTH:
                    work.append((v, depth + 1))

    @contextmanager
    def shadows(self):
        """Bind the named state to its private copies for the duration of the block."""
        done = []
        try:
            for ns, name, private in self._swaps:
                if isinstance(ns, types.CellType):
                    done.append((ns, name, ns.cell_contents))
                    ns.cell_contents = private
                elif isinstance(ns, dict):
                    done.append((ns, name, ns.get(name, _EMPTY)))
                    ns[name] = private
                else:
                    done.append((ns, name, vars(ns).get(name, _EMPTY)))
                    setattr(ns, name, private)
            yield
        finally:
            for ns, name, original in reversed(done):
                if isinstance(ns, types.CellType):
                    ns.cell_contents = original
                elif isinstance(ns, dict):
                    if original is _EMPTY:
                        ns.pop(name, None)
                    else:
                        ns[name] = original
                elif original is _EMPTY:
                    delattr(ns, name)
                else:
                    setattr(ns, name, original)

    # ---- after the trace ----------------------------------------------------------------------

    def leaks(self, model: nn.Module) -> list[str]:
        """Places the user's model reaches that hold a fake tensor after the trace."""
        from ..torch_compat import FakeTensor

        found, seen = [], set()

        def walk(x, where, depth=0):
            if depth > 8 or isinstance(x, _ATOMS) or id(x) in seen:
                return
            seen.add(id(x))
            if isinstance(x, FakeTensor):
                found.append(where)
            elif isinstance(x, torch.Tensor):
                return
            elif isinstance(x, dict):
                for k, v in list(x.items()):
                    walk(v, f"{where}[{k!r}]", depth + 1)
            elif isinstance(x, (list, tuple, set, frozenset, collections.deque)):
                for v in list(x):
                    walk(v, f"{where}[]", depth + 1)
            elif isinstance(x, nn.Module):
                for k, v in vars(x).items():
                    walk(v, f"{where}.{k}", depth + 1)
            elif hasattr(x, "__dict__") and not isinstance(x, (types.FunctionType, type)):
                for k, v in list(vars(x).items()):
                    walk(v, f"{where}.{k}", depth + 1)

        walk(model, "model")
        for ns, name, _ in self._swaps:
            if isinstance(ns, types.CellType):
                walk(ns.cell_contents, f"{name} (a closure's)")
                continue
            value = ns.get(name) if isinstance(ns, dict) else vars(ns).get(name)
            walk(value, f"global {name}" if isinstance(ns, dict) else f"{ns.__qualname__}.{name}")
        return [f"{w} holds a fake tensor after the trace: tapescope could not isolate it"
                for w in found]


_EMPTY = object()


def _shallow_copy(m: nn.Module) -> nn.Module:
    """copy.copy, also for a module with parametrizations (weight_norm, spectral_norm,
    orthogonal): torch gives its class a __getstate__ that refuses serialization, which copy.copy
    goes through. The copy keeps that class, so reading `weight` runs the parametrization's
    forward on the copy's tensors inside the step, as it does in a real run."""
    if not parametrize.is_parametrized(m):
        return copy.copy(m)
    new = object.__new__(type(m))
    new.__dict__.update(m.__dict__)
    return new


def _empty_like(x):
    if isinstance(x, collections.deque):
        return collections.deque(maxlen=x.maxlen)
    return type(x)() if type(x) in (list, set) else copy.copy(x)


def _fill(new, items) -> None:
    if isinstance(new, list):
        new[:] = items
    elif isinstance(new, collections.deque):
        new.clear()
        new.extend(items)
    else:
        new.clear()
        new.update(items)


def _holds_mutable(d: dict) -> bool:
    return any(isinstance(v, _MUTABLE_CONTAINERS) or isinstance(v, _LRU) for v in d.values())


def _stateful(v) -> bool:
    """A global or class attribute worth a private copy: a cache or a mutable container."""
    if isinstance(v, (staticmethod, classmethod)):
        v = v.__func__
    return isinstance(v, _LRU) or type(v) in (dict, list, set, collections.deque,
                                              collections.OrderedDict, collections.defaultdict)


def _fresh_lru(f):
    """A new, empty cache around the same function, with the same size and typing."""
    params = f.cache_parameters() if hasattr(f, "cache_parameters") else {"maxsize": 128,
                                                                          "typed": False}
    new = functools.lru_cache(maxsize=params["maxsize"], typed=params["typed"])(f.__wrapped__)
    functools.update_wrapper(new, f.__wrapped__)
    return new


def _is_library_code(code) -> bool:
    fn = code.co_filename
    return fn.startswith(_LIBRARY_DIRS) or fn.startswith("<")


def _is_library_class(cls) -> bool:
    return cls is object or (cls.__module__ or "").split(".", 1)[0] in ("torch", "builtins")


def _global_names(code) -> set:
    """Names a code object (and the code nested in it: lambdas, comprehensions) may read as
    globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names - _BUILTIN_NAMES
