"""No profile leaves torch changed.

tapescope patches some attributes of torch while a profile runs (torch_compat.PATCHED lists them,
with the module that sets and restores each). Truth: the objects themselves, taken before the
profile - after a normal CPU profile, a step that raises (in the user's step, in a backward
hook), a GPU-less device="cuda" profile (compiled too, where Triton is installed) and a fake-world
distributed one, each listed attribute is the very object it was (identity, not equality), and
nothing else under torch, triton or transformers that holds code (a function, a class, a
descriptor) has changed. While the profile runs (seen from the model's forward and from a
backward hook), every attribute that differs is one the catalogue lists: the list is complete.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.errors import TapescopeError
from tapescope.torch_compat import PATCHED

from . import distributed_models as dm

_ABSENT = object()
_LIBRARIES = ("torch", "triton", "transformers")
# inductor's generated code: a module per compiled graph, loaded again by each compile (caches off)
_GENERATED = "torch._inductor.runtime.compile_tasks."


def _owner(dotted: str):
    """The module or class `dotted` names, or None where this install has none (no triton)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _slot(owner, name):
    """What `owner.name` is: its own entry (a class's descriptor as stored), else what it
    inherits or computes (a config module's value)."""
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    if name in own:
        return ("own", own[name])
    return ("inherited", getattr(owner, name, _ABSENT))


def catalogued() -> dict:
    out = {}
    for p in PATCHED:
        owner = _owner(p.owner)
        if owner is not None:
            for name in p.names:
                out[(p.owner, name)] = _slot(owner, name)
    return out


def _is_code(v) -> bool:
    return callable(v) or isinstance(v, (property, staticmethod, classmethod))


def everything() -> dict:
    """(owner's module, owner's qualname or "", name) -> object, for every module of the
    libraries and every class found in one, where the object holds code."""
    out, classes = {}, {}
    for modname, module in list(sys.modules.items()):
        if module is None or modname.split(".")[0] not in _LIBRARIES \
                or modname.startswith(_GENERATED):
            continue
        for name, v in list(vars(module).items()):
            if _is_code(v) and not isinstance(v, type(sys)):
                out[(modname, "", name)] = v
            if isinstance(v, type):
                classes[id(v)] = v
    for cls in classes.values():
        key = (getattr(cls, "__module__", "?"), getattr(cls, "__qualname__", "?"))
        for name, v in list(vars(cls).items()):
            if _is_code(v):
                out[key + (name,)] = v
    return out


def _catalogue_keys() -> set:
    """The keys of `everything()` the catalogue covers."""
    keys = set()
    for p in PATCHED:
        owner = _owner(p.owner)
        if isinstance(owner, type(sys)):
            keys |= {(owner.__name__, "", n) for n in p.names}
        elif isinstance(owner, type):
            keys |= {(owner.__module__, owner.__qualname__, n) for n in p.names}
    return keys


def changes(before: dict, after: dict) -> set:
    """Keys whose object is not the one it was (replaced, removed or added)."""
    changed = {k for k, v in before.items() if after.get(k, _ABSENT) is not v}
    # new names: only tapescope's own code counts (torch's lazy imports add modules' functions)
    changed |= {k for k, v in after.items() if k not in before
                and (getattr(v, "__module__", None) or "").startswith("tapescope")}
    # a tapescope class a patch put in torch (cuda_standin's Event) is not torch's own
    return {k for k in changed if k[0].split(".")[0] in _LIBRARIES}


class _Seen:
    """What the step saw while it ran (a plain object: capture makes no private copy of it)."""

    def __init__(self):
        self.before: dict = {}
        self.during: list[tuple[str, set]] = []

    @torch.compiler.disable  # dynamo would trace into it
    def look(self, where: str) -> None:
        self.during.append((where, changes(self.before, everything())))


SEEN = _Seen()


