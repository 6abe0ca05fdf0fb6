"""The user's model is never touched, what PyTorch refuses is refused, every mistake gets a message.

Truths used here: the same model run for real on the CPU (its output, the error PyTorch raises,
the allocator's peak), and the model's own state before and after profiling.
"""

import collections
import functools
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import tapescope
from tapescope.cli import app
from tapescope.errors import DataDependentError, ModelError, TapescopeError, UnsupportedOpError


# ---- the user's model is never touched -----------------------------------------------------


class DictCache(nn.Module):
    """Caches a tensor in a dict attribute on its first call."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cache = {}

    def forward(self, x):
        if "w" not in self.cache:
            self.cache["w"] = torch.linspace(0.5, 1.5, 4, device=x.device)
        return self.fc(x) * self.cache["w"]


@functools.lru_cache(maxsize=None)
def _table(n, device):
    return torch.linspace(1.0, 2.0, n, device=device)


class LruCache(nn.Module):
    """Reads a global functools.lru_cache of tensors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * _table(4, x.device)


_GLOBAL_CACHE: dict = {}


class GlobalDictCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        w = _GLOBAL_CACHE.setdefault("w", torch.linspace(0.0, 1.0, 4, device=x.device))
        return self.fc(x) + w


def _make_scaler():
    cache = {}

    def scale(x):
        if "s" not in cache:
            cache["s"] = torch.full((4,), 3.0, device=x.device)
        return x * cache["s"]

    return scale


class ClosureCache(nn.Module):
    """A function attribute whose closure caches a tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = _make_scaler()

    def forward(self, x):
        return self.scale(self.fc(x))


class ClassCache(nn.Module):
    """A cache shared by all instances, as a class attribute."""

    _shared = {}

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if "w" not in type(self)._shared:
            type(self)._shared["w"] = torch.full((4,), 2.0, device=x.device)
        return self.fc(x) - self._shared["w"]


class _State:
    def __init__(self):
        self.seen = []
        self.last = None


class ObjectState(nn.Module):
    """A plain object attribute that records what went through the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.state = _State()
        self.history = collections.deque(maxlen=4)

    def forward(self, x):
        y = self.fc(x)
        self.state.seen.append(y.shape)
        self.state.last = y.detach()
        self.history.append(y.detach())
        return y * (len(self.state.seen) > 0)


def _model_with_a_cache_in_forwards_closure():
    """A model class defined inside a function, its forward reaching an lru_cache and a dict made
    there through its closure (issue 24: the cache ended up holding fake tensors and the model
    failed on real data)."""
    @functools.lru_cache(maxsize=None)
    def table(n, device):
        return torch.linspace(1.0, 3.0, n, device=device)

    scales: dict = {}

    class ForwardClosureCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            s = scales.setdefault("s", torch.full((4,), 0.5, device=x.device))
            return self.fc(x) * table(4, x.device) + s

    ForwardClosureCache.clear = lambda: (table.cache_clear(), scales.clear())
    ForwardClosureCache.caches = (table, scales)
    return ForwardClosureCache


ForwardClosureCache = _model_with_a_cache_in_forwards_closure()
ISOLATION_CASES = [DictCache, LruCache, GlobalDictCache, ClosureCache, ClassCache, ObjectState,
                   ForwardClosureCache]


def _clear_caches():
    _table.cache_clear()
    _GLOBAL_CACHE.clear()
    ClassCache._shared.clear()
    ForwardClosureCache.clear()


def _fake_tensors_in(obj, seen=None) -> list:
    """Where a model's own state (attributes, containers, plain objects) holds a fake tensor."""
    from tapescope.torch_compat import FakeTensor

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, FakeTensor):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, collections.deque)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.Tensor)):
        items = list(vars(obj).values())
    else:
        return []
    return [f for x in items for f in _fake_tensors_in(x, seen)]


