"""The error band every predicted step time carries: the spread of the model's error on the
published calibration runs of the step's kind, by hand; and where the reports show it."""

import importlib.util
import os
import sys

import pytest
import torch

import tapescope
from tapescope.analysis.time_band import band_for, time_kind
from tapescope.devices.time_bands import CALIBRATION_ERRORS

from . import distributed_models as dm

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")


def test_band_by_hand_from_the_calibration_rows():
    errors = {"fms-7b-a100": 0.0017, "fms-13b-a100": -0.1396, "fms-34b-a100": -0.0298}
    import tapescope.analysis.time_band as tb

    original = dict(tb.CALIBRATION_ERRORS)
    tb.CALIBRATION_ERRORS.clear()
    tb.CALIBRATION_ERRORS["distributed, eager"] = errors
    try:
        band = band_for(time_kind(True, False))
        assert (band.n, band.low, band.high) == (3, -0.1396, 0.0017)
        assert band.text() == "published runs like this one (distributed, eager): -14% to +0%, n=3"
        # a time error e is a rate error 1 / (1 + e) - 1: +16.2% and -0.2%
        assert band.rate_text() == ("published runs like this one (distributed, eager): -0% to "
                                    "+16%, n=3")
        unknown = band_for(time_kind(False, True))
        assert unknown.n == 0 and unknown.low is None
        assert "no published run of this kind (single GPU, compiled)" in unknown.text()
    finally:
        tb.CALIBRATION_ERRORS.clear()
        tb.CALIBRATION_ERRORS.update(original)


def test_the_band_data_is_what_the_benchmark_computes_from_its_calibration_rows():
    """devices/time_bands.py is generated from the calibration rows: a tokens/s row predicted
    at 1.25x its published figure is a time error of 1 / 1.25 - 1 = -20%; held-out rows and
    memory rows never enter."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "published_runs.py")
    spec = importlib.util.spec_from_file_location("published_runs", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench   # dataclasses look their module up there
    spec.loader.exec_module(bench)
    rows = {r.name: r for r in bench.ROWS}
    cal = rows["fms-7b-a100"]
    results = {cal.name: {"value": cal.published * 1.25, "kind": "distributed, eager"},
               "fms-7b-h100": {"value": 1.0, "kind": "distributed, eager"},
               "litgpt-7b-lora-mb1": {"value": 20.0}}
    assert bench.calibration_errors(bench.ROWS, results) == {"distributed, eager":
                                                             {cal.name: -0.2}}
    # every calibration row with a step time is in the data, under one kind
    named = {name for kind in CALIBRATION_ERRORS.values() for name in kind}
    assert named == {r.name for r in bench.ROWS
                     if r.role == "calibration" and r.metric == "tokens/s/GPU"}


def test_profiles_show_their_band_in_json_and_console():
    from rich.console import Console

    from tapescope.report.console import render_summary

    single = tapescope.profile(dm.build, dm.INPUT, device="cuda", gpu="h100")
    assert single.time.band.kind == "single GPU, eager" and single.time.band.n == 0
    d = single.time.to_dict()["error_band"]
    assert d["n"] == 0 and "no published run of this kind" in d["text"]
    sharded = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp,
                                device="cuda", gpu="h100")
    band = sharded.time.band
    assert band.kind == "distributed, eager"
    assert band.n == len(CALIBRATION_ERRORS["distributed, eager"]) > 0
    console = Console(record=True, width=200)
    render_summary(sharded, console)
    assert f"step time error: {band.text()}" in console.export_text()
    # the HTML report's data and its script: the band's text under "Time error"
    from tapescope.report.html import render_html
    from tapescope.report.page_data import page_data

    assert page_data(sharded)["meta"]["time"]["error_band"] == band.text()
    assert 'add("Time error", t.error_band)' in render_html(sharded)


def test_fit_layouts_carry_the_band_of_their_kind(tmp_path):
    """`tapescope fit --gpus`: each layout's throughput carries its band (the tokens/s form of
    the time band: the ends swap), in the table and in --json."""
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_LLAMA

    out = tmp_path / "fit.json"
    r = CliRunner().invoke(app, ["fit", TINY_LLAMA, "--batch", "2", "--seq", "16", "--gpus", "2",
                                 "--gpu", "h100", "--json", str(out)])
    assert r.exit_code == 0, r.output
    band = band_for(time_kind(True, False))
    assert f"tokens/s error: {band.rate_text()}" in " ".join(r.output.split())
    rows = json.loads(out.read_text())["layouts"]
    assert rows and all(row["error_band"] == band.rate_text() for row in rows
                        if row["tokens_per_second"])
