"""`tapescope calibrate` and `--calibration FILE`, without a GPU.

The measurement path runs on the CPU with the timer injected (the probes build and run their
kernels; the times are the test's own). A calibrated profile's kernel times are checked against
the figures of tests/data/calibration_h100_sxm.json, computed here by hand: a shape the file
measured takes its measured seconds, another the nearest one's scaled by its FLOPs or bytes.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import tapescope
from tapescope.analysis.calibrated_cost import calibrated_seconds
from tapescope.analysis.kernel_cost import Kernel, kernel_of, kernel_time
from tapescope.analysis.op_classes import launches_kernel
from tapescope.calibration import profile_kernels
from tapescope.calibration.measure import run_probes
from tapescope.calibration.probes import (attention_probe, bandwidth_probe, gemm_probe,
                                          launch_probes, probes_for_kernels)
from tapescope.cli import app
from tapescope.devices.calibration import Calibration, load_calibration
from tapescope.devices.efficiency import HOST_VIEW_S
from tapescope.devices.gpus import get_gpu
from tapescope.errors import TapescopeError

FILE = Path(__file__).parent / "data" / "calibration_h100_sxm.json"
DATA = json.loads(FILE.read_text())


def _point(kind, **match):
    """The file's entry of that kind with those fields."""
    found = [p for p in DATA[kind] if all(p[k] == v for k, v in match.items())]
    assert len(found) == 1, (kind, match)
    return found[0]


