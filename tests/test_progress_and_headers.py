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


def test_a_compiled_step_s_module_table_shows_no_saved_bytes_it_cannot_know():
    """A compiled graph's saved tensors belong to no module (the partitioner saves them for the
    whole graph): the module table said "0 B" saved for every module; it shows "-", and the
    graph's saved tensors have their own table."""
    import io

    import torch.nn as nn
    from rich.console import Console

    import tapescope
    from tapescope.report.console import render_summary

    p = tapescope.profile(lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)),
                          tapescope.spec((8, 16)), compile=True, steps=1)
    assert p.compiled is not None and p.compiled.graphs
    buf = io.StringIO()
    render_summary(p, Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    table = lines[lines.index(next(x for x in lines if "Top modules by memory" in x)) + 2:]
    rows = table[:next(i for i, x in enumerate(table) if not x.startswith(("0", "1", "2", "(")))]
    assert rows and all(x.split()[-1] == "-" for x in rows), rows
