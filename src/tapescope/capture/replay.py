"""A faster front for FakeTensorMode's dispatch cache.

FakeTensorMode caches the output metadata of each op by the metadata of its arguments, but building
its cache key costs more than running most meta kernels (~60% of a cached dispatch goes to
`_cache_key`). A training step repeats the same op on the same shapes many times (every layer,
every parameter of the optimizer), so we keep a second cache in front of it with a cheap key:
the op, each tensor argument's (shape, stride, dtype, device, offset, requires_grad), the other
arguments as they are, and the default dtype and device.

Only what FakeTensorMode itself found cacheable is replayed (its bypass counter did not move while
it ran the op, less the refusals of ops it ran inside it: `_IGNORED_BYPASSES`): constants,
symbolic sizes, data-dependent and metadata-mutating ops all go through it every time. A hit
rebuilds the outputs the way FakeTensorMode rebuilds a cache hit (an empty meta tensor wrapped as
a FakeTensor, sharing the input's storage for a view; the wrapping by
torch_compat.FakeTensorFactory, which makes what FakeTensor's constructor makes without its
Python); many plain views of one argument (FSDP2's chunk of a parameter) are made by one call of
the op's meta kernel and checked against what FakeTensorMode made; an in-place op just returns
the argument it mutates. If replaying ever fails (a torch version whose internals differ), the
front switches itself off and every op goes through FakeTensorMode.
"""

from __future__ import annotations

import torch
from ..torch_compat import (FakeTensor, FakeTensorFactory, FakeTensorMode, OpOverload,
                            default_device, disable_torch_dispatch, disable_torch_function,
                            fake_cache_bypasses, functional_collective_ops,
                            has_composite_implicit_kernel,
                            kernel_invocation, no_dispatch, untyped_storage_key)

# 0-d literals of these dtypes get an `.item()` memo from FakeTensorMode (fake_tensor.py)
_ITEM_MEMO_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.float64)

__all__ = ["DispatchReplay"]

_INPLACE, _NONE, _ALIAS = "inplace", "none", "alias"
_SCALAR, _NOT_CONSTANT = "scalar", "not constant"  # what constant_op may answer
_MANY_VIEWS = 8  # outputs, all views of one argument: replayed by running the op (replay)
_META = torch.device("meta")  # the string "meta" is parsed anew for each tensor (~0.3 us)

# Python numbers that compare and hash equal across types (1 == 1.0 == True == 1+0j) but promote
# differently (an int64 tensor plus 1 stays int64, plus 1.0 is float32): keyed with their type, as
# FakeTensorMode's own cache key does (`_prep_args_for_hash`). An int needs no mark: every other
# number is marked, and no other argument type compares equal to an int
_TYPED_NUMBERS = frozenset({float, bool, complex})
_BY_TYPE = {t: ("a number, by its type", t) for t in _TYPED_NUMBERS}  # see _VALUE_FREE_NUMBERS

# Ops whose float, bool and complex numbers (a Scalar argument, or a number passed for a Tensor:
# a wrapped number) enter their output's metadata and their checks by their type alone, so the
# front keys those numbers by type (_BY_TYPE) and one entry serves every value. All are
# TensorIterator's pointwise arithmetic: the C++ meta functions (BinaryOps.cpp `add`, `sub`,
# `mul`, `div`: build_borrowing_binary_(float_)op and alpha_check, which asks only whether alpha is
# integral, boolean or complex; PointwiseOps.cpp `addcmul`, `addcdiv`: build_ternary_op; Lerp.cpp
# `lerp_Scalar`: a dtype check and build_binary_op) and FakeTensorMode's Python ones
# (_meta_registrations.py `meta_binop_inplace(_alpha)`, elementwise_meta; fake_impls.py's fast
# binary path) promote by the number's kind and never read its value. What it saves: an optimizer
# step's bias corrections (`div` by the second one, `addcdiv_(value=-step_size)`) change with the
# step, so step 2 missed the front once per parameter shape. Ints stay keyed by value (a dim, a
# size): not needed, and cheaper. Not here, so keyed by value: `pow` (an integer tensor to a
# negative integer power is an error), and anything else not read for this.
_aten = torch.ops.aten
_VALUE_FREE_POINTWISE = frozenset(
    getattr(getattr(_aten, name), overload)
    for name in ("add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_")
    for overload in ("Tensor", "Scalar")) | frozenset(
    (_aten.addcdiv.default, _aten.addcdiv_.default, _aten.addcmul.default,
     _aten.addcmul_.default, _aten.lerp.Scalar, _aten.lerp_.Scalar))

