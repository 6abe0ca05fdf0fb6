"""Every private PyTorch name tapescope uses resolves on this torch (CI runs this file on each
torch it installs: the CUDA build of README's install and the CPU-only build)."""

import importlib

import pytest
import torch

import tapescope.torch_compat as compat


class Missing(AssertionError):
    """A name tapescope uses that this torch lacks."""


def _resolve(dotted: str):
    """The object `dotted` names: its longest importable module, then attributes. A missing one
    fails with what is missing, where, and what to do (a bare AttributeError would say only the
    last attribute's name)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                raise Missing(
                    f"{dotted}: torch {torch.__version__} has no {attr!r} in "
                    f"{'.'.join(parts[:j])}; tapescope reads it through torch_compat.py: update "
                    "the function there that names it (and PRIVATE_NAMES)")
            obj = getattr(obj, attr)
        return obj
    raise Missing(f"{dotted}: torch {torch.__version__} has no module {parts[0]!r}")


@pytest.mark.parametrize("name", compat.PRIVATE_NAMES)
def test_private_name_resolves(name):
    if name == "torch.profiler.profile.profiler":
        return  # an attribute of a running profiler: checked below
    assert _resolve(name) is not None


@pytest.mark.parametrize("name", compat.TRITON_NAMES)
def test_triton_name_resolves(name):
    pytest.importorskip("triton")
    assert _resolve(name) is not None


def test_triton_driver_registry_has_the_slot_tapescope_sets():
    pytest.importorskip("triton")
    from triton.runtime.driver import DriverConfig

    assert "_active" in vars(DriverConfig())


@pytest.mark.parametrize("name,since", sorted(compat.NEWER_TORCH_NAMES.items()))
def test_newer_name_resolves_from_its_version(name, since):
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version >= since:
        assert _resolve(name) is not None
    else:  # tapescope only sets attributes such a torch never reads: nothing to resolve
        with pytest.raises(Missing):
            _resolve(name)


def test_a_missing_name_says_what_is_missing_and_where():
    with pytest.raises(Missing, match=r"torch\.nn\.functional\.no_such_kernel: torch .* has no "
                                      r"'no_such_kernel' in torch\.nn\.functional; .*torch_compat"):
        _resolve("torch.nn.functional.no_such_kernel")
    with pytest.raises(Missing, match="has no 'no_such_method' in torch.Tensor"):
        _resolve("torch.Tensor.no_such_method")


# The (owner, name) functions of torch_compat that distributed/fidelity.py patches through: each
# must find its target on this torch (None or [] would silently switch a fidelity fix off).
def test_distributed_patch_sites_are_found():
    pytest.importorskip("torch.distributed.tensor")
    checks = compat.dtensor_tracing_checks()
    assert [m.__name__ for m, _ in checks] == list(compat.TRACING_CHECK_MODULES)
    assert all(callable(getattr(m, n)) for m, n in checks)
    for site in (compat.dtensor_meta_propagation(), compat.strided_shard_flag_propagation(),
                 compat.mesh_strategy_expansion()):
        assert site is not None and callable(getattr(*site)), site
    methods = {(cls.__name__, n) for cls, n in compat.mesh_rank_tensor_methods()}
    assert methods == {("DeviceMesh", n) for n in compat._MESH_TENSOR_METHODS} | {
        ("_MeshLayout", "remap_to_tensor")}


def test_distributed_helpers_answer():
    pytest.importorskip("torch.distributed.tensor")
    import inspect

    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh

    assert type(compat.fake_store()).__name__ == "FakeStore"
    assert callable(compat.replicate_with_fsdp())
    wrapper, impl, activation_wrapper = compat.checkpoint_wrapper_api()
    wrapped = wrapper(nn.Linear(2, 2), checkpoint_impl=impl.NO_REENTRANT)
    assert isinstance(wrapped, activation_wrapper)
    assert compat.MESH_RANK_MAP in inspect.signature(DeviceMesh.__init__).parameters


def test_autograd_internals_answer():
    x = torch.ones(3, requires_grad=True)
    y = (x * 2).sum()
    node = y.grad_fn
    assert isinstance(compat.node_sequence_nr(node), int)
    assert len(compat.node_input_metadata(node)) == 1
    assert compat.use_count(x) >= 1 and compat.storage_use_count(x) >= 1
    assert compat.storage_key(x) == compat.untyped_storage_key(x.untyped_storage())
    assert compat.sequence_nr() > compat.node_sequence_nr(node)
    assert compat.current_autograd_node() is None
    assert compat.forward_ad_level() == -1
    assert not compat.is_zerotensor(x)


def test_profiler_internals_answer():
    with torch.profiler.profile(profile_memory=True) as prof:
        torch.ones(4) + 1
    types = compat.profiler_event_types()
    tags = {e.tag for e in compat.profiler_event_tree(prof)}
    assert types.TorchOp in tags


def test_shape_env_internals_answer():
    env = compat.ShapeEnv()
    seen = []
    compat.hook_guard_locations(env, lambda sloc: seen.append(sloc) or sloc)
    s = env.create_symintnode(env.create_symbol(4, compat.constant_source("n"),
                                                dynamic_dim=compat.DimDynamic.DYNAMIC), hint=4)
    assert bool(s > 2)  # places a guard, located through the hook
    guards, replacements, ranges = compat.shape_env_facts(env, {"n": s.node.expr})
    assert seen and guards and ranges["n"][0] is not None


def _data_ptr_raises(t) -> bool:
    """Does reading a fake tensor's data pointer raise (else it warns, once per process)?"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            t.data_ptr()
        except RuntimeError:
            return True
    return False


