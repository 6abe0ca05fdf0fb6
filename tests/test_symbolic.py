"""Memory and FLOPs as formulas of batch and sequence length: the formulas, evaluated at a size,
equal a concrete trace at that size, byte for byte and FLOP for FLOP."""

import pytest
import torch.nn as nn

import tapescope
from tapescope.fit import fit
from tapescope.zoo import resolve

from .conftest import TINY_GPT2, TINY_LLAMA, profile_spec, tiny


def _concrete(spec, batch, seq):
    m = resolve(spec, batch=batch, seq=seq)
    return profile_spec(m)


@pytest.mark.parametrize("spec", [TINY_GPT2, TINY_LLAMA])
def test_formulas_equal_concrete_traces(spec):
    p = profile_spec(tiny(spec, batch=4, seq=16), symbolic=("batch", "seq"))
    assert not p.symbolic.specialized
    for batch, seq in [(4, 16), (2, 2), (3, 17), (9, 40), (16, 64)]:
        e = p.at(batch=batch, seq=seq)
        c = _concrete(spec, batch, seq)
        assert e.peak_bytes == c.peak_bytes
        assert e.first_step_peak_bytes == c.first_step_peak_bytes
        assert e.flops == c.flops
        assert e.at_peak == c.memory.at_peak


def test_vision_batch_formula():
    spec = "torchvision:resnet18"
    p = profile_spec(tiny(spec, batch=2, seq=32), symbolic=("batch",))
    for batch in (2, 5, 8):
        c = _concrete(spec, batch, 32)
        e = p.at(batch=batch)
        assert (e.peak_bytes, e.flops) == (c.peak_bytes, c.flops)


def test_report_is_for_the_given_sizes():
    m = tiny(TINY_GPT2, batch=4, seq=16)
    sym = profile_spec(m, symbolic=("batch", "seq"))
    con = profile_spec(m)
    assert sym.peak_bytes == con.peak_bytes and sym.flops == con.flops
    assert [op.name for op in sym.ops] == [op.name for op in con.ops]


def test_guards_give_the_range_and_the_source_line():
    p = profile_spec(tiny(TINY_GPT2, batch=2, seq=16), symbolic=("seq",))
    sp = p.symbolic
    assert sp.ranges["seq"] == (2, 64)  # GPT-2 checks T <= block_size
    assert any(g.expr == "seq <= 64" and "gpt2.py" in g.where for g in sp.guards)
    with pytest.raises(tapescope.TapescopeError, match="exceeds block_size"):
        p.at(seq=65)  # outside the formulas: traced concretely, and the model refuses


class Pinned(nn.Module):
    """view(4, -1) pins the batch to 4: a symbolic trace holds at that size only."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).view(4, -1).sum()


def test_pinned_dimension_is_reported_and_fitted():
    p = tapescope.profile(Pinned, tapescope.spec((4, 16)), symbolic=("batch",))
    sp = p.symbolic
    assert sp.specialized == {"batch": 4}
    assert any(g.pins == "batch" and "test_symbolic.py" in g.where for g in sp.guards)
    assert sp.fitted["verified"]
    for b in (4, 12, 40):
        c = tapescope.profile(Pinned, tapescope.spec((b, 16)))
        e = p.at(batch=b)
        assert (e.peak_bytes, e.flops) == (c.peak_bytes, c.flops)


def test_fit_finds_the_largest_batch_that_fits():
    m = tiny(TINY_GPT2, batch=4, seq=32)
    budget = 12 * 2**20
    r = fit(m.build, *m.inputs, loss_fn=m.loss_fn, budget=budget)
    assert r.value is not None
    fits = _concrete(TINY_GPT2, r.value, 32)
    over = _concrete(TINY_GPT2, r.value + 1, 32)
    assert max(fits.peak_bytes, fits.first_step_peak_bytes) <= budget
    assert max(over.peak_bytes, over.first_step_peak_bytes) > budget


def test_ops_inside_another_op_skip_fake_tensor_modes_cache_and_change_nothing(monkeypatch):
    """Under a ShapeEnv the ops FakeTensorMode runs inside another op (a decomposition's) do not
    go through its cache (`Tape._uncached`), while the ops of the program still do: the trace,
    every size expression and storage size, and the guards are those of a capture that caches
    them all, and the formulas still equal concrete traces (test above)."""
    import sympy

    from tapescope.analysis.symbolic import sympify_trace
    from tapescope.capture.tape import Tape

    seen = set()
    fake_dispatch = Tape._fake_dispatch

    def spy(self, func, types, args, kwargs, traits=None):
        seen.add((self._tape_depth > 0, self.cache_enabled))
        return fake_dispatch(self, func, types, args, kwargs, traits)

    captured = {}  # id(profile) -> the trace it was analysed from

    def describe(p):  # sizes as expressions in batch and seq
        t, _ = sympify_trace(captured[id(p)])
        return ([(r.name, str(r.args), str(r.outputs)) for r in t.ops],
                # expanded: a storage that FakeTensorMode's cache rebuilt has its size as
                # `empty_strided` sums it, 4*seq*(batch - 1) + 4*seq for 4*batch*seq
                [str(sympy.expand(s.nbytes)) for s in t.storages],
                [str(g) for g in p.symbolic.guards])

    import tapescope.api as api

    analyse = api._analyse_captured

    def keep(trace, *a, **k):  # the captured trace, its sizes still SymInts' expressions
        p = analyse(trace, *a, **k)
        captured[id(p)] = trace
        return p

    monkeypatch.setattr(api, "_analyse_captured", keep)
    monkeypatch.setattr(Tape, "_fake_dispatch", spy)
    m = tiny(TINY_LLAMA, batch=4, seq=16)
    ours = describe(profile_spec(m, symbolic=("batch", "seq")))
    assert (True, False) in seen and (True, True) not in seen  # inside: never cached
    monkeypatch.setattr(Tape, "_uncached", lambda self, *a: fake_dispatch(self, *a))
    assert describe(profile_spec(m, symbolic=("batch", "seq"))) == ours


@pytest.mark.parametrize("spec", [TINY_GPT2.replace("block_size=64", "block_size=300"),
                                  TINY_LLAMA + ",max_seq_len=300"])
def test_sizes_rounded_to_a_tile_are_exact_at_every_size(spec):
    """On an A100 the flash attention backward keeps b x h x round128(seq) floats (softmax_d)
    and the dQ accumulator, rounded to 128 rows: sizes like 16384*((seq + 127)//128), piecewise
    polynomials of seq. They stay exact on both sides of every tile edge, and fit searches them."""
    kw = dict(device="cuda", gpu="a100", amp="bf16")
    p = profile_spec(tiny(spec, batch=2, seq=16), symbolic=("seq",), **kw)
    assert set(p.facts["sdpa_backends"]) == {"flash"}  # one per layer
    assert any(a.kind == "floordiv" for a in p.symbolic.aux)
    for seq in (2, 128, 129, 257):
        e = p.at(seq=seq)
        c = profile_spec(tiny(spec, batch=2, seq=seq), **kw)
        assert (e.peak_bytes, e.first_step_peak_bytes, e.flops) == (
            c.peak_bytes, c.first_step_peak_bytes, c.flops)
    r = fit(tiny(spec, batch=2, seq=16).build, *tiny(spec, batch=2, seq=16).inputs, dim="seq",
            budget="1GiB", loss_fn=tiny(spec).loss_fn, **kw)
    assert r.value == 300  # the model's own limit (block_size / max_seq_len)