class Attn(torch.nn.Module):
    """One causal attention block, 8 heads of 64, with no bias: its GEMMs are shapes the file
    measured (tokens 2048 x 1536 x 512 and their backward)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(512, 1536, bias=False)
        self.out = torch.nn.Linear(512, 512, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 8, 64).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, 512))


@pytest.fixture(scope="module")
def calibrated():
    return tapescope.profile(Attn(), tapescope.spec((2, 1024, 512)), dtype="bf16",
                             calibration=str(FILE))


def test_file_reads_back_as_written(tmp_path):
    cal = load_calibration(str(FILE))
    assert cal.gpu_name == "NVIDIA H100 80GB HBM3" and cal.kernel_overhead_s == 1.9e-6
    assert len(cal.gemm) == 8 and len(cal.attention) == 6 and len(cal.bandwidth) == 10
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())), source=cal.source)
    assert again == cal


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("format"), "not a tapescope calibration file"),
    (lambda d: d["gemm"][0].update(seconds=-1.0), "must be positive"),
    (lambda d: d["attention"][0].pop("head_dim"), "without head_dim"),
    (lambda d: d.pop("launch"), "cannot read it as a calibration"),
])
def test_a_bad_file_is_one_clear_error(tmp_path, edit, says):
    d = json.loads(FILE.read_text())
    edit(d)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(TapescopeError, match=says):
        load_calibration(str(bad))
    r = CliRunner().invoke(app, ["profile", "zoo:gpt2:n_layer=1", "--calibration", str(bad)])
    assert r.exit_code == 1 and r.output.startswith("error:") and "Traceback" not in r.output


def test_calibrated_kernel_times_are_the_files_figures(calibrated):
    p = calibrated
    assert p.gpu.key == "h100-sxm"          # the file's GPU: no --gpu given
    assert p.time.calibration.startswith(str(FILE)) and p.time.calibrated
    times = {}
    for op, t in zip(p.ops, p.time.op_seconds):
        if launches_kernel(op.record.func):
            times.setdefault((op.phase, op.name, tuple(tuple(t.shape) for t in op.inputs)), t)
    mm = "aten.mm.default"
    by_gemm = {("forward", mm, ((2048, 512), (512, 1536))): dict(m=2048, n=1536, k=512),
               ("forward", mm, ((2048, 512), (512, 512))): dict(m=2048, n=512, k=512),
               ("backward", mm, ((512, 2048), (2048, 512))): dict(m=512, n=512, k=2048),
               ("backward", mm, ((2048, 512), (512, 512))): dict(m=2048, n=512, k=512),
               ("backward", mm, ((1536, 2048), (2048, 512))): dict(m=1536, n=512, k=2048)}
    for key, shape in by_gemm.items():
        assert times[key] == _point("gemm", dtype="bf16", **shape)["seconds"], key
    attention = {k: t for k, t in times.items() if "attention" in k[1]}
    assert sorted(attention.values()) == sorted(
        _point("attention", backend="cudnn", direction=d, head_dim=64)["seconds"]
        for d in ("forward", "backward"))
    # memory-bound: the nearest measured size of the kind (16 MiB), scaled by bytes
    stack = [op for op in p.ops if op.name == "aten.stack.default"][0]
    clone = [op for op in p.ops if op.name == "aten.clone.default"][0]
    for op, kind in ((stack, "elementwise"), (clone, "copy")):
        nbytes = op.bytes_read + op.bytes_written
        assert nbytes == 3 * 2 * 1024 * 512 * 2 * 2           # q, k, v grads: 12 MiB each way
        pt = [b for b in DATA["bandwidth"] if b["kind"] == kind and b["bytes"] > 8 << 20][0]
        assert pt["bytes"] <= 16 << 20
        assert p.time.op_seconds[p.ops.index(op)] == pytest.approx(pt["seconds"] * nbytes /
                                                                   pt["bytes"], rel=1e-12)
    ones = [op for op in p.ops if op.name == "aten.ones_like.default"][0]   # 4 bytes
    assert p.time.op_seconds[p.ops.index(ones)] == DATA["launch"]["kernel_overhead_s"]
    # the host issues each kernel in the measured time, views (and ops on host tensors only, the
    # optimizer's step counters) as before
    kernels = sum(kernel_of(op, p.trace.storages).op_class != "none" for op in p.ops)
    assert p.time.host == pytest.approx(kernels * DATA["launch"]["host_op_s"] +
                                        (len(p.ops) - kernels) * HOST_VIEW_S, rel=1e-12)


def test_a_shape_not_measured_takes_its_nearest_ones_throughput():
    cal, gpu = load_calibration(str(FILE)), get_gpu("h100")
    k = 4096
    kernel = Kernel("aten.mm.default", "matmul", 2 * 3000 * 4096 * k, 0, torch.bfloat16,
                    gemm=(1, 3000, 4096))
    square = _point("gemm", dtype="bf16", m=4096, n=4096, k=4096)
    assert kernel_time(kernel, gpu, cal) == (square["seconds"] * 3000 / 4096, True)
    # fp32 has its own points; fp16 none: the model's priors price it, marked uncalibrated
    fp16 = Kernel("aten.mm.default", "matmul", 2 * 4096 ** 3, 0, torch.float16, gemm=(1, 4096, 4096))
    assert calibrated_seconds(fp16, cal) is None
    assert kernel_time(fp16, gpu, cal) == kernel_time(fp16, gpu)
    conv = Kernel("aten.convolution.default", "convolution", 10 ** 10, 10 ** 8, torch.bfloat16)
    assert calibrated_seconds(conv, cal) is None and kernel_time(conv, gpu, cal)[1] is False


def test_a_step_with_kinds_the_file_did_not_measure_says_so():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4))
    model(torch.zeros(1, 3, 16, 16))
    p = tapescope.profile(model, tapescope.spec((2, 3, 16, 16)), gpu="h100",
                          calibration=str(FILE))
    assert p.time.calibration is not None and not p.time.calibrated
    from tapescope.report.console import _calibration_note

    assert "did not measure" in _calibration_note(p.time)
    assert p.to_dict()["time"]["calibration"] == p.time.calibration


def test_the_file_applies_only_to_its_gpu(monkeypatch):
    model, x = Attn(), tapescope.spec((1, 64, 512))
    with pytest.raises(TapescopeError, match="measured on NVIDIA H100 80GB HBM3 .*--gpu h100-sxm"):
        tapescope.profile(model, x, gpu="a100", calibration=str(FILE))
    with pytest.raises(TapescopeError, match="a cpu profile runs none"):
        tapescope.profile(model, x, device="cpu", calibration=str(FILE))
    monkeypatch.setenv("TAPESCOPE_CALIBRATION", str(FILE.parent / "no-such-file.json"))
    assert tapescope.profile(model, x, device="cpu").options.calibration is None  # not read
    with pytest.raises(TapescopeError, match="cannot read the calibration file"):
        tapescope.profile(model, x, gpu="h100")
    monkeypatch.setenv("TAPESCOPE_CALIBRATION", str(FILE))
    assert tapescope.profile(model, x, device="cpu").options.calibration is None  # not used
    with pytest.raises(TapescopeError, match="or unset TAPESCOPE_CALIBRATION"):
        tapescope.profile(model, x, gpu="a100")
    p = tapescope.profile(model, x, gpu="h100")
    assert p.time.calibration.startswith(str(FILE))


class _FakeTimer:
    """Runs each probe's function once (it must work), and answers the next given time."""

    def __init__(self, seconds):
        self.seconds, self.calls, self.eager = list(seconds), 0, []

    def __call__(self, fn, eager=False):
        fn()
        self.calls += 1
        self.eager.append(eager)
        return self.seconds.pop(0)