@pytest.mark.parametrize("cls", ISOLATION_CASES, ids=lambda c: c.__name__)
def test_model_gives_the_same_real_output_after_profiling(cls):
    _clear_caches()
    model, twin = cls(), cls()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 4)
    expected = twin(x)  # the real output, from the same (empty) caches the model starts with
    _clear_caches()
    p = tapescope.profile(model, tapescope.spec((2, 4)))
    assert p.peak_bytes > 0
    assert torch.equal(model(x), expected)
    globals_seen = [_table(4, torch.device("cpu")), _GLOBAL_CACHE, ClassCache._shared,
                    ForwardClosureCache.caches[1]]
    assert not _fake_tensors_in(model) and not _fake_tensors_in(globals_seen)
    assert not p.facts.get("isolation_notes"), p.facts.get("isolation_notes")


def test_two_profiles_of_a_closure_cached_model_stay_apart():
    """The second profile must not find the first one's fake tensors in a cache the model's
    forward reaches through its closure: each profile starts from the user's (empty) cache, so
    both trace the cache's fill, a linspace and a full of 4 floats each, in the forward."""
    _clear_caches()
    table, scales = ForwardClosureCache.caches
    profiles = [tapescope.profile(ForwardClosureCache(), tapescope.spec((2, 4)), steps=1)
                for _ in range(2)]
    for p in profiles:
        made = [op.name for op in p.ops if op.phase == "forward"]
        assert "aten.linspace.default" in made and "aten.full.default" in made
    assert profiles[0].peak_bytes == profiles[1].peak_bytes
    assert table.cache_info().currsize == 0 and scales == {}


def test_profiling_leaves_filled_caches_as_they_were():
    """A cache the model filled in a real run keeps its real tensors (and nothing fake)."""
    _clear_caches()
    model = ObjectState()
    model(torch.randn(2, 4))
    cache_model = DictCache()
    cache_model(torch.randn(2, 4))
    real_w = cache_model.cache["w"]
    tapescope.profile(cache_model, tapescope.spec((2, 4)))
    tapescope.profile(model, tapescope.spec((2, 4)))
    assert cache_model.cache["w"] is real_w
    assert len(model.state.seen) == 1 and len(model.history) == 1
    assert type(model.state.last) is torch.Tensor and type(model.history[0]) is torch.Tensor