@pytest.mark.parametrize("device,requires_grad,unsafe_data_ptr", [
    ("cpu", False, False), ("cpu", True, True),
    # a CPU-only build aborts the process on an op over a fake CUDA tensor
    pytest.param("cuda", True, False, marks=pytest.mark.skipif(
        not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch"))])
def test_fake_tensor_factory_makes_what_the_constructor_makes(device, requires_grad,
                                                              unsafe_data_ptr):
    """The replay front's shortcut around FakeTensor.__new__ (torch's constructor is the truth):
    the same attributes, dispatch keys (a fake CUDA tensor carries CUDA's), device, autograd flag,
    data-pointer guard, and the same results when ops run on it."""
    from torch._functorch import config

    with config.patch(fake_tensor_allow_unsafe_data_ptr_access=unsafe_data_ptr):
        mode = compat.FakeTensorMode()
    factory = compat.FakeTensorFactory(mode)
    assert factory.exact
    meta = torch.empty((4, 6), device="meta", requires_grad=requires_grad)
    real = compat.FakeTensor(mode, meta, torch.device(device))
    mine = factory.make(meta.detach().requires_grad_(requires_grad), real.fake_device)
    assert type(mine) is compat.FakeTensor
    assert list(mine.__dict__.items()) == list(real.__dict__.items())
    assert torch._C._dispatch_keys(mine) == torch._C._dispatch_keys(real)
    assert (mine.device, mine.requires_grad, mine.shape, mine.stride()) == (
        real.device, real.requires_grad, real.shape, real.stride())
    assert _data_ptr_raises(mine) == _data_ptr_raises(real) == (not unsafe_data_ptr)
    with mode:
        a, b = (t.t() @ t for t in (real, mine))
    assert (type(b), b.device, b.shape, b.requires_grad) == (type(a), a.device, a.shape,
                                                             a.requires_grad)


def _cache_size(shape_env) -> int:
    """Entries in FakeTensorMode's caches: its class-level one and a ShapeEnv's."""
    return len(compat.FakeTensorMode.cache) + (
        0 if shape_env is None else len(shape_env.fake_tensor_cache))


def _cache_verdicts(mode_type, symbolic: bool) -> list:
    """Each op of a small list run once on a fresh mode of `mode_type`: the reasons
    FakeTensorMode's bypass counter moved for, whether the op's entry was cached, and the
    output's metadata. `symbolic`: sizes are SymInts of a ShapeEnv (the cache then lives on
    it), else ints and no ShapeEnv, as in a concrete capture."""
    from tapescope.torch_compat import DimDynamic, ShapeEnv, constant_source

    out = []
    ops = [
        lambda x, y, c: x + 1, lambda x, y, c: x * y[0], lambda x, y, c: x.t(),
        lambda x, y, c: x.view(-1), lambda x, y, c: x.sum(1), lambda x, y, c: x @ y.t(),
        lambda x, y, c: torch.softmax(x, -1), lambda x, y, c: x[1:].unsqueeze(0),
        lambda x, y, c: torch.ops.aten.native_layer_norm(x, [x.shape[1]], None, None, 1e-5),
        lambda x, y, c: c.conj(), lambda x, y, c: torch.ops.aten._neg_view(c),
        lambda x, y, c: x.expand(2, *x.shape), lambda x, y, c: x.requires_grad_() * 2,
    ]
    for op in ops:
        shape_env = ShapeEnv(duck_shape=False) if symbolic else None
        with mode_type(shape_env=shape_env):
            sizes = [3, 5]
            if symbolic:
                sizes = [shape_env.create_symintnode(
                    shape_env.create_symbol(n, constant_source(f"d{n}"),
                                            dynamic_dim=DimDynamic.DYNAMIC),
                    hint=n, source=constant_source(f"d{n}")) for n in sizes]
            x, y = torch.empty(*sizes), torch.empty(*sizes)
            c = torch.empty(*sizes, dtype=torch.complex64)
            before = dict(compat.fake_cache_bypasses())
            cached = _cache_size(shape_env)
            r = op(x, y, c)
            moved = {k for k, v in compat.fake_cache_bypasses().items() if v != before.get(k, 0)}
            cached = _cache_size(shape_env) - cached
            rs = r if isinstance(r, tuple) else (r,)
            out.append((moved, cached, [(str(t.shape), str(t.stride()), t.dtype,
                                         str(t.storage_offset()), t.is_conj(), t.is_neg(),
                                         torch._C._dispatch_keys(t)) for t in rs]))
    return out


@pytest.mark.parametrize("symbolic", [False, True])
def test_size_free_cache_check_caches_what_fake_tensor_mode_caches(symbolic):
    """SizeFreeCacheCheck rebuilds a new cache entry's output at sizes 0 (no unbacked symbol):
    the same ops are cached or refused for the same reasons as by FakeTensorMode itself, and
    their outputs are the same; its size-free rebuild did run (else this proves nothing)."""
    rebuilds = []

    class Spy(compat.SizeFreeCacheCheck):
        def _output_from_cache_entry(self, state, entry, key, func, args):
            rebuilds.append(self._size_free_rebuild)
            return super()._output_from_cache_entry(state, entry, key, func, args)

    compat.FakeTensorMode.cache.clear()
    theirs = _cache_verdicts(compat.FakeTensorMode, symbolic)
    compat.FakeTensorMode.cache.clear()
    ours = _cache_verdicts(Spy, symbolic)
    assert ours == theirs
    assert sum(c for _, c, _ in ours) >= 10  # most of them are cached
    # on symbolic sizes the check's rebuilds were size-free; on concrete ones, FakeTensorMode's
    assert sum(rebuilds) >= 10 if symbolic else not any(rebuilds)


def _kernel_state(mode) -> tuple:
    """What in_kernel_invocation_manager sets: the mode's flag, the meta key in TLS, Python
    dispatch disabled (a mode pushed outside sees nothing inside)."""
    return (mode.in_kernel_invocation, torch._C._meta_in_tls_dispatch_include(),
            torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python))


@pytest.mark.parametrize("nested", [False, True])
def test_kernel_invocation_sets_and_restores_what_torchs_manager_does(nested):
    from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager

    mode = FakeTensorMode()
    with mode:
        t = torch.empty(3, 4)

    def states(guard) -> list:
        seen = [_kernel_state(mode)]
        with guard(mode):
            seen.append(_kernel_state(mode))
            if nested:
                with guard(mode):
                    seen.append(_kernel_state(mode))
                seen.append(_kernel_state(mode))
            # inside, a fake tensor is its meta tensor to the kernels
            seen.append((t.device.type, torch.ops.aten.view.default(t, [12]).device.type))
        seen.append(_kernel_state(mode))
        with pytest.raises(ZeroDivisionError):
            with guard(mode):
                1 / 0
        seen.append(_kernel_state(mode))
        return seen

    assert states(compat.kernel_invocation) == states(in_kernel_invocation_manager)


@pytest.mark.parametrize("nested", [False, True])
def test_fake_mode_unset_sets_and_restores_what_torchs_context_does(nested):
    """fake_mode_unset against torch's unset_fake_temporarily: the fake mode active outside
    (its dispatch slot), none inside, what entering returns, and the slot after a normal exit
    and after an exception, with the mode active and with none."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    def slot():
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    def states(unset, mode) -> list:
        seen = [slot()]
        with unset() as got:
            seen += [got, slot(), type(torch.zeros(2)).__name__]
            if nested:
                with unset() as inner:
                    seen += [inner, slot()]
                seen.append(slot())
        seen.append(slot())
        with pytest.raises(ZeroDivisionError):
            with unset():
                1 / 0
        seen.append(slot())
        return seen

    mode = FakeTensorMode()
    with mode:
        theirs = states(unset_fake_temporarily, mode)
        ours = states(compat.fake_mode_unset, mode)
    assert ours == theirs
    assert theirs[0] is mode and theirs[1] is mode and theirs[2] is None
    assert theirs[3] == "Tensor"  # a real tensor is made inside
    assert states(compat.fake_mode_unset, None) == states(unset_fake_temporarily, None)


# ---- the shortcuts: torch's decisions tapescope's dispatch makes itself (SHORTCUTS) ----------

def _check_prim_device():
    """Truth: FakeTensorMode's own prim.device handler, inside and outside a kernel
    invocation, for a cpu and a cuda fake tensor."""
    from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS

    from tapescope.capture.tape import _device_answer

    handler = _DISPATCH_META_HANDLERS[torch.ops.prim.device.default]
    mode = compat.FakeTensorMode()
    for device in ("cpu", "cuda"):
        with mode:
            t = torch.empty(2, device=device)
        for inside in (False, True):
            mode.in_kernel_invocation = inside
            try:
                assert _device_answer(t) == handler((t,)), (device, inside)
            finally:
                mode.in_kernel_invocation = False


def _check_foreign_subclass():
    """Truth: fake_tensor.py's `_check_for_subclass_arg` on one argument of each kind: plain,
    fake, a Parameter, a metadata-only Parameter subclass, a wrapper subclass (TwoTensor) and
    a Parameter of one."""
    from torch._subclasses.fake_tensor import _check_for_subclass_arg
    from torch.testing._internal.two_tensor import TwoTensor

    from tapescope.capture.tape import _foreign_subclass

    class MyParameter(torch.nn.Parameter):
        pass

    plain = torch.ones(2)
    with compat.FakeTensorMode() as mode:
        fake = torch.ones(2)
    two = TwoTensor(torch.ones(2), torch.ones(2))
    examples = [plain, fake, torch.nn.Parameter(plain.clone()), MyParameter(plain.clone()),
                two, torch.nn.Parameter(two)]
    del mode
    for x in examples:
        assert _foreign_subclass(type(x)) == _check_for_subclass_arg(x), type(x)
    assert any(_foreign_subclass(type(x)) for x in examples)  # both answers occur


def _check_should_skip_dynamo():
    """Truth: TorchDispatchMode.__init_subclass__ on two fresh modes: it wraps a mode's
    __torch_dispatch__ unless _should_skip_dynamo() is False; Tape's is left its own (its
    dispatch takes the wrapper itself where it does more than call)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tapescope.capture import tape

    def dispatch(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    wrapped = type("Wrapped", (TorchDispatchMode,), {"__torch_dispatch__": dispatch})
    skipped = type("Skipped", (TorchDispatchMode,), {
        "__torch_dispatch__": dispatch, "_should_skip_dynamo": classmethod(lambda cls: False)})
    assert getattr(wrapped.__dict__["__torch_dispatch__"], "__wrapped__", None) is dispatch
    assert skipped.__dict__["__torch_dispatch__"] is dispatch
    own = tape.Tape.__dict__["__torch_dispatch__"]
    assert getattr(own, "__wrapped__", None) is None and own.__code__ is tape._TORCH_DISPATCH_CODE
    # what it takes instead, where the wrapper does more than call: torch's own wrapper
    assert tape._TORCH_DISPATCH_DYNAMO_DISABLED.__wrapped__ is tape.Tape._torch_dispatch


_SHORTCUT_CHECKS = {"prim.device": _check_prim_device,
                    "foreign subclass": _check_foreign_subclass,
                    "_should_skip_dynamo": _check_should_skip_dynamo}


def test_every_shortcut_has_its_check():
    assert {s.name for s in compat.SHORTCUTS} == set(_SHORTCUT_CHECKS)


@pytest.mark.parametrize("name", sorted(_SHORTCUT_CHECKS))
def test_shortcut_decides_as_torch_does(name):
    _SHORTCUT_CHECKS[name]()
