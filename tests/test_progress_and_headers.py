"""What the commands say while they work and in their first line: a plain progress line per stage
on stderr when it is no terminal (a CI log, a pipe), and headers that describe the whole job."""

import torch
from typer.testing import CliRunner

from tapescope.cli import _progress, app

from .conftest import TINY_LLAMA


def test_progress_is_plain_lines_when_stderr_is_no_terminal(capsys):
    with _progress("tracing m", delay=0) as update:
        update("layout FSDP 2 (1 of 2)")
        update(1, "forward")
    err = capsys.readouterr().err.splitlines()
    assert "tapescope: tracing m - layout FSDP 2 (1 of 2) (0 s)" in err
    assert "tapescope: tracing m - layout FSDP 2 (1 of 2) - step 1 forward done (0 s)" in err


def test_quiet_keeps_stderr_empty(capsys):
    with _progress("tracing m", quiet=True, delay=0) as update:
        update("a stage")
    assert capsys.readouterr().err == ""


def test_validate_takes_a_step_and_says_what_warmup_and_steps_are():
    r = CliRunner().invoke(app, ["validate", "--help"], env={"COLUMNS": "200"})
    out = " ".join(r.output.split())
    assert "--step" in out and "--setup" in out
    assert "Real steps run before the timed ones" in out and "Real steps timed" in out


def test_headers_name_fsdp_mixed_precision_and_the_whole_models_parameters():
    from tapescope.zoo import resolve

    n = sum(p.numel() for p in resolve(TINY_LLAMA, batch=4, seq=16).build().parameters())
    base = ["profile", TINY_LLAMA, "--batch", "4", "--seq", "16", "--device", "cuda", "--gpu",
            "h100", "-q"]
    r = CliRunner().invoke(app, base + ["--fsdp", "2", "--amp", "bf16"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    assert "float32 + FSDP2 mixed precision bfloat16" in " ".join(r.output.split())
    r = CliRunner().invoke(app, base + ["--pp", "2"], env={"COLUMNS": "300"})
    assert r.exit_code == 0, r.output
    from tapescope.report.text import fmt_count

    assert f"on this rank's stages of {fmt_count(n)}" in " ".join(r.output.split())


def test_a_peak_in_the_optimizer_names_no_module():
    """AdamW's update runs outside every module: the peak line said "in module -"."""
    from .conftest import TINY_GPT2

    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "1", "--seq", "8", "-q"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if "reached at op" in x)
    assert "(optimizer) at adam.py:" in line and "in module" not in line