class HoldsOperators(nn.Module):
    """Holds dispatcher operator objects in mutable state (as a selective-checkpointing policy
    does): they are handles, shared, never copied."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.keep = {"ops": [torch.ops.aten.mm, torch.ops.aten.addmm.default]}

    def forward(self, x):
        assert self.keep["ops"][0] is torch.ops.aten.mm
        return self.fc(x).relu()


def test_operator_objects_in_model_state_are_shared():
    model = HoldsOperators()
    p = tapescope.profile(model, tapescope.spec((2, 4)))
    assert p.peak_bytes > 0 and model.keep["ops"][1] is torch.ops.aten.addmm.default


# ---- what PyTorch refuses is refused -----------------------------------------------------------


class InplaceOnSaved(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))
        y.mul_(2)  # sigmoid saved its output for backward
        return y.sum()


class InplaceOnSavedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        a = x * 1.0
        b = a @ self.w  # mm saved `a`
        a.add_(1)
        return b.sum()


class InplaceAllowed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y.add_(1)  # addmm does not save its output: allowed
        return torch.relu(y).sum()


def _real_error(model_cls, x) -> str:
    with pytest.raises(RuntimeError) as e:
        model_cls()(x).backward()
    return str(e.value)


@pytest.mark.parametrize("cls", [InplaceOnSaved, InplaceOnSavedInput])
def test_modified_saved_tensor_is_refused_with_pytorchs_message(cls):
    real = _real_error(cls, torch.randn(2, 4, requires_grad=cls is InplaceOnSavedInput))
    spec = tapescope.spec((2, 4), requires_grad=cls is InplaceOnSavedInput)
    with pytest.raises(ModelError) as e:
        tapescope.profile(cls, spec)
    assert real in str(e.value)


def test_allowed_in_place_change_is_profiled():
    InplaceAllowed()(torch.randn(2, 4)).backward()  # real torch accepts it
    assert tapescope.profile(InplaceAllowed, tapescope.spec((2, 4))).peak_bytes > 0


class _Apply(nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            setattr(self, k, nn.Parameter(v))

    def forward(self, x):
        return self.fn(self, x)


D, S = torch.float64, torch.float32
MIXED_DTYPE_CASES = {
    "linear with bias, float64 input": (lambda: nn.Linear(4, 4), (2, 4), D),
    "linear without bias": (lambda: nn.Linear(4, 4, bias=False), (2, 4), D),
    "linear on a 3-d input": (lambda: nn.Linear(4, 4), (2, 3, 4), D),
    "addmv": (lambda: _Apply(lambda m, x: torch.mv(m.w, x).sum(), w=torch.randn(3, 4)), (4,), D),
    "layer norm": (lambda: nn.LayerNorm(4), (2, 4), D),
    "group norm": (lambda: nn.GroupNorm(2, 4), (2, 4, 3), D),
    "batch norm": (lambda: nn.BatchNorm1d(4), (2, 4, 3), D),
    "nll loss int32 target": (lambda: _Apply(lambda m, x: F.cross_entropy(
        x @ m.w, torch.zeros(2, dtype=torch.int32)), w=torch.randn(4, 3)), (2, 4), S),
    "index_select float index": (lambda: _Apply(lambda m, x: torch.index_select(
        m.w, 0, torch.zeros(2)).sum() + x.sum(), w=torch.randn(3, 4)), (2, 4), S),
}


def _loss(out, *inputs):
    return out.sum() if out.dim() else out


@pytest.mark.parametrize("case", MIXED_DTYPE_CASES)
def test_mixed_dtypes_are_refused_as_pytorch_refuses(case):
    build, shape, dtype = MIXED_DTYPE_CASES[case]
    with pytest.raises(RuntimeError) as real:
        _loss(build()(torch.randn(shape, dtype=dtype))).backward()
    with pytest.raises(ModelError) as e:
        tapescope.profile(build, tapescope.spec(shape, dtype=dtype), loss_fn=_loss)
    assert str(real.value).splitlines()[0] in str(e.value)


def test_mixed_precision_norm_that_pytorch_runs_is_profiled():
    """A bfloat16 input into LayerNorm's float32 parameters runs on the CPU: not refused."""
    _loss(nn.LayerNorm(4)(torch.randn(2, 4, dtype=torch.bfloat16))).backward()
    p = tapescope.profile(lambda: nn.LayerNorm(4), tapescope.spec((2, 4), dtype=torch.bfloat16),
                          loss_fn=_loss)
    assert p.peak_bytes > 0


# ---- user mistakes get a message, never a traceback -------------------------------------------


class NoParams(nn.Module):
    def forward(self, x):
        return (x * 2).sum()


class ReadsNumpy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        y.detach().numpy()
        return y.sum()


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)

    def forward(self, x):
        return self.emb(x).sum()


