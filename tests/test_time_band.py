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
from .test_gpu_model import OneMatmul

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")


def test_band_by_hand_from_the_calibration_rows_and_the_mechanisms():
    """The band: the calibration rows' spread (and zero), plus each mechanism's range weighted
    by its share of the step's seconds, the weighted ends added (devices/uncertainty.py)."""
    from tapescope.devices.uncertainty import GEMM_LARGE, HOST, MECHANISMS, MEMORY_BOUND

    errors = {"fms-7b-a100": 0.0017, "fms-13b-a100": -0.1396, "fms-34b-a100": -0.0298}
    import tapescope.analysis.time_band as tb

    original = dict(tb.CALIBRATION_ERRORS)
    tb.CALIBRATION_ERRORS.clear()
    tb.CALIBRATION_ERRORS["distributed, eager"] = errors
    try:
        # calibration rows alone (no seconds given): their spread and zero
        band = band_for(time_kind(True, False))
        assert (band.n, band.low, band.high) == (3, -0.1396, 0.0017)
        assert band.text() == ("-14% to +0% (published runs like this one (distributed, eager): "
                               "-14% to +0%, n=3, widened by its mechanisms' uncertainty)")
        # a time error e is a rate error 1 / (1 + e) - 1: +16.2% and -0.2%
        assert band.rate_text().startswith("-0% to +16% (")
        # 1 s step: 0.6 s of large GEMMs, 0.3 s memory-bound, 0.1 s waiting for the host; on
        # several GPUs the GEMMs' 0.6 s also run at the lockstep clock (-4.5% to 0)
        seconds = {GEMM_LARGE: 0.6, MEMORY_BOUND: 0.3, HOST: 0.1}
        band = band_for(time_kind(True, False), seconds, 1.0, distributed=True)
        gemm, mem, host = (MECHANISMS[m] for m in (GEMM_LARGE, MEMORY_BOUND, HOST))
        assert (gemm.low, gemm.high, mem.low, mem.high, host.low, host.high) == \
            (-0.069, 0.0, -0.15, 0.15, -0.5, 0.5)
        low = -0.1396 + 0.6 * -0.069 + 0.3 * -0.15 + 0.1 * -0.5 + 0.6 * -0.045
        high = 0.0017 + 0.6 * 0.0 + 0.3 * 0.15 + 0.1 * 0.5 + 0.6 * 0.0
        assert band.low == pytest.approx(low) and band.high == pytest.approx(high)
        assert set(band.priors) == {MEMORY_BOUND, HOST}
        # a calibration row's own band leaves it out
        assert band_for(time_kind(True, False), leave_out="fms-13b-a100").low == -0.0298
        # a kind with no calibration row: the mechanisms alone, said so
        alone = band_for(time_kind(False, True), seconds, 1.0)
        assert alone.n == 0
        assert alone.low == pytest.approx(0.6 * -0.069 + 0.3 * -0.15 + 0.1 * -0.5)
        assert "mechanisms' uncertainty alone: no published run of this kind (single GPU, " \
            "compiled)" in alone.text()
        # a time priced from a calibration file: the same ranges, said to be the unmeasured ones
        assert "priced without a measurement" in \
            band_for(time_kind(False, False, True), seconds, 1.0).text()
        unknown = band_for(time_kind(False, True))
        assert unknown.n == 0 and unknown.low is None
        assert "no published run of this kind (single GPU, compiled)" in unknown.text()
    finally:
        tb.CALIBRATION_ERRORS.clear()
        tb.CALIBRATION_ERRORS.update(original)


def test_gemm_ranges_are_azures_measurements_against_the_model():
    """The GEMM mechanisms' ranges are the time errors of the model against Azure's cuBLASLt
    table (tests/test_gpu_model.py AZURE_GEMMS), split by size class: every dimension >= 4096
    (fitted 16384^3 rows included) and the rest. Recomputed here from the table."""
    from tapescope.devices.uncertainty import GEMM_LARGE, GEMM_OTHER, MECHANISMS

    from .test_gpu_model import azure_gemm_errors

    time_errors = {GEMM_LARGE: [], GEMM_OTHER: []}
    for _, shape, rate_error in azure_gemm_errors():
        cls = GEMM_LARGE if min(shape) >= 4096 else GEMM_OTHER
        time_errors[cls].append(1 / (1 + rate_error) - 1)
    assert len(time_errors[GEMM_LARGE]) == 14 and len(time_errors[GEMM_OTHER]) == 12
    for cls, errors in time_errors.items():
        assert MECHANISMS[cls].low == pytest.approx(min(errors), abs=5e-4)
        assert MECHANISMS[cls].high == pytest.approx(max(max(errors), 0.0), abs=5e-4)


