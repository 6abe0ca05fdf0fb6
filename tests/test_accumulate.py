"""Gradient accumulation: N micro-batches (forward, loss / N, backward), one optimizer step.

Truth: the same loop run for real on the CPU under torch.profiler (validate.real: the allocator's
running total, the outermost dispatched ops), which runs capture.step.train_step as tapescope does.
"""

import json

import pytest
import torch.nn as nn

import tapescope
from tapescope.capture.records import BACKWARD, FORWARD
from tapescope.errors import TapescopeError
from tapescope.validate.harness import same_ops
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
    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops
                            if s == 2 and ph])
    assert ok, diff


def test_each_micro_batch_runs_forward_loss_over_n_and_backward():
    m = tiny(TINY_GPT2)
    one, four = profile_spec(m), profile_spec(m, accumulate=4)
    segments = [(s.step, s.phase) for s in four.trace.segments if s.step == 1]
    assert segments.count((1, FORWARD)) == 4 and segments.count((1, BACKWARD)) == 4
    fwd = lambda p: [op for op in p.ops if op.phase == FORWARD]  # noqa: E731
    # the loss divided by N, in the loss's module, once per micro-batch
    assert len(fwd(four)) == 4 * (len(fwd(one)) + 1)
    divs = [op for op in fwd(four) if op.name == "aten.div.Tensor" and op.module == "(loss)"]
    assert len(divs) == 4
    assert four.facts["accumulate"] == 4


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