def test_the_measurement_path_with_the_timer_injected(tmp_path):
    probes = [*launch_probes(), bandwidth_probe("copy", 1 << 16),
              bandwidth_probe("elementwise", 1 << 16), gemm_probe("fp32", 1, 64, 32, 16),
              gemm_probe("fp32", 3, 16, 8, 4), attention_probe("flash", "forward", "fp32", 4, 32, 32, 16, True),
              attention_probe("flash", "backward", "fp32", 4, 32, 32, 16, True)]
    times = [2e-6, 6e-6, 3e-6, 3.5e-6, 5e-6, 7e-6, 2e-5, 4e-5]
    facts = {"name": "NVIDIA H100 80GB HBM3", "torch": torch.__version__, "sms": 132}
    timer = _FakeTimer(times)
    cal = run_probes(probes, "cpu", timer, facts)
    assert cal.kernel_overhead_s == 2e-6 and cal.host_op_s == 6e-6
    # the host's op is timed as issued, and the attention backward (not capturable in a graph)
    assert timer.eager == [False, True] + [False] * 5 + [True]
    assert [(b.kind, b.bytes, b.seconds) for b in cal.bandwidth] == [
        ("copy", 1 << 16, 3e-6), ("elementwise", 12 * ((1 << 16) // 12), 3.5e-6)]
    assert [(g.batch, g.m, g.n, g.k, g.flops, g.seconds) for g in cal.gemm] == [
        (1, 64, 32, 16, 2 * 64 * 32 * 16, 5e-6), (3, 16, 8, 4, 2 * 3 * 16 * 8 * 4, 7e-6)]
    fwd, bwd = cal.attention
    pairs = 32 * 33 // 2                       # causal: query i sees keys 0..i
    assert (fwd.flops, bwd.flops) == (2 * 4 * pairs * (16 + 16), 2 * 4 * pairs * (3 * 16 + 2 * 16))
    assert (fwd.seconds, bwd.seconds) == (2e-5, 4e-5)
    assert cal.device["sms"] == 132 and cal.device["skipped"] == 0
    path = tmp_path / "cal.json"
    from tapescope.calibration import write_calibration

    write_calibration(cal, str(path))
    assert load_calibration(str(path)).gemm == cal.gemm


def test_the_deadline_skips_the_rest_and_says_how_many():
    ticks = iter(range(100))
    probes = [*launch_probes(), *(gemm_probe("fp32", 1, 8, 8, 8) for _ in range(5))]
    cal = run_probes(probes, "cpu", _FakeTimer([1e-3] * 10), {"name": "NVIDIA H100 80GB HBM3"},
                     deadline_s=3.5, clock=lambda: next(ticks))
    # the clock reads 0 at the start, then 1, 2, 3 before probes 0-2 (run), 4 before probe 3:
    # past 3.5, so the two launch probes and one GEMM ran, the other four GEMMs did not
    assert len(cal.gemm) == 1 and cal.device["skipped"] == 4


def test_a_failing_probe_is_listed_not_fatal():
    def broken(device):
        raise RuntimeError("No available kernel. Aborting execution.")
    from tapescope.calibration.probes import Probe

    probes = [*launch_probes(), Probe("attention", {}, broken)]
    cal = run_probes(probes, "cpu", _FakeTimer([1e-3, 1e-5]), {"name": "x"})
    assert cal.attention == () and "No available kernel" in cal.device["failed"][0]


def test_probes_follow_the_traced_steps_shapes(calibrated):
    kernels = profile_kernels(calibrated)
    probes = probes_for_kernels(kernels)
    gemms = {tuple(p.shape[k] for k in ("dtype", "batch", "m", "n", "k"))
             for p in probes if p.kind == "gemm"}
    assert gemms == {("bf16", 1, 2048, 1536, 512), ("bf16", 1, 2048, 512, 512),
                     ("bf16", 1, 512, 512, 2048), ("bf16", 1, 1536, 512, 2048)}
    att = [p.shape for p in probes if p.kind == "attention"]
    assert {(a["backend"], a["direction"]) for a in att} == {("cudnn", "forward"),
                                                            ("cudnn", "backward")}
    # the probe counts attention FLOPs as analysis/flops.py counted the traced kernels
    traced = {("backward" if "backward" in k.name else "forward"): k.flops
              for k in kernels if k.op_class == "attention"}
    assert {a["direction"]: a["flops"] for a in att} == traced
    assert all((a["batch_heads"], a["seq_q"], a["head_dim"], a["causal"]) == (16, 1024, 64, True)
               for a in att)


def test_calibrate_refuses_without_a_gpu(tmp_path):
    assert not torch.cuda.is_available()
    with pytest.raises(TapescopeError, match="measures a GPU, and torch sees none here"):
        tapescope.calibrate()
    out = tmp_path / "c.json"
    r = CliRunner().invoke(app, ["calibrate", "--out", str(out)])
    assert r.exit_code == 1 and not out.exists()
    assert r.output.count("\n") == 1 and r.output.startswith("error: tapescope calibrate measures")


def test_profile_cli_says_the_time_is_calibrated(tmp_path):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "zoo:gpt2:n_layer=1,n_embd=64,n_head=4,vocab_size=128",
                                 "--seq", "32", "--amp", "bf16", "--calibration", str(FILE),
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "NVIDIA H100 SXM5 80GB" in r.output and "calibrated:" in r.output
    assert json.loads(out.read_text())["time"]["calibration"].startswith(str(FILE))


def test_collectives_measured_over_real_processes():
    """The NCCL path, run with gloo over two CPU processes: nccl-tests' sizes and bus bandwidth."""
    from tapescope.calibration.nccl import bus_factor, measure_collectives

    points = measure_collectives(2, backend="gloo", sizes=(1 << 12, 1 << 16), iters=3)
    assert [(p.collective, p.ranks, p.bytes) for p in points] == [
        (c, 2, b) for c in ("all_reduce", "all_gather", "reduce_scatter")
        for b in (1 << 12, 1 << 16)]
    for p in points:
        assert p.seconds > 0
        assert p.bus_bandwidth == pytest.approx(p.bytes / p.seconds * (1.0 if p.collective ==
                                                "all_reduce" else 0.5), rel=1e-12)
    assert (bus_factor("all_reduce", 8), bus_factor("all_gather", 8)) == (14 / 8, 7 / 8)


def test_collectives_inside_a_node_take_the_measured_times():
    import dataclasses

    from tapescope.devices.calibration import NcclPoint

    measured = (NcclPoint("all_gather", 8, 1 << 20, 40e-6, 0.0),
                NcclPoint("all_gather", 8, 1 << 30, 3.1e-3, 0.0),
                NcclPoint("reduce_scatter", 8, 1 << 20, 45e-6, 0.0),
                NcclPoint("reduce_scatter", 8, 1 << 30, 3.4e-3, 0.0))
    cal = dataclasses.replace(load_calibration(str(FILE)), nccl=measured)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))

    def parallelize(m, mesh):
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)
    p = tapescope.profile(model, tapescope.spec((8, 256)), gpu="h100", mesh={"dp": 2},
                          parallelize=parallelize, calibration=cal)
    assert p.collectives
    for c in p.collectives:
        # 2 ranks, small messages: the 1 MiB point of its kind, per byte through each link
        # ((n-1)/n: 1/2 on 2 ranks, 7/8 on the 8 measured)
        pt = {"all_gather": measured[0], "reduce_scatter": measured[2]}[c.kind]
        assert not c.inter_node and c.group_size == 2
        assert c.seconds == pytest.approx(pt.seconds * c.nbytes * 0.5 / (pt.bytes * 7 / 8),
                                          rel=1e-12)


