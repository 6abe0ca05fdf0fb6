"""tapescope.plan_checkpointing: a plan made for a budget, applied to the real model, meets the
budget on the real allocator, and its reported peak is the allocator's.

Truth: the real CPU step (validate.real.run_real_steps, the allocator's own accounting under
torch.profiler) of the model with `plan.apply` - torch's checkpoint_wrapper - applied.
"""

import json

import pytest
import torch.nn as nn

import tapescope
from tapescope.checkpointing import FULL, SELECTIVE, UnitPolicy
from tapescope.validate.real import run_real_steps

from .conftest import tiny

GPT2 = "zoo:gpt2:n_layer=4,n_embd=64,n_head=4,vocab_size=128,block_size=64"


@pytest.fixture(scope="module")
def gpt2():
    return tiny(GPT2, batch=2, seq=64)


@pytest.fixture(scope="module")
def baseline(gpt2):
    m = gpt2
    return tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)


@pytest.fixture(scope="module")
def plan(gpt2, baseline):
    """A budget between the lowest peak checkpointing reaches and the peak without it."""
    m = gpt2
    budget = int(baseline.peak_bytes * 0.87)
    return tapescope.plan_checkpointing(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                                        loss_fn=m.loss_fn, budget=budget, pareto=4)


def test_plan_meets_its_budget_on_the_real_allocator(gpt2, plan):
    m = gpt2
    assert plan.meets_budget and plan.policies
    real = run_real_steps(lambda: plan.apply(m.build()), m.inputs, m.input_kwargs,
                          loss_fn=m.loss_fn)
    # the same standard as the truth tests: exact up to the 8-12 byte Python-scalar tensors
    assert abs(real.peaks[1] - plan.first_step_peak_bytes) <= 12
    assert abs(real.peaks[2] - plan.steady_peak_bytes) <= 12
    assert max(real.peaks[1], real.peaks[2]) <= plan.budget
    assert plan.peak_bytes == max(plan.first_step_peak_bytes, plan.steady_peak_bytes)


def test_plan_is_data_and_code(gpt2, plan):
    """The pasted code, run on a fresh model, traces to the same peak; the JSON round-trips."""
    m = gpt2
    scope: dict = {}
    exec(plan.code(), scope)
    wrapped = tapescope.profile(lambda: scope["apply_checkpointing"](m.build()), *m.inputs,
                                input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)
    assert max(wrapped.peak_bytes, wrapped.first_step_peak_bytes) == plan.peak_bytes
    d = json.loads(json.dumps(plan.to_dict()))
    assert [UnitPolicy.of(p) for p in d["policies"]] == list(plan.policies)
    assert d["peak_bytes"] == plan.peak_bytes and d["budget"] == plan.budget
    assert {p.mode for p in plan.policies} <= {FULL, SELECTIVE}


def test_pareto_is_monotone_in_the_retraced_peak(plan, baseline):
    rows = plan.pareto
    assert len(rows) == 4
    peaks = [r.peak_bytes for r in rows]
    costs = [r.recompute_seconds for r in rows]
    assert peaks == sorted(peaks) and costs == sorted(costs, reverse=True)
    assert all(r.peak_bytes <= r.budget for r in rows)
    assert rows[-1].peak_bytes == baseline.peak_bytes and rows[-1].recompute_flops == 0


def test_planning_leaves_the_model_alone(gpt2, baseline):
    m = gpt2
    model = m.build()
    before = [type(mod) for mod in model.modules()]
    plan = tapescope.plan_checkpointing(model, *m.inputs, input_kwargs=m.input_kwargs,
                                        loss_fn=m.loss_fn, budget=int(baseline.peak_bytes * 0.95))
    assert [type(mod) for mod in model.modules()] == before
    assert plan.apply(model) is model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert sum(isinstance(mod, CheckpointWrapper) for mod in model.modules()) == len(plan.policies)


