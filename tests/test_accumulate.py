"""Gradient accumulation: N micro-batches (forward, loss / N, backward), one optimizer step.

Truth: the same loop run for real on the CPU under torch.profiler (validate.real: the allocator's
running total, the outermost dispatched ops), which runs capture.step.train_step as tapescope does.
"""

import json

import pytest
import torch
import torch.nn as nn

from tapescope.capture.records import BACKWARD, FORWARD
from tapescope.errors import TapescopeError
from tapescope.analysis.ops import expanded_ops
from tapescope.validate.harness import real_op_names, same_ops
from tapescope.capture.model import spec as input_spec
from tapescope.validate.real import run_real_steps
from tapescope.zoo import ModelSpec

from .conftest import TINY_GPT2, TINY_LLAMA, profile_spec, tiny


def _rel(a, b):
    return abs(a - b) / b


class _ConvNet(nn.Module):
    """Convolution, batch norm (its running statistics update once per micro-batch), pooling."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        return self.body(x).logsumexp(-1).mean()


@pytest.mark.parametrize("m", [
    tiny(TINY_GPT2), tiny(TINY_LLAMA),
    ModelSpec("convnet", _ConvNet, (input_spec((4, 3, 16, 16)),))], ids=["gpt2", "llama", "convnet"])
def test_accumulate_4_matches_a_real_4_micro_batch_step(m):
    p = profile_spec(m, accumulate=4)
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, accumulate=4)
    # what remains is the allocator seeing 8-12 byte Python-scalar temporaries
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    ok, diff = same_ops(p, real_op_names(real, 2))
    assert ok, diff


def test_each_micro_batch_runs_forward_loss_over_n_and_backward():
    m = tiny(TINY_GPT2)
    one, four = profile_spec(m), profile_spec(m, accumulate=4)
    # micro-batch 1 makes the gradients, 2 and 3 accumulate into them alike: the third repeats
    # the second, which proves the fourth does too, counted and not traced
    segments = [(s.step, s.phase) for s in four.trace.segments if s.step == 1]
    assert segments.count((1, FORWARD)) == 3 and segments.count((1, BACKWARD)) == 3
    assert [runs for _, _, runs in four.trace.repeated] == [2]
    assert four.facts["accumulate_traced"] == 3
    fwd = lambda ops: [op for op in ops if op.phase == FORWARD]  # noqa: E731
    # the loss divided by N, in the loss's module, once per micro-batch
    assert len(fwd(expanded_ops(four.ops))) == 4 * (len(fwd(one.ops)) + 1)
    divs = [op for op in fwd(expanded_ops(four.ops))
            if op.name == "aten.div.Tensor" and op.module == "(loss)"]
    assert len(divs) == 4
    assert four.facts["accumulate"] == 4


def test_repeated_micro_batches_equal_a_real_12_micro_batch_step():
    """Micro-batches 4-12 are counted, not traced: the peaks and the op sequence (each repeated
    micro-batch expanded) equal a real 12-micro-batch step's on the CPU allocator."""
    m = tiny(TINY_LLAMA, batch=1, seq=16)
    p = profile_spec(m, accumulate=12)
    assert p.facts["accumulate_traced"] == 3
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, accumulate=12)
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    ok, diff = same_ops(p, real_op_names(real, 2))
    assert ok, diff


def test_accumulate_10000_takes_the_time_of_3_and_counts_every_micro_batch():
    """`--accumulate 10000` traced 10,000 identical micro-batches (over 300 s). By hand: each
    micro-batch's forward and backward are one step's without accumulation plus `loss / N` (one
    FLOP on the 0-d loss, one more for its backward), and micro-batches 2..N add each new
    gradient into the one held (one FLOP per parameter); the optimizer steps once."""
    import time

    m = tiny(TINY_GPT2, batch=1, seq=8)
    one = profile_spec(m, steps=1)
    t0 = time.perf_counter()
    many = profile_spec(m, accumulate=10_000, steps=1)
    assert time.perf_counter() - t0 < 20 * max(1.0, _seconds(lambda: profile_spec(m, steps=1)))
    assert many.flops["forward"] == 10_000 * (one.flops["forward"] + 1)
    n_params = one.facts["parameters"]
    assert many.flops["backward"] == 10_000 * (one.flops["backward"] + 1) + 9_999 * n_params
    assert many.flops["optimizer"] == one.flops["optimizer"]
    assert many.peak_bytes == profile_spec(m, accumulate=3, steps=1).peak_bytes
    assert len(expanded_ops(many.ops)) == len(many.ops) + 9_997 * len(
        [op for op in many.ops if op.runs > 1])