# The same for the foreach forms of that arithmetic, their numbers and lists of numbers alike:
# FakeTensorMode runs a foreach op's meta kernel (fake_impls.py,
# `foreach_run_and_map_input_device`): the per-tensor loop over the ops above (ForeachOpsKernels.cpp,
# the `_slow` kernels) or _meta_registrations.py's `meta__foreach_binop_*`, which check the lists'
# lengths and make each output like its input: the numbers enter by their kind alone again.
# What it saves: a foreach Adam step (the default on CUDA) passes its bias corrections as lists
# of floats (`_foreach_div_(sqrts, bias_correction2_sqrt)`, `_foreach_addcdiv_(params, avgs,
# denoms, step_size)`), new values every step, so step 2 missed the front for each of them.
# (each overload where this torch has it: `lerp`'s ScalarList forms are recent)
_VALUE_FREE_FOREACH = frozenset(
    getattr(packet, overload)
    for name in ("add", "sub", "mul", "div", "addcdiv", "addcmul", "lerp")
    for packet in (getattr(_aten, f"_foreach_{name}"), getattr(_aten, f"_foreach_{name}_"))
    for overload in ("Scalar", "ScalarList") if overload in packet.overloads())
_VALUE_FREE_NUMBERS = _VALUE_FREE_POINTWISE | _VALUE_FREE_FOREACH


class _NoKey(Exception):
    pass


# FakeTensor.layout is a Python property (fake_tensor.py): mkldnn where the tensor's
# `dispatch_keys` say so (set for an mkldnn tensor only), else the tensor's own layout. A key
# takes the tensor's own layout where `dispatch_keys` is unset and leaves the rest to
# FakeTensorMode: the same tensors keyed, without the property's two Python calls (~0.3 ->
# ~0.12 us; ~6,300 tensor keys a GPT-2 profile)
_OWN_LAYOUT, _STRIDED = torch.Tensor.layout.__get__, torch.strided


def _tensor_key(t):
    if (type(t) is not FakeTensor or t.constant is not None or t.dispatch_keys is not None
            or _OWN_LAYOUT(t) is not _STRIDED):
        raise _NoKey
    # `fake_device` is what `device` answers outside a kernel invocation (the front runs outside
    # one), without the property's Python call
    # (`size()`, the method: the same torch.Size as the `shape` property, ~50 ns cheaper)
    return (t.size(), t.stride(), t.dtype, t.fake_device, t.storage_offset(), t.requires_grad,
            t.is_conj(), t.is_neg())


def _sym(x):
    """A size as a hashable key: SymInts by their expression (same expression, same size), a number
    other than an int with its type (_TYPED_NUMBERS)."""
    if isinstance(x, torch.SymInt):
        return x.node.expr
    return (type(x), x) if type(x) in _TYPED_NUMBERS else x


def _tensor_key_symbolic(t):
    if (type(t) is not FakeTensor or t.constant is not None or t.dispatch_keys is not None
            or _OWN_LAYOUT(t) is not _STRIDED):
        raise _NoKey
    return (tuple(_sym(s) for s in t.shape), tuple(_sym(s) for s in t.stride()), t.dtype,
            t.device, _sym(t.storage_offset()), t.requires_grad, t.is_conj(), t.is_neg())


def _number(func, a):
    """A float, bool or complex argument of `func` as a key: by its type where `func`'s output does
    not depend on its value (_VALUE_FREE_NUMBERS), else with its type."""
    return _BY_TYPE[type(a)] if func in _VALUE_FREE_NUMBERS else (type(a), a)