def test_a_budget_no_plan_meets_says_so(gpt2, baseline):
    m = gpt2
    plan = tapescope.plan_checkpointing(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                                        loss_fn=m.loss_fn, budget=baseline.peak_bytes // 3)
    assert not plan.meets_budget
    assert baseline.peak_bytes > plan.peak_bytes > plan.budget  # the lowest peak found
    assert "cannot meet" in plan.summary()


def test_checkpointing_option_errors_name_the_module(gpt2):
    m = gpt2
    with pytest.raises(tapescope.TapescopeError, match="no module 'h.9'"):
        tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          checkpointing=["h.9"])
    with pytest.raises(tapescope.TapescopeError, match="mode must be one of"):
        tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          checkpointing=[("h.0", "sometimes")])


class _NoStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x)).sum()


def test_no_layers_to_checkpoint_is_a_clear_error():
    with pytest.raises(tapescope.TapescopeError, match="units="):
        tapescope.plan_checkpointing(_NoStack, tapescope.spec((4, 8)), budget="1MiB")


def test_cli_plan(tmp_path):
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "plan.json"
    code = tmp_path / "plan.py"
    r = CliRunner().invoke(app, ["plan", GPT2, "-b", "2", "-s", "32", "--budget", "3.5MiB",
                                 "--json", str(out), "--code", str(code)])
    assert r.exit_code == 0, r.output
    assert "apply_checkpointing" in r.output and "re-traced" in r.output
    d = json.loads(out.read_text())
    assert d["peak_bytes"] > 0 and d["policies"] and "def apply_checkpointing" in code.read_text()
    assert d["meets_budget"] and d["peak_bytes"] <= 3.5 * 2**20
    # a budget below the model's state: exit 1 (as fit does), with the reason
    over = CliRunner().invoke(app, ["plan", GPT2, "-b", "2", "-s", "32", "--budget", "3MiB"])
    assert over.exit_code == 1 and "why: the model's state alone is over" in over.output
    bad = CliRunner().invoke(app, ["plan", GPT2, "--budget", "lots"])
    assert bad.exit_code == 1 and "cannot read a memory size" in bad.output


# transformers' default LlamaConfig (use_cache=True): each attention layer updates a KV cache in
# its forward, again when recomputed, so selective checkpointing's recomputation runs other ops
# than the forward and torch refuses it ("aten.slice.Tensor invocation index 4 ... not found in
# storage"); whole-layer checkpointing (non-reentrant, early stop) runs.
HF_LLAMA = ("hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
            "num_key_value_heads=2,intermediate_size=128,vocab_size=256")
CPU_SDPA_AND_MM = ("aten._scaled_dot_product_flash_attention_for_cpu.default", "aten.mm.default")


def test_plan_proposes_only_what_torch_runs():
    """The budget asks for a little less than no checkpointing, where one layer checkpointed
    selectively is the cheapest estimate; torch refuses that (the real step below raises), so
    the planner drops it, falls back to a layer checkpointed whole, and says why. Truth: the
    chosen plan run for real on CPU - it runs, within the budget, at the reported peaks - and the
    refused policy run for real raises."""
    from tapescope.checkpointing.policy import apply_policies

    m = tiny(HF_LLAMA, batch=2, seq=64)
    base = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)
    plan = tapescope.plan_checkpointing(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                                        loss_fn=m.loss_fn, budget=int(base.peak_bytes * 0.94))
    assert [(r.kind, r.mode) for r in plan.refused] == [("LlamaDecoderLayer", SELECTIVE)]
    assert "not found in storage" in plan.refused[0].reason
    assert plan.meets_budget and plan.policies
    assert {p.mode for p in plan.policies} == {FULL}
    real = run_real_steps(lambda: plan.apply(m.build()), m.inputs, m.input_kwargs,
                          loss_fn=m.loss_fn)
    assert abs(real.peaks[1] - plan.first_step_peak_bytes) <= 12
    assert abs(real.peaks[2] - plan.steady_peak_bytes) <= 12
    assert max(real.peaks[1], real.peaks[2]) <= plan.budget
    refused = [UnitPolicy(plan.refused[0].module, SELECTIVE, CPU_SDPA_AND_MM)]
    with pytest.raises(RuntimeError, match="not found in storage"):
        run_real_steps(lambda: apply_policies(m.build(), refused), m.inputs, m.input_kwargs,
                       loss_fn=m.loss_fn)