def test_calibrate_end_to_end_with_the_gpu_parts_replaced(calibrated, tmp_path, monkeypatch):
    """tapescope.calibrate(profile) on this CPU: the GPU check, the device's facts and the CUDA
    timer replaced; the probes are the profile's shapes, built and run; the file it writes prices
    the same profile's GEMMs at the times the timer gave."""
    import tapescope.calibration as calibration

    monkeypatch.setattr(calibration, "require_gpu", lambda: torch.device("cpu"))
    monkeypatch.setattr(calibration, "cuda_facts",
                        lambda device: {"name": "NVIDIA H100 80GB HBM3", "torch": "test"})
    monkeypatch.setattr(calibration, "cuda_timer", _FakeTimer([2e-6, 6e-6] + [1e-5] * 40))
    out = tmp_path / "mine.json"
    cal = tapescope.calibrate(calibrated, out=str(out), nccl=False)
    assert len(cal.gemm) == 4 and all(g.seconds == 1e-5 for g in cal.gemm)
    # cuDNN attention does not run on a CPU: both probes are listed as failed, not fatal
    assert cal.attention == () and len(cal.device["failed"]) == 2
    p = tapescope.profile(Attn(), tapescope.spec((2, 1024, 512)), dtype="bf16",
                          calibration=str(out))
    for op, t in zip(p.ops, p.time.op_seconds):
        if op.name == "aten.mm.default":
            assert t == 1e-5
    assert not p.time.calibrated    # its attention kernels fell back to the priors