def _key(func, args, kwargs):
    """The key of an op on concrete sizes: every argument as it is (a number other than an int
    with its type, or by its type alone: `_number`), tensors by `_tensor_key`. None where a tensor
    argument has no key (a constant, a sparse tensor); may be unhashable."""
    key = [func, torch.get_default_dtype(), default_device()]
    append = key.append
    typed = _TYPED_NUMBERS
    try:
        for a in args:
            if isinstance(a, torch.Tensor):
                append(_tensor_key(a))
            elif isinstance(a, (list, tuple)):
                append(tuple(_tensor_key(x) if isinstance(x, torch.Tensor)
                             else _number(func, x) if type(x) in typed else x for x in a))
            elif type(a) in typed:  # _number, inline: a Scalar argument (an optimizer's floats)
                append(_BY_TYPE[type(a)] if func in _VALUE_FREE_NUMBERS else (type(a), a))
            else:
                append(a)
        for name, a in kwargs.items():
            append((name, _tensor_key(a) if isinstance(a, torch.Tensor)
                    else _number(func, a) if type(a) in typed else a))
        # not hashed here: `find` looks it up, and an unhashable argument fails there (a key is
        # hashed once an op, ~0.5 us for three tensors)
        return tuple(key)
    except _NoKey:
        return None


def _key_symbolic(func, args, kwargs):
    key = [func, torch.get_default_dtype(), default_device()]
    try:
        for a in (*args, *kwargs.items()):
            if isinstance(a, torch.Tensor):
                key.append(_tensor_key_symbolic(a))
            elif isinstance(a, (list, tuple)):
                key.append(tuple(_tensor_key_symbolic(x) if isinstance(x, torch.Tensor) else _sym(x)
                                 for x in a))
            else:
                key.append(_sym(a))
        key = tuple(key)
        hash(key)
        return key
    except (_NoKey, TypeError):  # constants, sparse, SymInts (unhashable) ...
        return None


def _symbolic_storage_numel(t, view_of):
    """Elements of a fresh output's storage when its sizes are symbolic (else None), if that is an
    exact expression (no floor division left)."""
    if view_of is not None or t.requires_grad or not any(
            isinstance(x, torch.SymInt) for x in (*t.shape, *t.stride())):
        return None
    numel = t.untyped_storage().nbytes() // t.element_size()
    if isinstance(numel, torch.SymInt) and "FloorDiv" in str(numel.node.expr):
        return None
    return numel


# Custom ops FakeTensorMode never caches only because they are not aten's ("non-builtin"), whose
# fake kernels make a fresh tensor from the arguments' metadata and plain values alone: the
# functional collectives of tensor parallelism and FSDP2 (C++ meta kernels of
# torch/csrc/distributed/c10d/Functional.cpp: the input's size with dim 0 times / divided by the
# group size; `_wrap_tensor_autograd`'s registered fake is `empty_like(input)`), ~300 us each
# through FakeTensorMode, several per layer and micro-batch of a pipelined TP step.
_PURE_CUSTOM_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "_wrap_tensor_autograd")


# FakeTensorMode's reasons for refusing to cache an op (its `cache_bypasses` counter, by reason)
# that do not stop the front from learning `func`: rule(func, pure_custom) -> True where the
# reason, moving while `func` ran, says nothing about `func` itself. A reason no rule names always
# stops it. The counter also moves for the ops FakeTensorMode runs inside `func` (a decomposition's
# own ops), and those refusals are theirs, not `func`'s.
_IGNORED_BYPASSES = {
    # FakeTensorMode refuses `_unsafe_view` only because the schema hides that the output aliases
    # the input, which `_entry` sees from the storages (every linear on a 3-d input ends in one)
    "unsafe view": lambda func, pure_custom: True,
    # refused for not being aten's: _PURE_CUSTOM_OPS are pure functions of metadata all the same
    "non-builtin": lambda func, pure_custom: func in pure_custom,
    # raised (fake_tensor.py, `_validate_cache_key`) only for a view op with a
    # CompositeImplicitAutograd kernel. For any other `func` it came from an op inside it (the
    # decompositions of addmm, gelu_backward, native_layer_norm_backward, _log_softmax ... cast
    # with `aten.to.dtype`, such a view); a refusal of `func` itself moves another reason. So
    # FakeTensorMode cached `func`: its second call would be FakeTensorMode's cache hit, which
    # the front learns; this learns the same output a call earlier
    "CompositeImplicitAutograd": lambda func, pure_custom: isinstance(func, OpOverload) and not (
        func.is_view and has_composite_implicit_kernel(func)),
    # raised (`_validate_output_for_cache_entry`) for an output that is not one FakeTensor or a
    # tuple of them: FakeTensorMode's cache entry has no place for a list. For an op returning one
    # `Tensor[]` (a foreach op's outputs, a split's views) that says nothing about the op:
    # `_entry` learns the list only where every element is a plain FakeTensor, each fresh or a
    # view of an argument itself (not of a list's element). A foreach Adam step's out-of-place
    # ops (`_foreach_sqrt`, `_foreach_add`: a list of new tensors) ran through FakeTensorMode
    # every step, ~4 ms each for GPT-2's 148 parameters
    "non-FakeTensor output": lambda func, pure_custom: isinstance(func, OpOverload)
    and _returns_a_list(func),
}