def test_knapsack_finds_the_cheapest_cover():
    """The planner's multiple-choice knapsack against brute force over every choice."""
    import itertools
    import random

    from tapescope.checkpointing.planner import _min_cost_cover

    rng = random.Random(0)
    for _ in range(30):
        items = [(k, mode, rng.randint(1, 40), rng.uniform(1, 10))
                 for k in range(5) for mode in ("selective", "full")]
        need = rng.randint(1, 120)
        best = None
        for pick in itertools.product((None, "selective", "full"), repeat=5):
            gain = cost = 0
            for k, mode in enumerate(pick):
                for kk, m, g, c in items:
                    if kk == k and m == mode:
                        gain, cost = gain + g, cost + c
            if gain >= need and (best is None or cost < best):
                best = cost
        got = _min_cost_cover(items, need, resolution=need)
        if best is None:
            assert got is None
        else:
            total = sum(c for k, m, g, c in items if got.get(k) == m)
            assert sum(g for k, m, g, c in items if got.get(k) == m) >= need
            assert abs(total - best) < 1e-9


# -- applying a plan: all or nothing, once; its code quotes module names -----------------------

class _Stack(nn.Module):
    def __init__(self, name="layers", n=3):
        super().__init__()
        self.add_module(name, nn.ModuleList(nn.Linear(8, 8) for _ in range(n)))
        self.stack_name = name

    def forward(self, x):
        for layer in getattr(self, self.stack_name):
            x = layer(x)
        return x.sum()


def _wrapped(model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return [n for n, m in model.named_modules() if isinstance(m, CheckpointWrapper)]


def test_apply_checks_every_module_before_wrapping_any():
    """A plan naming a module the model lacks used to raise after wrapping the earlier ones."""
    from tapescope.checkpointing import apply_policies

    model = _Stack()
    with pytest.raises(tapescope.TapescopeError, match="no module 'layers.7'.*left as it was"):
        apply_policies(model, ["layers.0", "layers.1", "layers.7"])
    assert _wrapped(model) == []


def test_applying_a_plan_twice_is_refused():
    """The second apply used to nest a checkpoint_wrapper inside the first."""
    from tapescope.checkpointing import apply_policies

    model = _Stack()
    apply_policies(model, ["layers.0", ("layers.1", SELECTIVE, ("aten.mm.default",))])
    before = _wrapped(model)
    with pytest.raises(tapescope.TapescopeError, match="already checkpointed.*applied already"):
        apply_policies(model, ["layers.2", "layers.0"])
    assert _wrapped(model) == before == ["layers.0", "layers.1"]


def test_plan_code_quotes_hostile_module_names(tmp_path, monkeypatch):
    """Module names were pasted into f-strings: `{open(...)}` in a name created a file when the
    code ran, a `"` was a SyntaxError. The code must parse, create nothing, and apply the plan."""
    import ast
    import os

    from tapescope.checkpointing import policy_code

    monkeypatch.chdir(tmp_path)
    for name in ("x{open('pwned','w')}", 'a"b', "c'd\\", "e}{"):
        model = _Stack(name, n=4)
        fqns = [f"{name}.{i}" for i in range(4)]
        # three in a run are written as a generator over range(0, 3), the prefix quoted
        code = policy_code(fqns[:3] + [(fqns[3], SELECTIVE, ("aten.mm.default",))])
        assert "range(0, 3)" in code
        ast.parse(code)
        scope: dict = {}
        exec(code, scope)
        assert scope["apply_checkpointing"](model) is model
        assert _wrapped(model) == fqns
        assert os.listdir(tmp_path) == [], name