def test_attention_takes_the_nearest_measured_shape():
    cal, gpu = load_calibration(str(FILE)), get_gpu("h100")
    # 64 x (2048, 2048), head dim 128, causal: log distance 2.08 to the (128, 4096, 128) point,
    # 3.47 to the (16, 1024, 64) one
    from tapescope.calibration.probes import attention_flops

    flops = attention_flops("forward", 64, 2048, 2048, 128, True)
    kernel = Kernel("aten._scaled_dot_product_cudnn_attention.default", "attention", flops, 0,
                    torch.bfloat16, attention=(64, 2048, 2048, 128, True))
    big = _point("attention", backend="cudnn", direction="forward", head_dim=128)
    assert kernel_time(kernel, gpu, cal) == (big["seconds"] * (flops / big["flops"]), True)


def test_the_default_probes():
    from tapescope.calibration.probes import (DEFAULT_ATTENTION, DEFAULT_BYTES, DEFAULT_GEMMS,
                                              default_probes)

    probes = default_probes()
    assert len(probes) == 2 + 2 * len(DEFAULT_BYTES) + len(DEFAULT_GEMMS) + \
        3 * 2 * len(DEFAULT_ATTENTION)
    assert len({p.label for p in probes}) == len(probes)
    assert [p.kind for p in probes[:2]] == ["kernel_overhead", "host_op"]
