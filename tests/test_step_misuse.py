"""A step, a pipeline or a parallelisation used in a way the real run would refuse (or that gives
no step at all) is one line naming where, as PyTorch would say it; and nothing of the user's
process-wide torch settings changes by profiling."""

import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope
from tapescope.errors import TapescopeError

from . import distributed_models as dm

BATCH = (tapescope.spec((8, 16)), tapescope.spec((8,), dtype=torch.long))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def _backward_twice(model, batch, opt):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    loss.backward()


def _exits(model, batch, opt):
    sys.exit(3)


def _generator(model, batch, opt):
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    yield


async def _coroutine(model, batch, opt):
    x, y = batch
    F.cross_entropy(model(x), y).backward()


def test_backward_twice_is_refused_with_pytorchs_message():
    x = torch.randn(8, 16)
    y = torch.zeros(8, dtype=torch.long)
    with pytest.raises(RuntimeError) as real:  # the truth: what PyTorch says
        _backward_twice(_Net(), (x, y), None)
    with pytest.raises(TapescopeError) as e:
        tapescope.profile(_Net, *BATCH, step=_backward_twice)
    msg = str(e.value)
    assert " ".join(str(real.value).split()) in msg
    assert f"{__file__}:" in msg and "(_backward_twice)" in msg


def test_sys_exit_in_the_step_is_a_message_at_its_line():
    with pytest.raises(TapescopeError, match=r"called sys.exit\(3\)") as e:
        tapescope.profile(_Net, *BATCH, step=_exits)
    assert "(_exits)" in str(e.value)


@pytest.mark.parametrize("fn, kind", [(_generator, "a generator"), (_coroutine, "an async")])
def test_a_step_whose_body_never_runs_is_refused(fn, kind):
    with pytest.raises(TapescopeError, match=f"is {kind} function: calling it runs none"):
        tapescope.profile(_Net, *BATCH, step=fn)


def _changes_globals(model, batch, opt):
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("medium")


def test_the_steps_global_settings_do_not_outlive_the_profile():
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
              torch.get_float32_matmul_precision())
    tapescope.profile(_Net, *BATCH, step=_changes_globals, steps=1)  # no step after no_grad
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(),
            torch.get_float32_matmul_precision()) == before


def _broken_split(model, stage, num_stages):
    raise ValueError("my split is broken")


class _BrokenStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        raise ValueError("stage forward broken")


@pytest.mark.parametrize("build, pipeline, text", [
    (dm.pipeline_llama, {"schedule": None}, "pipeline schedule must be a schedule's name"),
    (dm.pipeline_llama, {"schedule": "1f1b", "split": _broken_split},
     "the pipeline split, making stage 0 of 2, raised ValueError at"),
    (_BrokenStage, {"schedule": "gpipe", "split": lambda m, s, n: m},
     "stage 0's forward raised ValueError at"),
])
def test_pipeline_user_code_failures_are_one_line(build, pipeline, text):
    inputs = dm.PIPELINE_INPUTS if build is dm.pipeline_llama else (torch.randn(4, 8),
                                                                     torch.randn(4, 8))
    with pytest.raises(TapescopeError, match=text) as e:
        tapescope.profile(build, *inputs, mesh={"pp": 2}, pipeline=pipeline)
    assert "\n" not in str(e.value)


def test_a_batch_that_does_not_split_evenly_into_micro_batches_is_refused():
    """torch.tensor_split(8 samples, 3) makes 3, 3, 2: the stage's fixed shapes fail on the last
    ("Failed to run stage backward", whose cause was cut off at its first line)."""
    assert [len(c) for c in torch.tensor_split(torch.empty(8), 3)] == [3, 3, 2]
    x = dm.PIPELINE_INPUTS
    with pytest.raises(TapescopeError, match=r"does not split into 3 equal micro-batches"):
        tapescope.profile(dm.pipeline_llama, *x, mesh={"pp": 2},
                          pipeline={"schedule": "1f1b", "microbatches": 3})


def test_an_fsdp_degree_past_every_parameters_rows_answers_fast():
    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_GPT2

    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "1", "--seq", "8", "-q",
                                 "--fsdp", "100000"])
    assert r.exit_code == 1 and time.perf_counter() - t0 < 10
    # the largest parameter: the MLP's c_fc, 4 x n_embd = 256 rows
    assert "largest parameter of GPT2 has 256 rows" in r.output
