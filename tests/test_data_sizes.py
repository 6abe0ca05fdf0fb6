"""Sizes that depend on tensor values, given by an explicit assumption (capture/data_values.py).

Truth: a real CPU step of the same model whose router is forced to the assumed routing (its
weights read a routing code the input carries, so top-k selects exactly the assumed experts), run
under torch.profiler's memory events (validate.real); and hand-derived routing counts.
"""

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.capture.data_values import Sizes, expert_counts, routing_indices
from tapescope.errors import TapescopeError
from tapescope.validate.real import run_real_steps

T, D, E, K = 64, 16, 4, 2   # tokens, width, experts, top-k


# ---- the assumption itself ---------------------------------------------------------------------

@pytest.mark.parametrize("routing,want", [
    ("balanced", [32, 32, 32, 32]),          # 64 x 2 / 4
    ("worst", [64, 22, 21, 21]),             # every token to expert 0, the other 64 spread
    ((2, 1, 1, 0), [64, 32, 32, 0]),         # shares, scaled to 128 assignments
])
def test_expert_counts(routing, want):
    assert expert_counts(T, K, E, routing) == want


@pytest.mark.parametrize("routing", ["balanced", "worst", (3, 2, 2, 1)])
def test_routing_indices_realize_the_counts_with_distinct_experts_per_token(routing):
    idx = routing_indices(T, K, E, routing)
    assert idx.shape == (T, K)
    assert torch.bincount(idx.flatten(), minlength=E).tolist() == expert_counts(T, K, E, routing)
    assert all(len(set(row)) == K for row in idx.tolist())


@pytest.mark.parametrize("bad", ["uniform", {"routing": "balanced", "other": 1}, {"mask": 1.5},
                                 (1, -1), 3])
def test_bad_assumptions_are_refused(bad):
    with pytest.raises(TapescopeError):
        Sizes.create(bad)


def test_a_share_above_what_top_k_allows_is_refused():
    with pytest.raises(TapescopeError, match="at most 1/2"):
        expert_counts(T, K, E, (10, 1, 1, 1))


# ---- mixture-of-experts layers, as models write them ---------------------------------------------

class _MoE(nn.Module):
    """A router (top-k of a softmax) and E two-layer experts; `dispatch` is how tokens reach them."""

    def __init__(self, dispatch):
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D))
                                     for _ in range(E))
        self.dispatch = dispatch
        with torch.no_grad():  # the router reads the routing code in the input's first E columns
            self.gate.weight.zero_()
            self.gate.weight[:, :E] = 10 * torch.eye(E)

    def forward(self, x):
        w, idx = torch.softmax(self.gate(x), dim=-1).topk(K, dim=-1)
        return (self.dispatch(self, x, w, idx) + x).pow(2).mean()


def _loop_where(self, x, w, idx):
    """Each expert takes the tokens that chose it (transformers before v5, many repositories)."""
    out = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.where(idx == e)
        out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
    return out


def _loop_hit_experts(self, x, w, idx):
    """Only the experts some token chose, skipping a sentinel (transformers v5's eager path)."""
    out = torch.zeros_like(x)
    mask = nn.functional.one_hot(idx, num_classes=E + 1).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        e = e[0]
        if e == E:
            continue
        slot, token = torch.where(mask[e])
        out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
    return out


def _sort_and_split(self, x, w, idx):
    """Sort the assignments by expert and split them by counts read on the host (megablocks,
    DeepSeek's moe_infer, torchtitan's loop)."""
    flat = idx.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=E).tolist()
    chunks = x[order // K].split(counts)
    y = torch.cat([self.experts[e](c) for e, c in enumerate(chunks)])
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(-1, K, D) * w[..., None]).sum(1)


def _unique_experts(self, x, w, idx):
    """The experts some token chose, from torch.unique, read on the host."""
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        token, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, token, self.experts[e](x[token]) * w[token, slot, None])
    return out


DISPATCH = {"where per expert": _loop_where, "hit experts": _loop_hit_experts,
            "sort and split": _sort_and_split, "unique experts": _unique_experts}


