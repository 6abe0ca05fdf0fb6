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


def test_no_layout_fits_says_why_and_what_next():
    r = CliRunner().invoke(app, ["fit", TINY_GPT2, "--seq", "8", "--batch", "1", "--gpus", "2",
                                 "--gpu", "h100", "--budget", "200KiB", "-q"])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())
    assert "No layout fits 2 x NVIDIA H100" in out
    assert "why: the lowest peak per rank" in out and "with FSDP 2, is over the budget" in out
    assert "--gpus 4 --gpu h100" in out and "--fsdp 2 --gpu h100" in out


def test_a_sequence_longer_than_the_zoo_model_takes_is_refused_once_with_its_override():
    """The model's own forward refuses it (truth: run it); the refusal comes before any trace,
    names the override, and the override is accepted."""
    import time

    from tapescope.zoo import resolve

    spec = "zoo:llama:dim=64,n_layers=1,n_heads=4,n_kv_heads=2,ffn_dim=160,vocab_size=128,max_seq_len=16"
    model = resolve(spec, batch=1, seq=16).build()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    t0 = time.perf_counter()
    r = CliRunner().invoke(app, ["fit", spec, "--seq", "17", "--gpus", "4", "--gpu", "h100"])
    assert r.exit_code == 1 and time.perf_counter() - t0 < 10
    line = " ".join(r.output.split())
    assert line.count("exceeds") == 1 and "zoo:llama's max_seq_len 16" in line
    override = line.split("with that limit: ")[1].split()[0]
    assert override.endswith("max_seq_len=17")
    assert resolve(override, batch=1, seq=17).inputs[0].shape == (1, 17)