class _Probe(nn.Module):
    """Two layers; looks at torch in its forward and in a backward hook."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, *rest):
        SEEN.look("forward")
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: SEEN.look("backward"))
        return self.b(h.relu())


class _CompiledProbe(_Probe):
    """No backward hook: an intermediate's hook in a compiled CUDA forward fails GPU-less (the
    generated code of the graph after the hook calls torch.cuda._DeviceGuard for real), a bug of
    its own."""

    def forward(self, x, *rest):
        SEEN.look("forward")
        return self.b(self.a(x).relu())


class _RaisingHook(_Probe):
    def forward(self, x, *rest):
        h = self.a(x)
        h.register_hook(_raise)
        return self.b(h)


def _raise(g):
    raise ValueError("a hook of the user's that fails in backward")


def _shape_mistake(model, batch, optimizer):
    x, _ = batch
    model(x) @ torch.ones(3, 3)


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.a, mesh=mesh)
    return fully_shard(model, mesh=mesh)


X = tapescope.spec((8, 16))
BATCH = (X, tapescope.spec((8,), dtype=torch.long))
_CUDA = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

PROFILES = {
    "cpu": lambda: tapescope.profile(_Probe, X),
    "user step raises": lambda: tapescope.profile(_Probe, *BATCH, step=_shape_mistake),
    "backward hook raises": lambda: tapescope.profile(_RaisingHook, X),
    "cuda without a gpu": lambda: tapescope.profile(_Probe, X, device="cuda", gpu="h100",
                                                    amp="bf16"),
    "compiled cuda without a gpu": lambda: tapescope.profile(_CompiledProbe, X, device="cuda",
                                                             gpu="h100", compile=True),
    "fake world, cuda": lambda: tapescope.profile(_Probe, X, mesh={"dp": 2}, parallelize=_fsdp,
                                                  device="cuda", gpu="h100"),
}
MARKS = {"cuda without a gpu": [_CUDA], "compiled cuda without a gpu": [_CUDA, _TRITON],
         "fake world, cuda": [_CUDA]}


def _run(kind):
    try:
        PROFILES[kind]()
    except TapescopeError:
        assert "raises" in kind, f"the {kind} profile failed"
    else:
        assert "raises" not in kind, f"the {kind} profile did not fail"


@pytest.mark.parametrize("kind", [pytest.param(k, marks=MARKS.get(k, [])) for k in PROFILES])
def test_a_profile_leaves_every_patched_attribute_as_it_was(kind):
    _run(kind)  # first: the imports a profile makes (distributed, inductor) are done before
    catalogue, code = catalogued(), everything()
    SEEN.before, SEEN.during = code, []
    excepthook = sys.excepthook
    _run(kind)
    # init_process_group wraps sys.excepthook (a "[rank<r>]: " prefix) and never unwraps it
    assert sys.excepthook is excepthook, f"the {kind} profile left sys.excepthook wrapped"
    after = catalogued()
    moved = sorted(f"{owner}.{name}" for (owner, name), (how, v) in catalogue.items()
                   if after[(owner, name)][0] != how or after[(owner, name)][1] is not v)
    assert not moved, f"the {kind} profile left torch changed: {moved}"
    leaked = sorted(".".join(filter(None, k)) for k in changes(code, everything()))
    assert not leaked, f"the {kind} profile left attributes changed outside the catalogue: {leaked}"
    # while it ran: what differed is in the catalogue (the forward and backward ran, where they do)
    listed = _catalogue_keys()
    unlisted = sorted({".".join(filter(None, k)) for where, seen in SEEN.during
                       for k in seen - listed})
    assert not unlisted, f"the {kind} profile patched attributes PATCHED does not list: {unlisted}"
    if kind in ("cpu", "cuda without a gpu", "fake world, cuda"):
        wheres = {w for w, _ in SEEN.during}
        assert {"forward", "backward"} <= wheres, wheres
        assert any(seen for _, seen in SEEN.during), "nothing was patched while the step ran"


def test_every_catalogued_owner_resolves():
    """Each owner the catalogue names exists (a library not installed excepted), and has each
    name it lists (a torch that drops one: the catalogue and the patching module are updated)."""
    missing = []
    for p in PATCHED:
        root = p.owner.split(".")[0]
        if importlib.util.find_spec(root) is None:
            continue
        owner = _owner(p.owner)
        if owner is None:
            missing.append(p.owner)
            continue
        missing += [f"{p.owner}.{n}" for n in p.names if not hasattr(owner, n)]
    assert not missing, missing


# ---- nothing outside the catalogue's context manager sets an attribute of torch -------------

_SRC = __import__("pathlib").Path(tapescope.__file__).parent
_LIBRARY_ROOTS = ("torch", "triton", "transformers")

# setattr with a name computed at run time, on objects that are not torch's: each says whose
# object it is (a test cannot tell an instance from a class, so it is named here)
_DYNAMIC_SETATTR = {
    ("capture/checkpointing.py", "apply_policies"): "the traced copy of the user's model",
    ("capture/isolation.py", "shadows"): "the model's own globals and class attributes, bound "
                                         "to private copies (the catalogue's note)",
    ("capture/data_values.py", "alias"): "a fake tensor: tapescope's value tags",
    ("distributed/pipeline.py", "_backward_actions_as_phases"): "the traced rank's "
                                                                "PipelineStage instances",
    ("distributed/pipeline.py", "_initialisation_marked"): "the traced rank's schedule "
                                                           "instance (made in its setup), "
                                                           "for one step",
}


def _imported_from_libraries(tree) -> tuple[set, set]:
    """(names a module imports from torch, triton or transformers; the torch_compat getters
    it imports)."""
    import ast

    getters, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] in _LIBRARY_ROOTS}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] in _LIBRARY_ROOTS:
                names |= {a.asname or a.name for a in node.names}
            elif module.endswith("torch_compat"):
                getters |= {a.asname or a.name for a in node.names}
    return names, getters


def _bound_by_getters(function, getters: set) -> set:
    """Names a function binds to what a torch_compat getter returns (`engine, names =
    graph_task_queries()`, `for cls, name in mesh_rank_tensor_methods()`): torch objects."""
    import ast

    def targets(t):
        if isinstance(t, ast.Name):
            yield t.id
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                yield from targets(e)

    names = set()
    for node in ast.walk(function):
        value = node.value if isinstance(node, ast.Assign) else \
            node.iter if isinstance(node, ast.For) else None
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id in getters:
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= set(targets(t))
    return names


def _root(node):
    import ast

    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return node.id if isinstance(node, ast.Name) else None


def _constant_name(node) -> bool:
    """A string literal, or a module constant (`_VALUE_ATTR`): a fixed attribute name."""
    import ast

    return isinstance(node, ast.Constant) and isinstance(node.value, str) or \
        isinstance(node, ast.Name) and node.id.strip("_").replace("_", "").isupper()


def patch_sites(path) -> list[str]:
    """Where a module sets or deletes an attribute of a torch object itself: an assignment to
    or deletion of `X.attr` (or setattr / delattr of X) with X bound to torch, or a setattr
    whose attribute name is computed, outside the exceptions above."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    imported, getters = _imported_from_libraries(tree)
    rel = path.relative_to(_SRC).as_posix()
    out = []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                             ast.AsyncFunctionDef))]
    by_getters = {f: _bound_by_getters(f, getters) for f in functions}

    def enclosing_function(node):
        inner = [f for f in functions if f.lineno <= node.lineno <= f.end_lineno]
        return min(inner, key=lambda f: f.end_lineno - f.lineno) if inner else None

    def enclosing(node):
        f = enclosing_function(node)
        return None if f is None else f.name

    for node in ast.walk(tree):
        f = enclosing_function(node) if isinstance(node, (ast.Assign, ast.AugAssign,
                                                          ast.AnnAssign, ast.Delete,
                                                          ast.Call)) else None
        bound = imported | set().union(*(by_getters[g] for g in functions
                                         if f is not None and g.lineno <= f.lineno
                                         and f.end_lineno <= g.end_lineno))
        written = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for t in getattr(node, "targets", None) or [node.target]:
                elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
                written += [e for e in elts if isinstance(e, ast.Attribute)]
            if any(_root(w.value) in bound for w in written):
                out.append(f"{rel}:{node.lineno}: sets an attribute of torch")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args:
            if _root(node.args[0]) in bound:
                out.append(f"{rel}:{node.lineno}: {node.func.id} on torch")
            elif len(node.args) > 1 and not _constant_name(node.args[1]) \
                    and (rel, enclosing(node)) not in _DYNAMIC_SETATTR:
                out.append(f"{rel}:{node.lineno}: {node.func.id} with a computed name in "
                           f"{enclosing(node)}")
    return out


