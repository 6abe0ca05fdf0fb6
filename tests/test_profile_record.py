"""A profile is one typed record, built once: what capture learned travels as `RunFacts` (and a
rank's place in its job as `DistributedFacts`), `analyse` is the one place a `Profile` is made, the
Profile is frozen, and the Trace leaves capture complete (no later stage writes it).

The source checks walk the AST of src/ and benchmarks/; the behaviour checks profile small models
and compare against counts made by hand (parameters, the model's own numel)."""

from __future__ import annotations

import ast
import dataclasses
from functools import cached_property
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tapescope
import tapescope.distributed.profile as distributed_profile
from tapescope.api import Profile
from tapescope.capture.records import RunFacts

from . import distributed_models as dm

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "tapescope").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))


def _trees():
    for path in SOURCES:
        yield path, ast.parse(path.read_text(), str(path))


def _where(path: Path, node) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_no_code_reads_facts_by_string():
    """`p.facts` is the compatibility view only: code reads `p.run` / `p.distributed`. The one
    reader left is the JSON writer, which writes the view whole."""
    allowed = {ROOT / "src" / "tapescope" / "report" / "json.py"}
    found = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "facts" and path not in allowed:
                # the view's own definition (`self.facts` inside Profile) is not a read
                if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                    found.append(_where(path, node))
    assert not found, f"reads of .facts outside the compatibility view: {found}"


def _enclosing_function(node, parents) -> str:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
    return "<module>"


def test_profile_is_built_only_in_analyse():
    """Every `Profile(...)` call in the package and its benchmarks is in api.analyse (once)."""
    calls = []
    for path, tree in _trees():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "Profile")
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "Profile"
                        and ast.unparse(node.func.value) != "cProfile")):
                calls.append((path.relative_to(ROOT).as_posix(),
                              _enclosing_function(node, parents)))
    assert set(calls) == {("src/tapescope/api.py", "analyse")}, calls


_MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "clear", "discard", "remove",
             "setdefault"}


def _trace_field(node) -> bool:
    """`trace.<field>` or `trace.<field>[...]`: a field of a variable named trace."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "trace"


def test_trace_is_written_only_by_capture():
    """Outside capture/, no code assigns a field of a `trace` or changes one in place (the
    symbolic analysis makes a new Trace with dataclasses.replace)."""
    found = []
    for path, tree in _trees():
        if "capture" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            if any(_trace_field(t) for t in targets):
                found.append(_where(path, node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in _MUTATORS and _trace_field(node.func.value):
                found.append(_where(path, node))
    assert not found, found


def test_trace_roles_are_assigned_only_by_capture():
    """Nothing outside capture/ writes a storage's roles or imports the role rules."""
    found = []
    for path, tree in _trees():
        if "capture" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "roles" and isinstance(
                    getattr(node, "ctx", None), ast.Store):
                found.append(_where(path, node))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("add", "discard", "update", "remove") \
                    and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr == "roles":
                found.append(_where(path, node))
            if isinstance(node, ast.ImportFrom) and any(a.name == "assign_roles" for a in node.names):
                found.append(_where(path, node))
    assert not found, found


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _declared_or_cached(obj) -> set:
    names = {f.name for f in dataclasses.fields(obj)}
    names |= {k for k, v in vars(type(obj)).items() if isinstance(v, cached_property)}
    return names


def test_profile_is_frozen_and_holds_only_declared_fields():
    p = tapescope.profile(Small(), tapescope.spec((8, 16)), steps=2)
    p.summary(), p.to_dict(), p.first_step_memory  # every lazy analysis the reports ask for
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.eager = None
    assert set(vars(p)) <= _declared_or_cached(p), set(vars(p)) - _declared_or_cached(p)
    # what capture learned, typed; the parameter count by hand: 16*32 + 32 + 32*4 + 4
    assert isinstance(p.run, RunFacts)
    assert p.run.parameters == 16 * 32 + 32 + 32 * 4 + 4 == sum(x.numel() for x in Small().parameters())
    assert p.run.param_dtype == "float32" and p.run.optimizer["name"] == "AdamW"


