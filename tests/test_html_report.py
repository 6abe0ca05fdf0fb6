"""The HTML report in a real headless browser (Debian's chromium driven by Playwright), and the PNG.

What a person would check: the page opens offline with no console error, the chart is drawn and its
tooltip names ops, the peak is marked where the profile says, the module table sorts and folds, a
hostile module name stays text, and a 100k-op step opens in under 3 seconds.
"""

import dataclasses
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.analysis.memory import LiveGroup, LiveTensor, MemoryReport, ModuleMemory
from tapescope.analysis.ops import Op
from tapescope.api import Profile
from tapescope.capture.records import CATEGORIES, Frame, RunFacts, StorageRecord, Trace
from tapescope.report.downsample import downsample
from tapescope.report.html import render_html, write_html
from tapescope.report.png import write_png
from tapescope.report.text import fmt_bytes, fmt_flops

from .conftest import TINY_GPT2, TINY_LLAMA, profile_spec, tiny

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM = os.environ.get("TAPESCOPE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# ---- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2():
    m = tiny(TINY_GPT2)
    return profile_spec(m, name=m.name)


@pytest.fixture(scope="module")
def gpt2_html(gpt2, tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "gpt2.html"
    write_html(gpt2, path)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One chromium with a fresh profile directory; each test opens its own page in it."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            headless=True, args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(30_000)
        yield ctx
        ctx.close()


class Opened:
    """A report page, with every console error and uncaught exception it produced."""

    def __init__(self, browser, path):
        self.page = browser.new_page()
        self.errors = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.dialogs = []  # alert() and the like: injected code that ran
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        # the page must work offline: any request leaving the file is an error
        self.requests = []
        self.page.on("request", lambda r: r.url.startswith("file:") or self.requests.append(r.url))
        t0 = time.perf_counter()
        self.page.goto(Path(path).resolve().as_uri())
        self.page.wait_for_function("document.body.dataset.ready === '1'")
        self.seconds = time.perf_counter() - t0

    def rows(self, selector):
        return self.page.locator(selector).all_inner_texts()


def opened(browser, path):
    return Opened(browser, path)


# ---- the page in a browser -------------------------------------------------------------------

def test_page_loads_offline_without_errors(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    assert o.errors == [] and o.requests == []
    header = o.page.locator("header").inner_text()
    assert "zoo:gpt2" in header and "2×32 int64" in header and "AdamW (for-loop)" in header
    assert fmt_bytes(gpt2.peak_bytes) in header and fmt_bytes(gpt2.first_step_peak_bytes) in header
    assert fmt_flops(gpt2.flops["total"]) in header
    assert tapescope.__version__ in header
    o.page.close()


def test_chart_is_drawn_with_every_op(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    # a small step is not downsampled: one point per op, and the stack's top is the timeline
    xs = o.page.evaluate("tapescopeReport.chart.data[0]")
    assert xs == list(range(len(gpt2.ops)))
    top = o.page.evaluate("tapescopeReport.chart.data[1]")
    assert top == gpt2.memory.timeline
    # painted: most of the plot area is not background
    painted = o.page.evaluate("""() => {
        const c = document.querySelector('#chart canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 230 || d[i + 1] < 230)) n++;
        return n / (c.width * c.height);
    }""")
    assert painted > 0.3
    o.page.close()


def test_hover_at_the_peak_names_the_op_module_and_bytes(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    page = o.page
    assert page.locator("#tooltip").is_hidden()
    marker = page.locator("#peak-marker")
    assert marker.is_visible()
    box = marker.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2 + 20)
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    op = gpt2.ops[gpt2.memory.peak_op]
    assert f"#{op.index} {op.name}" in text
    assert f"module {op.module or '(root)'}" in text
    assert fmt_bytes(gpt2.peak_bytes) in text
    for category, nbytes in gpt2.memory.at_peak.items():
        if nbytes:
            assert category in text
    # elsewhere on the chart: another op
    chart = page.locator("#chart .u-over").bounding_box()
    for op in (gpt2.ops[0], gpt2.ops[-2], gpt2.ops[len(gpt2.ops) // 2]):
        x = page.evaluate(f"tapescopeReport.chart.valToPos({op.index}, 'x')")
        page.mouse.move(chart["x"] + x, chart["y"] + chart["height"] / 2)
        text = tip.inner_text()
        assert f"#{op.index} {op.name}" in text and f"{op.phase} module" in text
    assert o.errors == []
    page.close()


def test_peak_is_marked_where_the_profile_says(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    page = o.page
    label = page.locator(".peak-label").inner_text()
    assert fmt_bytes(gpt2.peak_bytes) in label and f"#{gpt2.memory.peak_op}" in label
    # the marker sits on the top of the stack at the peak op, in chart coordinates
    pos = page.evaluate("""() => {
        const u = tapescopeReport.chart, m = document.getElementById('peak-marker');
        return [u.posToVal(parseFloat(m.style.left), 'x'), u.posToVal(parseFloat(m.style.top), 'y')];
    }""")
    assert abs(pos[0] - gpt2.memory.peak_op) < 1
    assert abs(pos[1] - gpt2.peak_bytes) < 0.01 * gpt2.peak_bytes
    summary = page.locator("#peak-summary").inner_text()
    assert f"#{gpt2.memory.peak_op} {gpt2.ops[gpt2.memory.peak_op].name}" in summary
    page.close()


def test_live_tensors_at_the_peak_largest_first(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    rows = o.rows("#live-table tbody tr")
    groups = gpt2.memory.live_groups  # repeats counted over every tensor alive at the peak
    assert len(rows) == len(groups) and any(g.count > 1 for g in groups)  # per-layer repeats
    assert sum(g.nbytes for g in groups) <= gpt2.peak_bytes
    for row, g in zip(rows, groups):
        count = f" \u00d7{g.count}" if g.count > 1 else ""
        assert row.startswith(fmt_bytes(g.first.nbytes) + count) and g.first.category in row
    made = next(g.first for g in groups if g.first.op is not None)
    row = rows[[g.first for g in groups].index(made)]
    assert f"#{made.op} {made.op_name}" in row and made.source.rsplit("/", 1)[-1] in row
    o.page.close()


def _depth1(page, column):
    """(module, value) of the root's children, in the order shown."""
    return page.evaluate("""(col) => {
        const ths = [...document.querySelectorAll('#module-table thead th')];
        const k = ths.findIndex(th => th.textContent === col);
        return [...document.querySelectorAll('#module-table tbody tr[data-depth="1"]')].map(tr =>
            [tr.dataset.fqn, Number(tr.children[k].dataset.value ?? NaN)]);
    }""", column)


def test_module_table_sorts_and_folds(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    page = o.page
    rows = _depth1(page, "FLOPs")
    assert {m for m, _ in rows} >= {"wte", "wpe", "h", "ln_f", "lm_head"}
    # default: execution order
    assert [m for m, _ in rows][:2] == ["wte", "wpe"]
    header = page.locator("#module-table th", has_text="FLOPs")
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    rows = _depth1(page, "FLOPs")
    values = [v for _, v in rows]
    assert values == sorted(values, reverse=True)
    assert rows[0] == ["h", gpt2.module_flops["h"]]
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    values = [v for _, v in _depth1(page, "FLOPs")]
    assert values == sorted(values)
    # sort by name; then fold and unfold the tree
    page.locator("#module-table th", has_text="Module").click()
    names = [m for m, _ in _depth1(page, "FLOPs")]
    assert names == sorted(names, key=str.lower)
    page.locator("#module-controls button", has_text="3").click()
    assert page.locator('#module-table tr[data-fqn="h.0.attn"]').is_visible()
    page.locator('#module-table tr[data-fqn="h"] button.toggle').click()
    assert page.locator('#module-table tr[data-fqn="h.0"]').count() == 0
    page.locator('#module-table tr[data-fqn=""] button.toggle').click()
    assert page.locator("#module-table tbody tr").count() == 1
    assert o.errors == []
    page.close()


def test_module_table_values(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    page = o.page
    page.locator("#module-controls button", has_text="2").click()
    cells = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#module-table tbody tr')].map(tr => [tr.dataset.fqn,
        [...tr.children].slice(1).map(td => td.dataset.value === undefined ? null : Number(td.dataset.value))]))""")
    peaks = {m.module: m for m in gpt2.memory.modules}
    # parameters of a module: sum of its parameter tensors (the tied lm_head weight counts once)
    params = {name: p.numel() * 4 for name, p in tiny(TINY_GPT2).build().named_parameters()}
    for fqn in ("h.0", "h.1", "wte", "ln_f"):
        first, pbytes, saved, peak, flops = cells[fqn]
        assert pbytes == sum(v for k, v in params.items() if k.startswith(fqn + "."))
        assert (saved, peak) == (peaks[fqn].saved_bytes, peaks[fqn].peak_bytes)
        assert flops == gpt2.module_flops[fqn]
        assert first == min(op.index for op in gpt2.ops if op.module and
                            (op.module == fqn or op.module.startswith(fqn + ".")))
    assert cells[""][1] == gpt2.facts["parameters"] * 4
    page.close()


def test_time_column_only_with_a_time_estimate(browser, gpt2, tmp_path):
    plain = tmp_path / "plain.html"
    write_html(gpt2, plain)
    o = opened(browser, plain)
    assert o.page.locator("#module-table th", has_text="Time").count() == 0
    o.page.close()


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_gpu_profile_page_shows_what_the_console_prints(browser, tmp_path):
    """Through the real command: `profile zoo:llama --gpu h100 --amp bf16 --html` shows the same
    step time, MFU, allocator figures and verdict in the page as in the console."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    html, js = tmp_path / "r.html", tmp_path / "r.json"
    r = CliRunner().invoke(app, ["profile", TINY_LLAMA, "--batch", "2", "--seq", "32", "--gpu",
                                 "h100", "--amp", "bf16", "--html", str(html), "--json", str(js)],
                           terminal_width=200)
    assert r.exit_code == 0, r.output
    d = json.loads(js.read_text())
    t, cm = d["time"], d["cuda_memory"]
    console = " ".join(r.output.split())
    o = opened(browser, html)
    header = " ".join(o.page.locator("header").inner_text().split())
    assert f"step time {t['seconds'] * 1e3:.1f} ms" in console
    assert f"{t['seconds'] * 1e3:.3f} ms, {t['bound']}-bound, MFU {100 * t['mfu']:.1f}%" in header
    for figure in (cm["max_allocated"], cm["max_reserved"], cm["nvidia_smi"], cm["capacity"]):
        assert fmt_bytes(figure) in console and fmt_bytes(figure) in header
    verdict = "does not fit" if cm["oom"] else "fits"
    assert verdict in console and verdict in header
    assert d["gpu"]["name"] in header and d["gpu"]["key"] not in header
    assert not o.errors
    o.page.close()


def test_module_time_column_rolls_up_the_step_time(browser, tmp_path):
    p = profile_spec(tiny(TINY_LLAMA), name="llama", device="cuda", gpu="h100", amp="bf16") \
        if torch.backends.cuda.is_built() else None
    if p is None:
        pytest.skip("needs a CUDA build of torch")
    path = tmp_path / "timed.html"
    write_html(p, path)
    o = opened(browser, path)
    assert o.page.locator("#module-table th", has_text="Time (est.)").count() == 1
    root = o.page.locator('#module-table tr[data-fqn=""] td').last.inner_text()
    expected = sum(t for op, t in zip(p.ops, p.time.op_seconds) if op.module is not None)
    assert root == (f"{expected * 1e6:.2f} µs" if expected < 1e-3 else f"{expected * 1e3:.3f} ms")
    o.page.close()


def test_forward_backward_map_and_uncounted_ops(browser, gpt2, gpt2_html):
    o = opened(browser, gpt2_html)
    page = o.page
    with_node = [op for op in gpt2.ops if op.phase == "forward" and op.autograd_node]
    rows = o.rows("#fwd-table tbody tr")
    assert len(rows) == len(with_node)
    addmm = next(op for op in with_node if op.name == "aten.addmm.default")
    backward = [op for op in gpt2.ops if op.forward_op == addmm.index]
    row = rows[with_node.index(addmm)]
    assert row.startswith(f"#{addmm.index} aten.addmm.default") and "AddmmBackward0" in row
    assert backward and all(f"#{b.index} {b.name}" in row for b in backward)
    page.locator("#fwd-filter").fill("addmmbackward")
    n = sum(1 for op in with_node if op.autograd_node == "AddmmBackward0")
    assert len(o.rows("#fwd-table tbody tr")) == n
    assert "Every op has a FLOP formula." in page.locator("#uncounted").inner_text()
    page.close()


class _Hostile(nn.Module):
    def __init__(self):
        super().__init__()
        # module names cannot hold a dot, so these call alert(), which the page would report
        self.add_module("<script>alert(1)</script>", nn.Linear(4, 4))
        self.add_module('<img src=x onerror="alert(2)">', nn.Linear(4, 4))

    def forward(self, x):
        for m in self.children():
            x = m(x)
        return x


def test_hostile_names_render_as_text(browser, tmp_path):
    name = "</script><script>window.__pwned=3</script>"
    p = tapescope.profile(_Hostile(), tapescope.spec((2, 4)), name=name)
    path = tmp_path / "hostile.html"
    write_html(p, path)
    text = path.read_text()
    assert text.count("</script>") == 2  # the data element's and the page script's own
    o = opened(browser, path)
    page = o.page
    assert page.evaluate("window.__pwned") is None
    assert page.evaluate("document.scripts.length") == 2
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.locator("#model").inner_text() == name
    assert page.title() == f"tapescope · {name}"
    table = page.locator("#module-table").inner_text()
    assert "<script>alert(1)</script>" in table
    assert '<img src=x onerror="alert(2)">' in table
    chart = page.locator("#chart .u-over").bounding_box()
    page.mouse.move(chart["x"] + chart["width"] * 0.2, chart["y"] + chart["height"] / 2)
    assert page.evaluate("window.__pwned") is None
    assert o.dialogs == [] and o.errors == []
    page.close()


def test_100k_op_step_opens_in_under_3_seconds(browser, tmp_path, record_property):
    p = synthetic_profile(layers=2500)
    assert len(p.ops) >= 100_000
    path = tmp_path / "big.html"
    t0 = time.perf_counter()
    write_html(p, path)
    write_s = time.perf_counter() - t0
    o = opened(browser, path)
    record_property("write_html_s", round(write_s, 3))
    record_property("open_s", round(o.seconds, 3))
    record_property("html_bytes", path.stat().st_size)
    print(f"\n100k-op report: write_html {write_s:.2f} s, {path.stat().st_size / 2**20:.2f} MiB, "
          f"opened in {o.seconds:.2f} s")
    assert o.errors == []
    assert o.seconds < 3.0
    xs = o.page.evaluate("tapescopeReport.chart.data[0]")
    top = o.page.evaluate("tapescopeReport.chart.data[1]")
    assert len(xs) <= 4000
    # the peak survives downsampling exactly, and so does the highest spike of each stretch
    k = xs.index(p.memory.peak_op)
    assert top[k] == p.peak_bytes == max(top)
    assert o.page.locator("#peak-marker").is_visible()
    uncounted = o.rows("#uncounted-table tbody tr")
    assert uncounted == [f"aten._local_scalar_dense.default\t{p.uncounted_ops['aten._local_scalar_dense.default']}"]
    o.page.close()


def test_screenshot(browser, gpt2, gpt2_html):
    """Saves artifacts/report.png: the top of the page with the tooltip at the peak."""
    o = opened(browser, gpt2_html)
    box = o.page.locator("#peak-marker").bounding_box()
    o.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + 80)
    o.page.locator("#tooltip").wait_for(state="visible")
    ARTIFACTS.mkdir(exist_ok=True)
    o.page.screenshot(path=str(ARTIFACTS / "report.png"))
    assert (ARTIFACTS / "report.png").stat().st_size > 20_000
    o.page.close()


# ---- without a browser ------------------------------------------------------------------------

def test_json_is_escaped_for_its_script_element(gpt2):
    hostile = dataclasses.replace(gpt2, model="</script><!--<script>&amp;\u2028")
    text = render_html(hostile)
    data = text[text.index('id="tapescope-data">'):]
    data = data[:data.index("</script>")]
    assert "<" not in data[len('id="tapescope-data">'):] and "&" not in data
    assert "\\u003c/script\\u003e\\u003c!--" in data and "\\u2028" in data


def test_downsample_keeps_spikes_and_the_peak():
    rng = random.Random(0)
    values = [rng.randrange(100) for _ in range(100_000)]
    values[12_345] = 1_000          # the peak
    values[70_001] = 900            # a one-op spike
    values[50_000] = -5             # a one-op dip
    idx = downsample(values, 4000, keep=[12_345])
    assert len(idx) <= 4000 and idx == sorted(set(idx))
    assert {0, 99_999, 12_345, 70_001, 50_000} <= set(idx)
    assert downsample(values[:10], 4000) == list(range(10))
    # the kept points bound every bucket: each stretch's max is among them
    assert max(values[i] for i in idx) == 1_000


def test_write_png(gpt2, tmp_path):
    path = tmp_path / "timeline.png"
    write_png(gpt2, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1500, 630)  # 10 x 4.2 inches at 150 dpi
    ARTIFACTS.mkdir(exist_ok=True)
    write_png(gpt2, ARTIFACTS / "timeline.png")


def test_write_png_of_a_100k_op_step(tmp_path):
    path = tmp_path / "big.png"
    write_png(synthetic_profile(layers=2500), path)
    assert path.stat().st_size > 20_000


# ---- a 100k-op profile, built directly (tracing one takes ~20 s) -------------------------------

_FWD = [("aten.t.default", "TBackward0"), ("aten.addmm.default", "AddmmBackward0"),
        ("aten.relu.default", "ReluBackward0"), ("aten.view.default", None)]
_BWD = [(2, "aten.threshold_backward.default"), (1, "aten.mm.default"), (1, "aten.t.default"),
        (1, "aten.mm.default"), (1, "aten.sum.dim_IntList"), (1, "aten.view.default"),
        (0, "aten.t.default"), (None, "aten.add_.Tensor")]
_OPT = ["aten.lerp_.Scalar", "aten.mul_.Tensor", "aten.addcmul_.default", "aten.add.Tensor",
        "aten.pow.Tensor_Scalar", "aten.sqrt.default", "aten.div.Tensor", "aten.add_.Scalar",
        "aten.mul_.Scalar", "aten.addcdiv_.default", "aten.copy_.default", "aten.neg.default",
        "aten.rsub.Scalar", "aten._local_scalar_dense.default"] * 2


def synthetic_profile(layers: int) -> Profile:
    """A Profile of `layers` Linear+ReLU blocks with a for-loop AdamW: 40 ops per block, a
    plausible memory timeline and one single-op spike that is the peak."""
    rng = random.Random(0)
    frame = Frame("/models/deep.py", 12, "forward")
    ops, fwd_index = [], {}

    def add(name, phase, module, forward_op=None, node=None, flops=None):
        ops.append(Op(index=len(ops), name=name, phase=phase, module=module, seq_nr=None,
                      forward_op=forward_op, autograd_node=node, inputs=(), outputs=(), flops=flops,
                      bytes_read=0, bytes_written=0, saved=node is not None, source=frame,
                      record=None))

    for layer in range(layers):
        for k, (name, node) in enumerate(_FWD):
            fwd_index[layer, k] = len(ops)
            add(name, "forward", f"layers.{layer}", node=node, flops=64 if k == 1 else 0)
    for layer in reversed(range(layers)):
        for k, name in _BWD:
            add(name, "backward", f"layers.{layer}",
                forward_op=None if k is None else fwd_index[layer, k], flops=64)
    for layer in range(layers):
        for name in _OPT:
            add(name, "optimizer", f"layers.{layer}",
                flops=None if name.startswith("aten._local") else 16)

    n, param = len(ops), 80  # bytes of one block's weight and bias
    n_fwd, n_bwd = 4 * layers, 8 * layers
    timeline = {c: [0] * n for c in CATEGORIES}
    for i in range(n):
        timeline["parameters"][i] = param * layers
        timeline["optimizer state"][i] = 2 * param * layers
        if i < n_fwd:
            timeline["saved activations"][i] = 16 * (i // 4 + 1)
        elif i < n_fwd + n_bwd:
            done = (i - n_fwd) // 8
            timeline["saved activations"][i] = 16 * (layers - done)
            timeline["gradients"][i] = param * done
        else:
            timeline["gradients"][i] = param * layers
        timeline["temporaries"][i] = rng.randrange(0, 64)
    peak_op = n_fwd + 3 * 8 + 5
    timeline["temporaries"][peak_op] = 500_000  # one op, far narrower than a chart bucket
    total = [sum(timeline[c][i] for c in CATEGORIES) for i in range(n)]
    peak = total[peak_op]
    assert peak == max(total)

    trace = Trace(step2="reused")
    for layer in range(layers):
        for suffix, nbytes in (("weight", 64), ("bias", 16)):
            sid = len(trace.storages)
            trace.storages.append(StorageRecord(sid, nbytes, None, None, {"parameters"}))
            trace.storage_owner[sid] = f"layers.{layer}.{suffix}"
    memory = MemoryReport(
        step=2, peak_bytes=peak, peak_op=peak_op,
        at_peak={c: timeline[c][peak_op] for c in CATEGORIES},
        live_at_peak=[LiveTensor(0, 500_000, "temporaries", peak_op, ops[peak_op].name,
                                 ops[peak_op].module, None, str(frame))],
        live_groups=[LiveGroup(LiveTensor(0, 500_000, "temporaries", peak_op, ops[peak_op].name,
                                          ops[peak_op].module, None, str(frame)),
                               1, ops[peak_op].module, None, 500_000)],
        timeline=total, timeline_by_category=timeline, initial_bytes=total[0],
        final_bytes=total[-1],
        modules=[ModuleMemory("", peak, 16 * layers)] + [
            ModuleMemory(f"layers.{k}", max(total[4 * k:4 * k + 4]), 16) for k in range(layers)])
    return Profile(model="synthetic deep MLP", device="cpu", dtype=None,
                   inputs=[{"shape": [1, 4], "dtype": "float32"}], steps=2, ops=ops, memory=memory,
                   first_step_peak_bytes=peak - 2 * param * layers,
                   run=RunFacts(parameters=20 * layers, param_dtype=None,
                                optimizer={"name": "AdamW", "implementation": "for-loop"},
                                amp=None),
                   trace=trace)


def test_gpu_chart_puts_phases_in_proportion_to_their_time(browser, tmp_path, gpt2, gpt2_html):
    """With a time estimate the chart's x axis is time: each phase spans its estimated time (a
    for-loop optimizer's many small ops no longer take most of the width); without one it is
    the op index."""
    import math

    from tapescope.report.page_data import page_data

    if not torch.backends.cuda.is_built():
        pytest.skip("needs a CUDA build of torch")
    p = profile_spec(tiny(TINY_LLAMA), name="llama", device="cuda", gpu="h100", amp="bf16")
    T = page_data(p)["timeline"]
    from tapescope.report.phases import phase_runs

    for (phase, a, b), (name, t0, t1) in zip(phase_runs(p.ops), T["phase_t"], strict=True):
        assert name == phase
        assert math.isclose(t1 - t0, 1e3 * sum(p.time.op_seconds[a:b]), rel_tol=1e-9,
                            abs_tol=1e-12)
    assert math.isclose(T["t_end"], 1e3 * sum(p.time.op_seconds), rel_tol=1e-9)
    path = tmp_path / "timed.html"
    write_html(p, path)
    o = opened(browser, path)
    assert o.page.locator("#chart").get_attribute("data-axis") == "time" and not o.errors
    o.page.close()
    o = opened(browser, gpt2_html)
    assert o.page.locator("#chart").get_attribute("data-axis") == "op"
    o.page.close()


def _section_texts(o) -> dict:
    """Each optional section of the page: title -> its whole text, whitespace collapsed."""
    out = {}
    for sec in o.page.locator("#sections section").all():
        out[sec.locator("h2").inner_text()] = " ".join(sec.inner_text().split())
    return out


def test_per_rank_and_checkpointing_tables_are_in_the_page(browser, tmp_path):
    """The page had none of the console's distributed, checkpointing or compiled tables: each
    is now in the page with the console's rows (report/sections.py writes them once)."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    html = tmp_path / "fsdp.html"
    r = CliRunner().invoke(app, ["profile", TINY_LLAMA, "--batch", "2", "--seq", "16", "--fsdp",
                                 "2", "--html", str(html), "-q"], terminal_width=250)
    assert r.exit_code == 0, r.output
    o = opened(browser, html)
    sections = _section_texts(o)
    assert list(sections) == ["Per rank", "Collectives of rank 0 per step"]
    console_rows = [line.split() for line in r.output.splitlines() if line.startswith("0-1 ")]
    assert console_rows and " ".join(console_rows[0]) in sections["Per rank"]
    assert "Mesh dp_shard 2 = 2 ranks" in sections["Per rank"]
    assert "all_gather" in sections["Collectives of rank 0 per step"]
    assert not o.errors
    o.page.close()

    from .test_cli_probe import _CheckpointedDeep

    p = tapescope.profile(_CheckpointedDeep, tapescope.spec((64, 64)), steps=1, optimizer=None)
    write_html(p, tmp_path / "ckpt.html")
    o = opened(browser, tmp_path / "ckpt.html")
    text = _section_texts(o)["Activation checkpointing"]
    recomputed = sum(op.recompute for op in p.ops)
    assert f"recomputes {recomputed} ops in the backward" in text
    rows = o.rows("#sections tbody tr")
    assert sum(int(row.split("\t")[1]) for row in rows) == recomputed
    assert not o.errors
    o.page.close()