def test_torch_is_patched_only_through_the_catalogue():
    """Every attribute of torch a profile sets goes through torch_compat.patched, which refuses
    what PATCHED does not list and restores each: no module sets one itself."""
    sites = []
    for path in sorted(_SRC.rglob("*.py")):
        if path.name != "torch_compat.py":
            sites += patch_sites(path)
    assert not sites, "set these through torch_compat.patched (and list them in PATCHED):\n" + \
        "\n".join(sites)


def test_patched_refuses_what_the_catalogue_does_not_list_and_restores():
    from tapescope.torch_compat import patched

    with pytest.raises(RuntimeError, match="not in torch_compat.PATCHED"):
        with patched(torch, manual_seed=lambda *a: None):
            pass
    assert "manual_seed" in vars(torch)
    original = vars(torch)["get_rng_state"]
    with pytest.raises(ValueError):
        with patched(torch, get_rng_state=lambda: None):
            assert torch.get_rng_state() is None
            raise ValueError("the block fails")
    assert vars(torch)["get_rng_state"] is original
    # an inherited entry (a C method of BackwardCFunction's base) shows through again
    cls = torch.autograd.function.BackwardCFunction
    inherited = "maybe_clear_saved_tensors" not in vars(cls)
    with patched(cls, maybe_clear_saved_tensors=lambda ctx: None):
        assert "maybe_clear_saved_tensors" in vars(cls)
    assert ("maybe_clear_saved_tensors" not in vars(cls)) is inherited


def test_patched_imports_nothing():
    """Looking an owner up in the catalogue reads only loaded modules: patching
    torch.cuda.current_device must not import torch._dynamo (the catalogue also lists dynamo's
    CudaInterface.current_device), which torch's lazy module __getattr__ would do on a plain
    getattr (it did, before the lookup read modules' own entries only)."""
    import subprocess

    code = ("import sys, torch\n"
            "from tapescope.torch_compat import patched\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "with patched(torch.cuda, current_device=lambda: 0):\n"
            "    pass\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