def _routed_input(routing) -> torch.Tensor:
    """Tokens whose first E columns say which experts they go to (the router reads them): the
    routing written by hand, not by tapescope's routing_indices."""
    x = torch.randn(T, D)
    x[:, :E] = 0
    for t in range(T):
        if routing == "balanced":
            chosen = [(t * K + j) % E for j in range(K)]
        else:  # worst: every token to expert 0, its other choices round-robin over the rest
            chosen = [0] + [1 + (t * (K - 1) + j) % (E - 1) for j in range(K - 1)]
        x[t, chosen] = 1.0
    return x


def _rel(a, b):
    return abs(a - b) / b


@pytest.mark.parametrize("dispatch,routing", [
    ("where per expert", "balanced"), ("where per expert", "worst"), ("hit experts", "balanced"),
    ("sort and split", "worst"), ("unique experts", "balanced")])
def test_moe_peak_equals_a_real_step_routed_as_assumed(dispatch, routing):
    x = _routed_input(routing)
    build = lambda: _MoE(DISPATCH[dispatch])  # noqa: E731
    p = tapescope.profile(build, x, sizes=routing)
    real = run_real_steps(build, (x,))
    # what remains is the allocator seeing 8-12 byte Python-scalar temporaries
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    routing_line = [a for a in p.data_sizes.assumptions if a.kind == "routing"]
    assert routing_line and routing_line[0].decided and routing in routing_line[0].detail


def test_balanced_routing_gives_the_peak_as_a_formula_of_tokens_per_expert():
    p = tapescope.profile(lambda: _MoE(_loop_where), _routed_input("balanced"))
    (size,) = [s for s in p.data_sizes.sizes if not s.pinned]
    assert size.value == T * K // E and "where" in size.op or "nonzero" in size.op
    assert p.data_sizes.peak.free_symbols == {p.symbolic.symbols[p.symbolic.names.index(size.name)]}
    # the formula, evaluated at the assumption, is the profile's peak
    assert p.at(**{size.name: size.value}).peak_bytes == p.peak_bytes
    assert int(p.data_sizes.peak.subs(next(iter(p.data_sizes.peak.free_symbols)), size.value)) \
        == p.peak_bytes


def test_counts_read_on_the_host_split_the_tokens():
    """`.tolist()` of counts a routing decided returns the assumed counts (a FUNCTION rule)."""
    p = tapescope.profile(lambda: _MoE(_sort_and_split), _routed_input("worst"), sizes="worst")
    splits = [op for op in p.ops if op.name == "aten.split_with_sizes.default"]
    assert splits and list(splits[0].record.args[1]) == expert_counts(T, K, E, "worst")


# ---- boolean masks no routing decides -----------------------------------------------------------

class _Masked(nn.Module):
    """Keeps the tokens whose first feature is positive: a size the data decides."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x):
        kept = x[x[:, 0] > 0]
        return self.b(torch.relu(self.a(kept))).pow(2).mean()


def test_mask_without_an_assumption_names_the_op_and_the_fix():
    with pytest.raises(TapescopeError, match="mask.*FRACTION|--mask-fraction"):
        tapescope.profile(_Masked, tapescope.spec((T, D)))


def test_mask_fraction_matches_a_real_step_keeping_that_fraction():
    x = torch.randn(T, D)
    x[:, 0] = -1.0
    x[: T // 4, 0] = 1.0   # a quarter of the tokens kept
    p = tapescope.profile(_Masked, x, sizes={"mask": 0.25})
    real = run_real_steps(_Masked, (x,))
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    (a,) = p.data_sizes.assumptions
    assert a.kind == "mask" and a.decided and "25%" in a.detail


# ---- transformers' Mixtral, eager experts path ---------------------------------------------------

MIXTRAL_EAGER = ("hf:MixtralConfig:num_hidden_layers=2,hidden_size=32,intermediate_size=256,"
                 "num_attention_heads=4,num_key_value_heads=2,vocab_size=64,num_local_experts=4,"
                 "num_experts_per_tok=2,experts_implementation=eager")


@pytest.mark.parametrize("routing", ["balanced"])
def test_mixtral_eager_experts_match_a_real_step_routed_as_assumed(routing):
    """transformers' loop over the experts hit (nonzero, a branch on the expert id, where per
    expert): the real step's router is forced to the routing by a forward hook that replaces the
    indices its top-k chose."""
    pytest.importorskip("transformers")
    from .conftest import profile_spec, tiny

    m = tiny(MIXTRAL_EAGER, batch=4, seq=64)
    p = profile_spec(m, sizes=routing)

    from tapescope.validate.routing import forced_routing

    build = forced_routing(m.build, routing)
    real = run_real_steps(build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn)
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    (a,) = p.data_sizes.assumptions
    assert a.decided and routing in a.detail
    # the router's top-k line of the transformers installed (its line number moves between
    # releases: read it from the file, not from a pin)
    import linecache

    import transformers.models.mixtral.modeling_mixtral as mixtral

    name, line = a.where.split(":")
    assert name == "modeling_mixtral.py"
    assert "torch.topk(" in linecache.getline(mixtral.__file__, int(line))


# ---- values the step makes or is given: literals, fills, inputs, random draws -----------------

class _LiteralMask(nn.Module):
    """Keeps the tokens a mask written in the code selects (made with torch.tensor)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        keep = torch.tensor([t % 4 == 0 for t in range(x.shape[0])])
        lengths = torch.ones_like(x[:, 0], dtype=torch.long).sum()   # a fill: its values known
        return self.lin(x[keep]).pow(2).sum() / lengths


