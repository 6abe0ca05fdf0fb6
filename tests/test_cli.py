"""The command line: one command gives an answer; --json and ops work."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tapescope.cli import app

from .conftest import TINY_GPT2


def test_profile_default_model_prints_a_summary():
    r = CliRunner().invoke(app, ["profile"])
    assert r.exit_code == 0, r.output
    for text in ("zoo:gpt2", "Peak memory", "FLOPs", "Top modules by memory",
                 "Largest tensors alive at the peak"):
        assert text in r.output


def test_profile_json_and_graph(tmp_path):
    out, graph = tmp_path / "p.json", tmp_path / "g.py"
    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "2", "--seq", "16",
                                 "--json", str(out), "--graph", str(graph)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["peak_bytes"] > 0 and set(d["flops"]) == {"forward", "backward", "optimizer", "total"}
    assert d["ops"][0]["phase"] == "forward"
    assert "def forward" in graph.read_text()


def test_ops_table():
    r = CliRunner().invoke(app, ["ops", TINY_GPT2, "--batch", "2", "--seq", "8"])
    assert r.exit_code == 0, r.output
    assert "SeqNr" in r.output and "aten.addmm.default" in r.output
    assert "aten._log_softmax_backward_data.default" in r.output


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_ops_table_follows_the_named_gpu():
    """The attention kernels in the table are the named GPU's (sdp_utils' rules)."""
    args = ["ops", "zoo:llama:dim=64,n_layers=1,n_heads=4,n_kv_heads=1,ffn_dim=128,vocab_size=64",
            "--batch", "2", "--seq", "16", "--device", "cuda", "--dtype", "bf16"]
    a100 = CliRunner().invoke(app, [*args, "--gpu", "a100"])
    assert a100.exit_code == 0, a100.output
    assert "_scaled_dot_product_flash_attention" in a100.output
    assert "aten._fused_rms_norm.default" in a100.output


def test_file_spec_with_inputs(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch.nn as nn\n"
                 "def build():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))\n")
    r = CliRunner().invoke(app, ["profile", f"{f}:build", "--input", "4,8"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["profile", f"{f}:build"])
    assert r.exit_code == 1 and "--input" in r.output


def test_profile_for_another_cpu(tmp_path):
    """--threads / --cpu-isa size the CPU kernels' scratch for a target; the console says which
    CPU, the JSON carries it, and a bad value is a message, not a traceback."""
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "torchvision:resnet18", "--batch", "2", "--seq", "32",
                                 "--optimizer", "sgd", "--threads", "3", "--cpu-isa", "avx512",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Kernel workspaces sized for AVX512, 3 threads (the target given)" in r.output
    assert json.loads(out.read_text())["facts"]["cpu"] == {"isa": "avx512", "threads": 3,
                                                           "detected": False}
    r = CliRunner().invoke(app, ["profile", "torchvision:resnet18", "--threads", "0"])
    assert r.exit_code == 1 and "threads must be a positive integer" in r.output


def _state_numbers(spec):
    """(parameter elements, parameter tensors) of the model, counted on the built model."""
    from tapescope.zoo import resolve

    params = list(resolve(spec).build().parameters())
    return sum(p.numel() for p in params), len(params)


def test_plan_that_cannot_meet_the_budget_exits_1_and_says_why():
    """Parameters, gradients and AdamW's state alone exceed the budget: no checkpointing plan can
    help. Truth by hand: fp32 parameters and gradients are 4 bytes per element each; AdamW keeps
    exp_avg and exp_avg_sq (8 bytes per element) and, on CPU, a 4-byte float32 `step` per
    parameter tensor."""
    from tapescope.report.text import fmt_bytes

    n, tensors = _state_numbers(TINY_GPT2)
    budget = 1 << 20
    assert 16 * n > budget  # the model state alone is over it
    r = CliRunner().invoke(app, ["plan", TINY_GPT2, "--batch", "1", "--seq", "8",
                                 "--budget", "1MiB"])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())  # the console wraps long lines
    assert "cannot meet the budget" in out and "why: the model's state alone is over" in out
    for category, nbytes in (("parameters", 4 * n), ("gradients", 4 * n),
                             ("optimizer state", 8 * n + 4 * tensors)):
        assert f"{category} {fmt_bytes(nbytes)}" in out
    # the next commands: shard it over enough GPUs for the state to fit, or keep less of it
    gpus = int(out.split("--gpus ")[1].split()[0])
    assert gpus >= 2 and gpus & (gpus - 1) == 0 and 16 * n / gpus < budget
    assert f"--optimizer sgd plain SGD keeps no optimizer state: the model state becomes " \
           f"{fmt_bytes(8 * n)}" in out
    assert "--dtype bf16" in out


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_profile_that_does_not_fit_the_gpu_says_why_and_what_next():
    """A 1.4B-parameter step with AdamW on a T4: the replayed counters are labelled as the replay
    cut short by the OOM, and the reason is the model state, by hand: 4 + 4 + 8 bytes per
    parameter (on CUDA, AdamW's `step` stays on the CPU)."""
    from tapescope.report.text import fmt_bytes

    spec = "zoo:llama:dim=8192,n_layers=1,n_heads=64,n_kv_heads=8,ffn_dim=28672"
    n, _ = _state_numbers(spec)
    r = CliRunner().invoke(app, ["profile", spec, "--gpu", "t4", "--batch", "1", "--seq", "64"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "On NVIDIA T4: does not fit: runs out of memory at" in out
    assert "the replay up to the point of OOM" in out
    assert (f"optimizer state {fmt_bytes(8 * n)} + parameters {fmt_bytes(4 * n)} + gradients "
            f"{fmt_bytes(4 * n)} = {fmt_bytes(16 * n)} at the peak") in out
    gpus = int(out.split("--gpus ")[1].split()[0])
    assert gpus >= 2 and f"--fsdp {gpus} --gpu t4" in out


def test_explain_makes_samples_a_matrix_product_accepts_and_refuses_with_a_message():
    """`explain aten::mm` made (4, 8) x (4, 8) samples and died in a traceback; square samples
    fit matrix products, and an op that refuses them (a convolution) gets one error line."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    r = CliRunner().invoke(app, ["explain", "aten::mm", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "aten::mm on cpu" in r.output
    r = CliRunner().invoke(app, ["explain", "aten::convolution", "--device", "cpu"])
    assert r.exit_code == 1 and r.output.startswith("error: aten::convolution refused"), r.output


def test_fit_where_nothing_fits_says_why_and_what_next():
    """`fit` at a budget the model state alone exceeds: the reason, by hand (AdamW's two fp32
    moments and a 4-byte CPU `step` per tensor), and the next commands with what they free."""
    from tapescope.report.text import fmt_bytes

    n, tensors = _state_numbers(TINY_GPT2)
    r = CliRunner().invoke(app, ["fit", TINY_GPT2, "--seq", "8", "--budget", "200KiB", "-q"])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())
    assert "nothing fits: batch 1 already needs" in out
    assert "why: the model's state alone is over the budget of 200.00 KiB" in out
    assert "--optimizer sgd" in out and "--dtype bf16" in out
    assert f"frees the {fmt_bytes(8 * n + 4 * tensors)} of optimizer state at the peak" in out