def test_interpolated_attention_range_is_the_straight_line_error_on_the_cudnn_curves():
    """FlashAttention-2's curve is known at its ends only: a straight line in log2(seq) between
    the ends of each complete cuDNN curve (FlashAttention-3 paper) lies at most 16.4% below its
    known points, so a time at most 1 / (1 - 0.164) - 1 = +19.6% too long."""
    from tapescope.devices.efficiency import ATTENTION_CURVES, ATTENTION_SEQ, _on_curve
    from tapescope.devices.uncertainty import ATTENTION_INTERPOLATED, MECHANISMS

    worst = 0.0
    for key, curve in ATTENTION_CURVES.items():
        if None in curve:
            continue
        ends = (curve[0], *([None] * (len(curve) - 2)), curve[-1])
        for seq, value in zip(ATTENTION_SEQ[1:-1], curve[1:-1]):
            worst = min(worst, _on_curve(ends, seq) / value - 1)
    assert worst == pytest.approx(-0.164, abs=5e-4)
    assert MECHANISMS[ATTENTION_INTERPOLATED].high == pytest.approx(1 / (1 + worst) - 1, abs=5e-4)


def test_each_second_of_a_step_is_attributed_to_one_mechanism():
    """The compute stream's kernels, the waits for the host and for collectives add up to the
    step's wall time when nothing else holds it (one stream, no side streams)."""
    from tapescope.devices.uncertainty import GEMM_LARGE

    p = tapescope.profile(lambda: OneMatmul(8192), tapescope.spec((8192, 8192),
                                                                 dtype=torch.bfloat16),
                          device="cuda", dtype="bf16", gpu="h100", optimizer=None, steps=1)
    t = p.time
    assert sum(t.mechanisms.values()) == pytest.approx(t.seconds)
    # the forward 8192^3 matmul and its two backward ones (8192^3: every dimension >= 4096)
    assert t.mechanisms[GEMM_LARGE] > 0.9 * t.seconds
    assert t.bound == "gpu" and t.host_bound_phases == ()


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
    # no calibration row: a band from the mechanisms alone, its priors named
    assert d["n"] == 0 and d["low"] < 0 < d["high"] and "no published run of this kind" in d["text"]
    assert d["mechanisms"] and set(d["priors"]) <= set(d["mechanisms"])
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
    its time band: the ends swap), in the table and in --json."""
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_LLAMA

    out = tmp_path / "fit.json"
    r = CliRunner().invoke(app, ["fit", TINY_LLAMA, "--batch", "2", "--seq", "16", "--gpus", "2",
                                 "--gpu", "h100", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rows = [row for row in json.loads(out.read_text())["layouts"] if row["tokens_per_second"]]
    kind = f"published runs like this one ({time_kind(True, False)})"
    assert rows and all(kind in row["error_band"] for row in rows)
    for row in rows:   # each layout's own band (its mechanisms' shares differ), on the console
        assert f"tokens/s error: {row['error_band']}" in " ".join(r.output.split())


def test_attention_kernels_are_attributed_by_where_their_figure_comes_from():
    """A point of a complete published curve (cuDNN on Hopper), a curve known at its ends only
    (FlashAttention-2) or derived from the other mask's, a flat figure (Ampere), or nothing."""
    from tapescope.analysis.kernel_cost import AttentionShape
    from tapescope.devices.efficiency import attention_provenance

    causal = AttentionShape(32, 4096, 4096, 128, True)
    full = AttentionShape(32, 4096, 4096, 128, False)
    cudnn = "aten._scaled_dot_product_cudnn_attention.default"
    cudnn_bwd = "aten._scaled_dot_product_cudnn_attention_backward.default"
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert attention_provenance(cudnn, "hopper", causal) == "curve"
    assert attention_provenance(cudnn_bwd, "hopper", full) == "curve"
    # the causal backward is derived from the non-causal one by the forward's mask ratio
    assert attention_provenance(cudnn_bwd, "hopper", causal) == "interpolated"
    assert attention_provenance(flash, "hopper", causal) == "interpolated"
    assert attention_provenance(flash, "ampere", causal) == "flat"
    assert attention_provenance(flash, "volta", causal) == "none"