def test_literal_and_fill_values_decide_sizes_with_no_assumption():
    p = tapescope.profile(_LiteralMask, tapescope.spec((T, D)))
    (size,) = p.data_sizes.sizes
    assert size.value == T // 4 and not size.assumptions
    real = run_real_steps(_LiteralMask, (tapescope.spec((T, D)),))
    # a 10 kB step: what remains is the 8-12 byte scalar a kernel makes for a Python number
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12


class _LabelCheck(nn.Module):
    """Checks its labels on the host, as transformers' CTC heads do (`labels.max() >= vocab`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 10)

    def forward(self, x, labels):
        if labels.max() >= 10:
            raise ValueError("labels out of range")
        return nn.functional.cross_entropy(self.lin(x), labels)


def test_integer_inputs_given_as_tensors_keep_their_values():
    labels = torch.randint(0, 10, (T,))
    p = tapescope.profile(_LabelCheck, tapescope.spec((T, D)), labels)
    (a,) = p.data_sizes.assumptions
    assert a.kind == "input" and a.decided and a.where == "input1"
    with pytest.raises(TapescopeError, match="reads a tensor's value"):   # a spec has none
        tapescope.profile(_LabelCheck, tapescope.spec((T, D)), tapescope.spec((T,), torch.int64))


class _LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            if torch.rand([]) >= 0.1:   # LayerDrop: skip a layer at random
                x = layer(x)
        return x.pow(2).sum()


def test_a_branch_on_a_random_draw_names_the_draw_and_the_fix():
    with pytest.raises(TapescopeError) as e:
        tapescope.profile(_LayerDrop, tapescope.spec((T, D)))
    msg = str(e.value)
    assert "random number" in msg and "test_data_sizes.py" in msg and "Fix:" in msg


def test_cli_routing_names_the_assumption_in_console_and_json(tmp_path):
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    model = tmp_path / "moe.py"
    model.write_text(
        "import torch, torch.nn as nn\n"
        "class MoE(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.gate, self.experts = nn.Linear(16, 4), nn.ModuleList(nn.Linear(16, 16) for _ in range(4))\n"
        "    def forward(self, x):\n"
        "        idx = self.gate(x).topk(2, dim=-1)[1]\n"
        "        out = torch.zeros_like(x)\n"
        "        for e in range(4):\n"
        "            token, _ = torch.where(idx == e)\n"
        "            out.index_add_(0, token, self.experts[e](x[token]))\n"
        "        return out.pow(2).mean()\n"
        "def build():\n"
        "    return MoE()\n")
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", f"{model}:build", "--input", "64,16", "--routing",
                                 "worst", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "worst routing: 64 tokens x top-2 over 4 experts -> 64, 22, 21, 21 per expert" in r.output
    facts = json.loads(out.read_text())["facts"]["data_sizes"]
    assert facts["assumptions"][0]["decided"] and {s["value"] for s in facts["sizes"]} == {64, 22, 21}
