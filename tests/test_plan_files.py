"""`--checkpoint plan.json` and checkpointing=: a file that is no plan is one line, before tracing;
a large plan is checked in linear time."""

import json
import time

import pytest
import torch.nn as nn
from typer.testing import CliRunner

from tapescope.capture.checkpointing import apply_policies
from tapescope.cli import app
from tapescope.errors import TapescopeError

from .conftest import TINY_GPT2


@pytest.mark.parametrize("content, text", [
    ({"policies": {"h.0": {"module": "h.0"}}}, 'whose "policies" is a list'),  # read as its keys
    ({"policies": [{"module": 3}]}, "cannot read a checkpointing policy from {'module': 3}"),
    ({"policies": [{"module": [[[["h.0"]]]]}]}, "cannot read a checkpointing policy"),
    ({"policies": [{"module": "h.0", "save_ops": "aten.mm.default"}]}, "cannot read a"),
    ({"policies": [["h.0", "full", [1]]]}, "cannot read a checkpointing policy"),
    ({"policies": [{"module": "h.0", "typo": 1}]}, "cannot read a checkpointing policy"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_a_file_that_is_no_plan_is_one_line(tmp_path, content, text):
    path = tmp_path / "plan.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "1", "--seq", "8", "-q",
                                 "--checkpoint", str(path)])
    assert r.exit_code == 1 and r.output.startswith("error: ") and text in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_a_large_plan_is_checked_in_linear_time():
    """30,000 policies: every pair compared took minutes (300,000 took 33 minutes)."""
    model = nn.Sequential(nn.Linear(2, 2))
    t0 = time.perf_counter()
    with pytest.raises(TapescopeError, match="no module 'x.0'"):
        apply_policies(model, [f"x.{i}" for i in range(30000)])
    assert time.perf_counter() - t0 < 5
    with pytest.raises(TapescopeError, match="one contains the other"):
        apply_policies(model, ["0", "1.a", "0.weight"])


def test_checkpointing_takes_a_list_not_a_dict():
    from tapescope.options import Options

    with pytest.raises(TapescopeError, match="takes a list of policies"):
        Options.create(checkpointing={"h.0": "full"})