def _seconds(fn) -> float:
    import time

    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_bad_accumulate_is_refused():
    m = tiny(TINY_GPT2)
    for bad in (0, -1, 2.5):
        with pytest.raises(TapescopeError, match="accumulate"):
            profile_spec(m, accumulate=bad)


def test_cli_accumulate_writes_the_fact(tmp_path):
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "2", "--seq", "16",
                                 "--accumulate", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "2 micro-batches per step" in r.output
    assert json.loads(out.read_text())["facts"]["accumulate"] == 2


class _WarmUp(nn.Module):
    """Uses its second layer from its 5th call on: a counter the step reads (`int(calls)`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        y = self.a(x)
        if int(self.calls) > 4:
            y = self.b(y)
        return y.sum()


def test_a_step_that_reads_a_value_is_traced_in_full():
    """Micro-batches 2 and 3 of this model are alike, but the 5th is not: a step that decides
    on a value is never assumed to repeat. Truth: a real 8-micro-batch step's op sequence."""
    m = ModelSpec("warm-up", _WarmUp, (input_spec((4, 8)),))
    p = profile_spec(m, accumulate=8, steps=1)
    assert p.facts.get("accumulate_traced") is None and not p.trace.repeated
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, accumulate=8,
                          steps=1)
    ok, diff = same_ops(p, real_op_names(real, 1))
    assert ok, diff
    # README's bound: the 12 bytes of a Python scalar's tensor the allocator sees (`+= 1`)
    assert abs(p.peak_bytes - real.peaks[1]) <= 12


class _PythonCounter(_WarmUp):
    """The same warm-up, counted in a plain Python attribute (no tensor value read)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, x):
        self.n += 1
        y = self.a(x)
        if self.n > 4:
            y = self.b(y)
        return y.sum()


def test_a_step_that_moves_a_python_counter_is_traced_in_full():
    m = ModelSpec("python-counter", _PythonCounter, (input_spec((4, 8)),))
    p = profile_spec(m, accumulate=8, steps=1)
    assert p.facts.get("accumulate_traced") is None and not p.trace.repeated
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, accumulate=8,
                          steps=1)
    ok, diff = same_ops(p, real_op_names(real, 1))
    assert ok, diff


def test_a_real_run_of_many_micro_batches_keeps_a_bounded_record():
    """validate --accumulate N ran every micro-batch under one profiler session and kept every
    event (3.5 MB each; 20000 were OOM-killed). Every micro-batch still runs for real; the middle
    ones' sessions are read for their peaks (the allocator's own total) and dropped, their ops
    counted as verified repeats. The record of 40 micro-batches is the record of 12, and both
    runs' peaks and op sequences equal the prediction."""
    m = tiny(TINY_GPT2, batch=1, seq=8)
    kw = dict(loss_fn=m.loss_fn)
    runs = {n: run_real_steps(m.build, m.inputs, m.input_kwargs, accumulate=n, **kw)
            for n in (12, 40)}
    assert len(runs[40].events) == len(runs[12].events)
    assert len(runs[40].ops) == len(runs[12].ops)
    # micro-batches 4..N-1 of each step read as repeats of the third
    assert [c for _, _, c in runs[40].repeated] == [36, 36]
    for n, real in runs.items():
        p = profile_spec(m, accumulate=n)
        assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
        assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
        names = real_op_names(real, 2)
        assert names.count(f"(the micro-batch before, {n - 3} more times)") == 1
        ok, diff = same_ops(p, names)
        assert ok, diff