def _returns_a_list(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def _ignored_bypasses(func, pure_custom) -> tuple:
    """The reasons of _IGNORED_BYPASSES that do not stop the front from learning `func`."""
    return tuple(reason for reason, ignores in _IGNORED_BYPASSES.items()
                 if ignores(func, pure_custom))


def _constant_kind(func) -> str:
    """How `DispatchReplay.constant_op` may answer `func` on constants: _INPLACE (it mutates its
    first argument), _SCALAR (it returns one number) or _NOT_CONSTANT, from its tags and schema."""
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.inplace_view in tags:
        return _NOT_CONSTANT
    returns = func._schema.returns
    if torch.Tag.inplace in tags and len(returns) == 1:
        return _INPLACE
    if len(returns) == 1 and not isinstance(returns[0].type, torch.TensorType):
        return _SCALAR
    return _NOT_CONSTANT


class DispatchReplay:
    def __init__(self, mode: FakeTensorMode):
        self.mode = mode
        self.entries: dict = {}
        self._constant_kinds: dict = {}  # op -> _constant_kind(op)
        self._ignored: dict = {}  # op -> _ignored_bypasses(op)
        self.enabled = True
        self._fakes = FakeTensorFactory(mode)
        self._pure_custom = functional_collective_ops(_PURE_CUSTOM_OPS)

    def find(self, func, args, kwargs) -> tuple:
        """(key, entry): the op's key (None where it has none: then entry is None too) and the
        entry learned for it (None if none yet)."""
        if not self.enabled:
            return None, None
        key = (_key if self.mode.shape_env is None else _key_symbolic)(func, args, kwargs)
        if key is None:
            return None, None
        try:
            return key, self.entries.get(key)
        except TypeError:  # an unhashable argument: no key
            return None, None

    def literal(self, real):
        """The fake of a tensor literal (`torch.tensor(0.)`, lifted by aten.lift_fresh), as
        FakeTensorMode makes it: a constant holding a copy of the value. FakeTensorMode builds it
        through MetaConverter, ~1 ms a literal, and a for-loop Adam step makes one per parameter
        (its `step` counters); this is ~20 us. None where FakeTensorMode would do more than that:
        no constant, or a 0-d integer / float64 literal, for which it also memoises `.item()`."""
        mode = self.mode
        if (type(real) is not torch.Tensor or not mode.may_turn_const(real) or real.requires_grad
                or real.layout != torch.strided or real.is_conj() or real.is_neg()
                or (real.dim() == 0 and real.dtype in _ITEM_MEMO_DTYPES)):
            return None
        try:
            with no_dispatch():
                const = real.clone()
                meta = torch.empty_strided(const.shape, const.stride(), dtype=const.dtype,
                                           device=_META)
                if const.device.type == "cpu":  # a device FakeTensor leaves as it is
                    # FakeTensor(mode, meta, device, constant=const) without its Python
                    # (FakeTensorFactory): the constant is a plain attribute it sets last
                    made = self._fakes.make(meta, const.device)
                    made.constant = const  # the instance's own attribute, as FakeTensor's is
                    out = made
                else:
                    out = FakeTensor(mode, meta, const.device, constant=const)
            mode.fake_tensor_converter.add_constant_storage_mapping(out)
        except Exception:  # noqa: BLE001 - internals moved: let FakeTensorMode do it
            self.enabled = False
            return None
        return out

    def constant_op(self, func, args, kwargs):
        """(True, result) for an op on tensors that all carry constants (an optimizer's `step`
        counter: `step += 1`, `step.item()`) that mutates its first argument or returns a number;
        else (False, None). FakeTensorMode would compute the same on the constants, after the
        metadata work that makes it the slowest op of a for-loop optimizer step."""
        kind = self._constant_kinds.get(func)
        if kind is None:
            kind = self._constant_kinds[func] = _constant_kind(func)
        if kind is _NOT_CONSTANT:
            return False, None
        consts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if type(a) is not FakeTensor or a.constant is None:
                    return False, None
                consts.append(a.constant)
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
                return False, None
            else:
                consts.append(a)
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return False, None
        # the constants are plain CPU tensors: no mode may see the op, which excluding Python
        # dispatch ensures in ~0.4 us (popping every mode, `disable_current_modes`, took ~9 us)
        with disable_torch_dispatch():
            out = func(*consts, **kwargs)
        return True, (args[0] if kind is _INPLACE else out)

    def bypasses(self, func) -> int:
        """How many ops FakeTensorMode refused to cache, less the refusals that do not stop the
        front from learning `func` (_IGNORED_BYPASSES). `func` is learned when this count does not
        move while FakeTensorMode runs it."""
        ignored = self._ignored.get(func)
        if ignored is None:
            ignored = self._ignored[func] = _ignored_bypasses(func, self._pure_custom)
        counts = fake_cache_bypasses()
        return sum(counts.values()) - sum(counts.get(reason, 0) for reason in ignored)

    def replay(self, entry, args, func=None, kwargs=None):
        """Outputs for a cache hit, or raises LookupError to fall back."""
        kind = entry[0]
        if kind == _INPLACE:
            return args[entry[1]]
        if kind == _NONE:
            return None
        if kind == _ALIAS:
            # an argument's own layout without requires_grad (a detach): its alias, made
            # without an as_strided (FakeTensorFactory.alias)
            _, arg, device = entry
            try:
                with kernel_invocation(self.mode), disable_torch_function():
                    return self._fakes.alias(args[arg], device)
            except Exception:  # noqa: BLE001 - internals moved: stop replaying, use FakeTensorMode
                self.enabled = False
                raise LookupError from None
        _, wrap, infos, in_kernel, views = entry
        try:
            if views and func is not None:
                # many views of one argument (FSDP2 chunks each parameter into one per rank):
                # the op's own meta kernel makes them all in one call, ~0.4 us a view, where an
                # as_strided from Python is ~2.5 us
                with kernel_invocation(self.mode):
                    metas = func(*args, **kwargs)
                if len(metas) != len(infos) or any(
                        m.shape != i[0] or m.stride() != i[1] or m.storage_offset() != i[4]
                        for m, i in zip(metas, infos)):
                    raise LookupError  # not what FakeTensorMode made: let it run the op
            elif in_kernel:
                # a view of an argument (a FakeTensor) or symbolic sizes: the meta kernels must
                # see the fake arguments as meta tensors, once for all outputs
                with kernel_invocation(self.mode):
                    metas = [self._meta(info, args) for info in infos]
            else:
                # only fresh outputs: an empty meta tensor touches no fake tensor, so it needs no
                # kernel invocation; only no mode below ours may see it
                with disable_torch_dispatch():
                    metas = [self._meta(info, args) for info in infos]
            make = self._fakes.make
            outs = [None if t is None else make(t, info[3]) for t, info in zip(metas, infos)]
        except Exception:  # noqa: BLE001 - internals moved: stop replaying, use FakeTensorMode
            self.enabled = False
            raise LookupError from None
        return outs[0] if wrap is None else wrap(outs)  # a tensor, or a tuple or list

    @staticmethod
    def _meta(info, args):
        """The meta tensor of one output, built the way FakeTensorMode rebuilds a cache hit."""
        if info is None:
            return None
        shape, stride, dtype, device, offset, rg, view_of, storage_numel = info
        base = args[view_of] if view_of is not None else None
        if base is not None and not rg and base.dtype == dtype and not (
                base.is_conj() or base.is_neg()):
            # as_strided shares the storage without the size arithmetic that empty_strided
            # + set_ do: with symbolic sizes that arithmetic is ~10x the cost of the view.
            # Called as the Tensor method: the same op (aten::as_strided) through the generated
            # binding, ~3.3 us where the OpOverload's schema-driven call is ~5.3 us (~1,150
            # replayed views a GPT-2 profile), below every torch function mode as the dispatch
            # it stands for is (the front runs inside __torch_dispatch__)
            with disable_torch_function():
                return base.as_strided(shape, stride, offset)
        if storage_numel is not None:
            # symbolic sizes: a flat storage of the size FakeTensorMode gave this output, then
            # as_strided; a third of the SymInt arithmetic of empty_strided
            t = torch.empty((storage_numel,), dtype=dtype, device=_META)
            return torch.ops.aten.as_strided.default(t, shape, stride, offset)
        t = torch.empty_strided(shape, stride, dtype=dtype, device=_META, requires_grad=rg)
        if base is not None:
            t.set_(base.untyped_storage(), offset, shape, stride)
        return t

    def learn(self, key, func, args, out) -> None:
        """Remember how to rebuild `out` for this key (skip anything unusual)."""
        entry = self._entry(func, args, out)
        if entry is not None:
            self.entries[key] = entry

    def _entry(self, func, args, out):
        if out is None:
            return (_NONE,) if torch.Tag.inplace in func.tags or not func._schema.returns else None
        for i, a in enumerate(args):
            if out is a:
                return (_INPLACE, i)
        outs = [out] if isinstance(out, FakeTensor) else out
        if not isinstance(outs, (tuple, list)) or not all(
                o is None or isinstance(o, FakeTensor) for o in outs):
            return None
        # which argument's storage each output lives in (a view), if any
        arg_storage = {untyped_storage_key(a.untyped_storage()): i for i, a in enumerate(args)
                       if isinstance(a, FakeTensor)}
        # the storages of the tensors in list arguments (a foreach op's): an output in one of
        # them is neither fresh nor a view `_meta` can rebuild
        seen = {untyped_storage_key(x.untyped_storage()) for a in args
                if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)}
        infos = []
        for o in outs:
            if o is None:
                infos.append(None)
                continue
            if any(o is a for a in args) or o.constant is not None or o.layout is not torch.strided:
                return None
            if o.is_conj() or o.is_neg():
                # `_conj`, `_neg_view` (a complex model's conj() is lazy): an output's bits are not
                # rebuilt (replay makes a plain meta tensor), and whether a later op resolves
                # them into a copy follows them; such ops stay FakeTensorMode's
                return None
            st = untyped_storage_key(o.untyped_storage())
            view_of = arg_storage.get(st)
            if view_of is None:
                if st in seen:  # sharing memory with another output or a list's tensor:
                    # leave it to FakeTensorMode
                    return None
                seen.add(st)
            # the device as the output's FakeTensor normalised it (what FakeTensorFactory.make takes)
            infos.append((tuple(o.shape), tuple(o.stride()), o.dtype, o.fake_device,
                          o.storage_offset(), o.requires_grad, view_of,
                          _symbolic_storage_numel(o, view_of)))
        # fresh outputs on concrete sizes need no kernel invocation to be rebuilt (replay)
        in_kernel = any(i is not None and (i[6] is not None or i[7] is not None) for i in infos)
        if isinstance(out, FakeTensor):
            shape, stride, dtype, device, offset, rg, view_of, storage_numel = infos[0]
            if view_of is not None and not rg and self.mode.shape_env is None:
                base = args[view_of]
                if (tuple(base.shape), base.stride(), base.storage_offset(), base.dtype) == (
                        shape, stride, offset, dtype) and not (base.is_conj() or base.is_neg()):
                    # the argument's own layout (the key holds it): an alias of it
                    return (_ALIAS, view_of, device)
            return ("tensor", None, tuple(infos), in_kernel, False)
        # many plain views of one argument (split, chunk, unbind): rebuilt by the op itself
        views = len(infos) >= _MANY_VIEWS and all(
            i is not None and i[6] is not None and i[6] == infos[0][6] and not i[5]
            and i[7] is None and i[2] == args[i[6]].dtype for i in infos)
        return ("seq", list if isinstance(out, list) else tuple, tuple(infos), in_kernel, views)