def test_facts_is_a_read_only_view_of_the_typed_record():
    p = tapescope.profile(Small(), tapescope.spec((8, 16)), accumulate=2)
    with pytest.raises(TypeError):
        p.facts["parameters"] = 0
    assert p.facts["parameters"] == p.run.parameters == 16 * 32 + 32 + 32 * 4 + 4
    assert p.facts["accumulate"] == 2 and p.facts["step2"] == p.trace.step2 == "reused"
    # a key the run did not have is absent, as before (no loss_fn given: the default's text)
    assert "sdpa_backends" not in p.facts and "checkpointing" not in p.facts
    assert p.to_dict()["facts"] == dict(p.facts)


def test_a_ranks_roles_are_final_when_its_capture_returns(monkeypatch):
    """The roles FSDP2's buffers and shards get (distributed roles) are in the Trace as capture
    returns it; analysing and reporting the job changes no storage's roles."""
    at_capture = {}
    capture = distributed_profile.capture

    def spy(*a, **k):
        trace, run = capture(*a, **k)
        at_capture[id(trace)] = [frozenset(s.roles) for s in trace.storages]
        return trace, run

    monkeypatch.setattr(distributed_profile, "capture", spy)
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 4}, parallelize=dm.fsdp)
    p.summary(), p.to_dict()
    traced = p.distributed.profiles
    assert len(traced) == len(at_capture) >= 2  # uneven head shards: two rank classes
    for q in traced.values():
        assert [frozenset(s.roles) for s in q.trace.storages] == at_capture[id(q.trace)]
    roles = set().union(*at_capture[id(p.trace)])
    assert {"sharded parameters", "all-gather buffers", "reduce-scatter buffers"} <= roles
    # the rank's place in the job, typed; the job's on the profile it returns
    assert p.distributed.rank in traced and p.distributed.classes is not None
    assert p.facts["rank"] == p.distributed.rank and p.facts["mesh"] == {"dp": 4}
    assert all(q.distributed.classes is None and q.ranks is None for q in traced.values())


def test_slot_init_builds_what_the_dataclass_own_init_builds():
    """records.slot_init replaces a frozen slots dataclass's generated __init__ (speed): the
    instances must be the ones the dataclass's own __init__ makes, as frozen, equal and hashable,
    with the same signature and defaults."""
    import inspect

    from tapescope.analysis.ops import Op
    from tapescope.capture.records import TensorRef, slot_init

    @dataclasses.dataclass(frozen=True, slots=True)
    class Own:
        a: int
        b: tuple
        c: str = "x"
        d: int = dataclasses.field(default=3, compare=False, repr=False)

    Fast = slot_init(dataclasses.dataclass(frozen=True, slots=True)(
        type("Own", (), {"__annotations__": dict(Own.__annotations__), "c": "x",
                         "d": dataclasses.field(default=3, compare=False, repr=False)})))
    assert inspect.signature(Fast).parameters.keys() == inspect.signature(Own).parameters.keys()
    for args, kwargs in (((1, (2,)), {}), ((1, (2,), "y"), {}), ((1,), {"b": (), "d": 9})):
        own, fast = Own(*args, **kwargs), Fast(*args, **kwargs)
        assert repr(own).split("Own(", 1)[1] == repr(fast).split("Own(", 1)[1]  # (qualnames differ)
        assert dataclasses.astuple(own) == dataclasses.astuple(fast)
        assert hash(fast) == hash(dataclasses.replace(fast))
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.a = 5
    with pytest.raises(TypeError):
        Fast(1)  # b is required, as in Own
    # the records that use it keep the dataclass's fields, in order
    for cls in (Op, TensorRef):
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        assert list(inspect.signature(cls).parameters) == names
    ref = TensorRef((2, 3), torch.float32, 4, 5)
    assert ref == TensorRef(shape=(2, 3), dtype=torch.float32, storage=4, value=5)
    assert (ref.shape, ref.dtype, ref.storage, ref.value, ref.nbytes) == ((2, 3), torch.float32, 4, 5, 24)
    with pytest.raises(TypeError):
        slot_init(dataclasses.dataclass(frozen=True, slots=True)(
            type("Factory", (), {"__annotations__": {"x": list},
                                 "x": dataclasses.field(default_factory=list)})))
