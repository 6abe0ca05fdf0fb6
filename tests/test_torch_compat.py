"""Every private PyTorch name tapescope uses resolves on this torch (CI runs this file on each
torch it installs: the CUDA build of README's install and the CPU-only build)."""

import importlib

import pytest
import torch

import tapescope.torch_compat as compat


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


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
        with pytest.raises(AttributeError):
            _resolve(name)


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