class PlainError(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(_Raise())

    def forward(self, x):
        return self.inner(x)


class _Raise(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("expected [batch, seq] input")


def test_user_errors_are_messages():
    with pytest.raises(TapescopeError, match="empty parameter list.*optimizer none"):
        tapescope.profile(NoParams, tapescope.spec((2, 4)))
    with pytest.raises(DataDependentError) as e:
        tapescope.profile(ReadsNumpy, tapescope.spec((2, 4)))
    assert ".numpy()" in str(e.value) and "test_reliability.py" in str(e.value)
    with pytest.raises(UnsupportedOpError, match="sparse.*sparse=False"):
        tapescope.profile(SparseEmbedding, tapescope.spec((2, 3), dtype=torch.long),
                          optimizer="sgd")
    with pytest.raises(ModelError) as e:
        tapescope.profile(PlainError, tapescope.spec((2, 4)))
    msg = str(e.value)
    assert "module 'inner.0'" in msg and "test_reliability.py" in msg and "[batch, seq]" in msg


def _file_model(tmp_path, body: str, name="m.py"):
    f = tmp_path / name
    f.write_text("import torch\nimport torch.nn as nn\n" + textwrap.dedent(body))
    return f"{f}:build"


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _clean_failure(r, text: str):
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and text in r.output, r.output


TINY = "zoo:gpt2:n_layer=1,n_embd=32,n_head=2,vocab_size=64,block_size=16"


@pytest.mark.parametrize("args,text", [
    (["profile", TINY, "--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["profile", TINY, "--device", "tpu"], "unknown device 'tpu'"),
    (["fit", TINY, "--gpu", "nosuchgpu"], "unknown GPU 'nosuchgpu'"),
    (["profile", TINY, "--batch", "0"], "--batch must be"),
    (["profile", TINY, "--batch", "-1"], "--batch must be"),
    (["profile", TINY, "--seq", "0"], "--seq must be"),
    (["profile", TINY, "--loss", "hinge"], "unknown loss 'hinge'"),
    (["profile", TINY, "--optimizer", "adamx"], "unknown optimizer 'adamx'"),
    (["fit", TINY, "--budget", "lots"], "cannot read a memory size"),
    (["fit", TINY, "--budget", "1GiB", "--sweep", "9..2"], "--sweep takes"),
])
def test_cli_mistakes_exit_1_with_a_message(args, text):
    _clean_failure(_cli(*args), text)


@pytest.mark.parametrize("flag", ["--json", "--html", "--graph", "--png"])
def test_unwritable_output_is_refused_before_profiling(tmp_path, flag):
    r = _cli("profile", TINY, flag, tmp_path / "missing" / "out.file")
    _clean_failure(r, "does not exist")
    assert "Peak memory" not in r.output  # refused before the work, not after it
    r = _cli("profile", TINY, flag, tmp_path)
    _clean_failure(r, "is a folder")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_validate_on_cuda_without_a_gpu():
    _clean_failure(_cli("validate", TINY, "--device", "cuda"), "no usable CUDA GPU")


@pytest.mark.parametrize("body,text", [
    ("def build():\n    return nn.Identity()\n", "empty parameter list"),
    ("class M(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
     "        self.fc = nn.Linear(4, 4)\n    def forward(self, x):\n"
     "        y = self.fc(x)\n        y.detach().numpy()\n        return y.sum()\n"
     "def build():\n    return M()\n", ".numpy()"),
    ("def build():\n    return nn.Sequential(nn.Embedding(10, 4, sparse=True))\n", "sparse"),
])
def test_cli_model_errors_are_messages(tmp_path, body, text):
    kind = "4,3:int64" if "Embedding" in body else "2,4"
    _clean_failure(_cli("profile", _file_model(tmp_path, body), "--input", kind, "--loss", "sum"),
                   text)


def test_names_and_messages_are_not_markup(tmp_path):
    spec = _file_model(tmp_path, """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.add_module("odd[/]name[red]", nn.Linear(4, 4))
            def forward(self, x):
                return getattr(self, "odd[/]name[red]")(x)
        def build():
            return M()
    """)
    r = _cli("profile", spec, "--input", "2,4", "--loss", "mean")
    assert r.exit_code == 0, r.output
    assert "odd[/]name[red]" in r.output
    bad = _file_model(tmp_path, """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                raise ValueError("expected [batch, seq] input")
        def build():
            return M()
    """, "bad.py")
    _clean_failure(_cli("profile", bad, "--input", "2,4"), "expected [batch, seq] input")


def test_missing_matplotlib_hint_keeps_its_brackets(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    _clean_failure(_cli("profile", TINY, "--png", tmp_path / "t.png"), "tapescope[report]")


def test_a_newline_in_a_module_name_never_becomes_code(tmp_path):
    spec = _file_model(tmp_path, """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.add_module("x\\nimport os\\nprint('owned')\\n", nn.Linear(4, 4))
            def forward(self, x):
                return list(self.children())[0](x)
        def build():
            return M()
    """)
    out = tmp_path / "g.py"
    r = _cli("profile", spec, "--input", "2,4", "--loss", "sum", "--graph", out)
    assert r.exit_code == 0, r.output
    text = out.read_text()
    compile(text, str(out), "exec")
    assert not any(line.strip().startswith(("import os", "print(")) for line in text.splitlines())
    assert "\\nimport os" in text  # the name is there, escaped


def test_json_is_written_atomically(tmp_path, monkeypatch):
    """An interrupted write leaves the previous file, not a truncated one."""
    out = tmp_path / "p.json"
    out.write_text('{"old": true}')

    class Boom:
        def __str__(self):
            raise RuntimeError("interrupted while writing")

    from tapescope.api import Profile

    real = Profile.to_dict
    monkeypatch.setattr(Profile, "to_dict", lambda self, *a, **k: {**real(self, *a, **k),
                                                                    "zzz": Boom()})
    r = _cli("profile", TINY, "--json", out)
    assert r.exit_code != 0
    assert json.loads(out.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left


def test_every_command_that_computes_writes_json(tmp_path):
    for cmd, extra in (("profile", []), ("ops", []), ("fit", ["--budget", "1GiB"]),
                       ("diff", ["--device", "cpu", "--vs", "meta"]),
                       ("explain", ["--model"]), ("validate", ["--steps", "1", "--warmup", "0"])):
        out = tmp_path / f"{cmd}.json"
        args = ["explain", "--model", TINY] if cmd == "explain" else [cmd, TINY, *extra]
        r = _cli(*args, "--json", out)
        assert r.exit_code == 0, (cmd, r.output)
        assert json.loads(out.read_text()), cmd


# ---- the answer does not depend on what the process did before --------------------------------


def test_seq_nr_counts_from_the_capture():
    a = tapescope.profile(lambda: nn.Linear(4, 4), tapescope.spec((2, 4)))
    for _ in range(3):
        nn.Linear(2, 2)(torch.randn(1, 2, requires_grad=True)).sum()  # autograd nodes in between
    b = tapescope.profile(lambda: nn.Linear(4, 4), tapescope.spec((2, 4)))
    assert [op.seq_nr for op in a.ops] == [op.seq_nr for op in b.ops]
    assert min(op.seq_nr for op in a.ops if op.seq_nr is not None) == 0


# ---- fit ----------------------------------------------------------------------------------------


def test_fit_searches_past_a_million_and_finds_the_exact_edge():
    from tapescope.fit import fit

    budget = 2**40
    r = fit(lambda: nn.Linear(4, 4), tapescope.spec((8, 4)), budget=budget, optimizer="sgd")
    assert r.value > 1 << 20 and not r.reached_search_limit
    at = r.profile.at
    peak = lambda n: max(at(batch=n).peak_bytes, at(batch=n).first_step_peak_bytes)  # noqa: E731
    assert peak(r.value) <= budget < peak(r.value + 1)


def test_fit_prints_the_formula_of_large_sizes_and_it_is_the_real_peak():
    """The formula shown 'for large batch' gives the peak a concrete trace finds there."""
    from tapescope.fit import fit, large_size_formula
    from tapescope.zoo import resolve

    z = resolve(TINY, batch=2, seq=16)
    r = fit(z.build, *z.inputs, budget="1GiB", loss_fn=z.loss_fn)
    f = large_size_formula(r)
    (batch,) = [s for s in f.free_symbols if s.name == "batch"]
    for n in (64, 200):
        concrete = tapescope.profile(z.build, *[tapescope.spec((n, 16), dtype=torch.long,
                                                               high=64)] * 2,
                                     loss_fn=z.loss_fn)
        assert int(f.subs(batch, n)) == max(concrete.peak_bytes, concrete.first_step_peak_bytes)


def test_fit_cli_file_model_json_and_exit_status(tmp_path):
    spec = _file_model(tmp_path, "def build():\n    return nn.Linear(8, 8)\n")
    out = tmp_path / "fit.json"
    r = _cli("fit", spec, "--input", "4,8", "--budget", "1MiB", "--loss", "mean", "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["fits"] and d["largest"] >= 1 and d["peak_bytes"] <= d["budget_bytes"]
    r = _cli("fit", spec, "--input", "4,8", "--budget", "16B", "--loss", "mean")
    assert r.exit_code == 1 and "nothing fits" in r.output


# ---- the loss -----------------------------------------------------------------------------------


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("loss", ["cross-entropy", "mean"])
def test_named_losses_match_the_real_step(loss):
    from tapescope.losses import resolve_loss
    from tapescope.validate.real import run_real_steps

    x = tapescope.spec((32, 16))
    p = tapescope.profile(Classifier, x, loss_fn=loss)
    real = run_real_steps(Classifier, (x,), loss_fn=resolve_loss(loss))
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12


def test_cli_loss_from_a_file_function(tmp_path):
    spec = _file_model(tmp_path, "def build():\n    return nn.Linear(8, 3)\n")
    loss = tmp_path / "losses.py"
    loss.write_text("def squared(out, x):\n    return (out ** 2).mean()\n")
    r = _cli("ops", spec, "--input", "4,8", "--loss", f"{loss}:squared")
    assert r.exit_code == 0, r.output
    assert "aten.pow.Tensor_Scalar" in r.output


# ---- the file loader ----------------------------------------------------------------------------


def test_multi_file_project_loads_as_python_would(tmp_path):
    (tmp_path / "layers.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        class Block(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.fc = nn.Linear(d, d)
            def forward(self, x):
                return self.fc(x).relu()
    """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        from __future__ import annotations
        from dataclasses import dataclass
        import torch.nn as nn
        from layers import Block

        @dataclass
        class Config:
            d: int = 8
            depth: int = 2

        def build():
            c = Config()
            return nn.Sequential(*[Block(c.d) for _ in range(c.depth)])
    """))
    r = _cli("profile", f"{tmp_path / 'train.py'}:build", "--input", "4,8", "--loss", "sum")
    assert r.exit_code == 0, r.output
    from tapescope.loading import import_file

    module = import_file(str(tmp_path / "train.py"))
    assert pickle.loads(pickle.dumps(module.Config(d=3))).d == 3


# ---- the report ---------------------------------------------------------------------------------


def test_header_names_the_dtype_and_small_parameter_counts():
    from rich.console import Console

    from tapescope.report.console import render_summary

    p = tapescope.profile(lambda: nn.Linear(100, 200), tapescope.spec((2, 100)))  # 20,200
    console = Console(width=120, record=True)
    render_summary(p, console)
    text = console.export_text()
    assert "float32" in text and "model dtype" not in text
    assert "20.2k parameters" in text
    assert p.to_dict()["dtype"] == "float32"


class _LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attention_query_key_value = nn.Linear(16, 16)
        self.feed_forward_intermediate_dense = nn.Linear(16, 64)
        self.feed_forward_output_projection = nn.Linear(64, 16)

    def forward(self, x):
        x = self.self_attention_query_key_value(x).relu()
        return self.feed_forward_output_projection(self.feed_forward_intermediate_dense(x).relu())


@pytest.mark.parametrize("width", [80, 120])
def test_tables_wrap_names_at_their_dots(width):
    from rich.console import Console

    from tapescope.report.console import render_summary

    p = tapescope.profile(lambda: nn.Sequential(*[nn.Sequential(_LongNames()) for _ in range(3)]),
                          tapescope.spec((8, 16)), loss_fn=lambda out, x: out.mean())
    console = Console(width=width, record=True)
    render_summary(p, console)
    words = set(console.export_text().replace(".", " ").split())
    names = ("self_attention_query_key_value", "feed_forward_intermediate_dense",
             "feed_forward_output_projection")
    for name in names:
        assert name in words, (name, width)
        pieces = [w for w in words if w != name and len(w) >= 3 and w in name
                  and (name.startswith(w) or name.endswith(w))]
        assert not pieces, (name, pieces, width)  # a name cut in the middle of a word


def test_validate_shows_step_time_in_milliseconds():
    from rich.console import Console

    from tapescope.report.console import render_validation
    from tapescope.validate.harness import Validation

    console = Console(width=120, record=True)
    render_validation(Validation("m", "cpu", None, [("step time", None, 0.0123)]), console)
    text = console.export_text()
    assert "12.30 ms" in text and "step time s" not in text


def test_profiler_log_lines_stay_off_the_terminal(capfd):
    from tapescope.analysis.explain import explain_op

    explain_op("aten::rms_norm", "cpu")
    err = capfd.readouterr().err
    assert "USDT" not in err and "gpuGetDeviceCount" not in err


# ---- the command line starts at once ------------------------------------------------------------


def test_help_answers_without_importing_torch():
    """`tapescope --help`, the whole process, in under half a second, and torch is never
    imported for it. Measured as the process's CPU time (user + system, best of three), which
    is what its wall time is on an idle machine and does not grow when other work shares it."""
    import resource

    code = ("import sys; sys.argv = ['tapescope', '--help']\n"
            "from tapescope.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    best = None
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        best = min(best or 9e9, cpu)
        assert out.split()[-1] == "NO-TORCH" and "Usage" in out
    assert best < 0.5, best


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_gpu_summary_explains_the_allocator_figures_and_where_it_runs_out():
    from rich.console import Console

    from tapescope.analysis.gpu_memory import cublas_workspace_bytes
    from tapescope.report.console import render_summary
    from tapescope.report.text import fmt_bytes

    p = tapescope.profile(lambda: nn.Linear(64, 64), tapescope.spec((8, 64)), gpu="h100")
    console = Console(width=200, record=True)
    render_summary(p, console)
    text = console.export_text()
    ws = fmt_bytes(cublas_workspace_bytes(p.gpu.compute_capability))
    assert "NVIDIA H100" in text.splitlines()[0]
    assert "above the tensor peak" in text and f"{ws} workspace" in text
    big = tapescope.profile(lambda: nn.Linear(40_000, 40_000), tapescope.spec((8, 40_000)),
                            gpu="4090")  # 6.4 GB of weights, three times that for AdamW
    console = Console(width=200, record=True)
    render_summary(big, console)
    text = console.export_text()
    assert big.cuda_memory.oom and "does not fit" in text
    assert f"runs out of memory at {big.cuda_memory.oom_at}" in text


def _keeping_hook():
    """A forward hook keeping its module's last output in a dict of its own closure."""
    kept: dict = {}

    def hook(module, args, out):
        kept["last"] = out.detach()

    hook.kept = kept
    return hook


def test_two_closures_of_one_function_each_keep_their_own_state():
    """Two hooks made by one factory share a code object but not their closures: the state in
    each is copied for the trace (isolation.py scanned functions by code object, so the second
    hook's dict received the trace's fake tensor)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hooks = [_keeping_hook(), _keeping_hook()]
    for layer, hook in zip(model, hooks):
        layer.register_forward_hook(hook)
    tapescope.profile(model, tapescope.spec((2, 4)))
    assert [h.kept for h in hooks] == [{}, {}]   # as the user left them: nothing ran for real
