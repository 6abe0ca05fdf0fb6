"""What a hostile but fair user types (issue 24's probe): every mistake is one `error:` line that
names the thing and the fix, exit 1, never a traceback; nothing the user typed is read as markup
or silently ignored."""

import pytest
import torch
from typer.testing import CliRunner

from tapescope.cli import app

from .conftest import TINY_GPT2 as TINY_GPT2_SPEC, TINY_LLAMA

needs_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                      reason="needs a CUDA build of torch")


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_user_error(r, *words):
    """One `error:` line naming each of `words`, exit 1, no traceback."""
    assert r.exit_code == 1, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, r.output
    text = " ".join(lines[lines.index(errors[0]):])  # the error line, wrapped or not
    for w in words:
        assert w in text, (w, r.output)


# -- fit --gpus -------------------------------------------------------------------------------

@needs_cuda_build
def test_fit_gpus_takes_the_budget():
    """--budget 1KiB used to print 'fits yes' and exit 0 (the GPU's memory was used instead)."""
    r = run("fit", TINY_LLAMA, "--batch", 2, "--seq", 16, "--gpus", 2, "--budget", "1KiB")
    assert r.exit_code == 1, r.output
    assert "1.00 KiB" in r.output and " yes " not in r.output


@needs_cuda_build
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fit_gpus_refuses_another_device(device):
    r = run("fit", TINY_LLAMA, "--gpus", 2, "--device", device)
    assert_user_error(r, f"--device {device}", "--gpus")


def test_fit_gpus_refuses_a_sweep():
    assert_user_error(run("fit", TINY_LLAMA, "--gpus", 2, "--sweep", "1..4"), "--sweep", "--gpus")


# -- distributed flags: a conflict is refused, never settled silently ---------------------------

@pytest.fixture
def par(tmp_path):
    f = tmp_path / "par.py"
    f.write_text("def parallelize(model, mesh):\n    return model\n")
    return f"{f}:parallelize"


@pytest.mark.parametrize("flags, words", [
    (["--mesh", "dp=2,dp=4"], ["'dp' twice"]),          # profiled 4 ranks
    (["--mesh", "dp=0"], ["dp=0", "at least 1"]),
    (["--mesh", "=2"], ["--mesh", "dp=4,tp=2"]),
    (["--mesh", "dp=2", "--fsdp", 4], ["--mesh dp=2", "--fsdp 4"]),   # --fsdp was ignored
    (["--mesh", "dp=2", "--hsdp", 2], ["--mesh dp=2", "--hsdp 2"]),
])
def test_conflicting_mesh_flags_are_refused(par, flags, words):
    assert_user_error(run("profile", TINY_LLAMA, "--parallelize", par, *flags), *words)


@pytest.mark.parametrize("flags, words", [
    (["--hsdp", 0], ["--hsdp 0", "at least 1"]),          # exited 0
    (["--hsdp", -3], ["--hsdp -3", "at least 1"]),
    (["--dp-replicate", 0], ["--dp-replicate 0", "at least 1"]),
    (["--fsdp", 0], ["--fsdp 0", "at least 1"]),
    (["--fsdp", 2, "--hsdp", 2, "--dp-replicate", 3], ["--hsdp 2", "--dp-replicate 3"]),  # used 3
])
def test_bad_or_conflicting_degrees_are_refused(flags, words):
    assert_user_error(run("profile", TINY_LLAMA, *flags), *words)


def test_api_mesh_sizes_must_be_integers():
    """mesh={'dp': True} was a traceback inside torch."""
    import tapescope
    from tapescope.errors import TapescopeError

    from .conftest import MLP

    for mesh in ({"dp": True}, {"dp": 2.0}, {"dp": 0}):
        with pytest.raises(TapescopeError, match="size >= 1"):
            tapescope.profile(MLP(), tapescope.spec((4, 16)), mesh=mesh,
                              parallelize=lambda m, mesh: m)


# -- what the user named is printed as it is, never read as rich markup --------------------------

_MARKUP_MODEL = '''
import torch
import torch.nn as nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("[/]", nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)))

    def forward(self, x):
        for layer in getattr(self, "[/]"):
            x = x + layer(x)
        return x


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.a(x)


def parallelize(model, mesh):
    return model
'''


@pytest.fixture
def markup_model(tmp_path):
    f = tmp_path / "markup.py"
    f.write_text(_MARKUP_MODEL)
    return str(f)


def test_plan_of_a_module_named_like_markup(markup_model, tmp_path):
    """A module named `[/]` crashed the plan's report with a MarkupError after the whole plan
    (and before --json was written)."""
    out = tmp_path / "plan.json"
    r = run("plan", f"{markup_model}:Stack", "--input", "512,64", "--loss", "sum",
            "--budget", "5.5MiB", "--json", out)
    assert r.exit_code == 0, r.output
    assert "checkpointed whole (1): [/].0" in r.output and out.exists()


@pytest.mark.parametrize("mesh", ["[/]=2", "[red]dp=2"])
def test_mesh_names_like_markup_are_printed_as_given(markup_model, tmp_path, mesh):
    """`--mesh '[/]=2'` crashed after the profile; `[red]dp` printed as 'dp'."""
    out = tmp_path / "p.json"
    r = run("profile", f"{markup_model}:Stack", "--input", "8,64", "--parallelize",
            f"{markup_model}:parallelize", "--mesh", mesh, "--json", out)
    assert r.exit_code == 0, r.output
    name, size = mesh.split("=")
    assert f"Mesh {name} {size} = 2 ranks" in r.output and out.exists()


def test_graph_break_is_labelled_not_printed_as_markup(markup_model):
    r = run("profile", f"{markup_model}:Broken", "--input", "4,8", "--loss", "sum",
            "--compile-backend", "aot_eager")
    assert r.exit_code == 0, r.output
    assert "  graph break at " in r.output and "[yellow]" not in r.output


# -- tracebacks and silent acceptance the probe found ----------------------------------------------

_USER_FILE = '''
import torch.nn as nn


def build():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def returns_42(model, mesh):
    return 42


def returns_tuple(model, mesh):
    return model, mesh


def loss_of_output(output):
    return output.sum()
'''


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "user.py"
    f.write_text(_USER_FILE)
    return str(f)


@pytest.mark.parametrize("fn, words", [("returns_42", ["returns_42(model, mesh) returned int 42"]),
                                       ("returns_tuple", ["returned tuple of 2", "nn.Module"])])
def test_parallelize_returning_something_else_than_a_module(user_file, fn, words):
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--parallelize",
            f"{user_file}:{fn}", "--mesh", "dp=2")
    assert_user_error(r, *words)


def test_loss_taking_only_the_output_is_told_how_it_is_called(user_file):
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--loss",
            f"{user_file}:loss_of_output")
    assert_user_error(r, "loss_of_output(output, *inputs)", "2 arguments")


@pytest.mark.parametrize("routing", ["nan,1,1,1", "inf,1", "1e308,1e308", "-1,2"])
def test_routing_shares_must_be_finite(user_file, routing):
    """nan / inf shares were accepted and the failure blamed on the model."""
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--routing", routing)
    assert_user_error(r, "routing shares must be finite")


def test_mask_fraction_must_be_a_fraction(user_file):
    assert_user_error(run("profile", f"{user_file}:build", "--input", "8,16", "--mask-fraction",
                          "nan"), "mask must be a fraction")


def test_routing_and_mask_on_a_step_without_them_say_so(user_file):
    """--routing worst / --mask-fraction on a model with no router or mask said nothing."""
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--routing", "worst",
            "--mask-fraction", "0.25")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "Not used: the routing worst (--routing) assumed nothing" in text
    assert "Not used: the mask fraction 0.25 (--mask-fraction) assumed nothing" in text


@pytest.mark.parametrize("flags", [["--pareto", -1], ["--max-traces", -5]])
def test_plan_refuses_negative_counts(user_file, flags):
    r = run("plan", f"{user_file}:build", "--input", "8,16", "--budget", "1MiB", *flags)
    assert_user_error(r, flags[0].lstrip("-").replace("-", "_"), ">= 0")


def test_api_budget_must_be_a_size():
    """budget=nan was a ValueError traceback; -5 was accepted (the CLI refuses it)."""
    import math

    import tapescope

    for budget in (math.nan, math.inf, -5, 0, True):
        with pytest.raises(tapescope.TapescopeError, match="memory size"):
            tapescope.plan_checkpointing(_Stack, tapescope.spec((4, 8)), budget=budget)


def test_api_units_may_name_one_module():
    """units='layers.0' was read letter by letter: "no module 'l'"."""
    import tapescope

    plan = tapescope.plan_checkpointing(_Stack, tapescope.spec((64, 8)), budget="1GiB",
                                        units="layers.1")
    assert plan.units == ("layers.1",)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=needs_cuda_build)])
def test_cpu_target_with_another_device_is_refused(user_file, device):
    """--cpu-isa with --device cuda was ignored silently."""
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--device", device,
            "--cpu-isa", "avx512")
    assert_user_error(r, "--cpu-isa", f"a {device} step", "--device cpu")
    r = run("profile", f"{user_file}:build", "--input", "8,16", "--device", device,
            "--threads", 8)
    assert_user_error(r, "--threads")


@pytest.mark.parametrize("role", ["model", "--parallelize", "--loss"])
def test_a_file_that_exits_on_import_is_named(tmp_path, user_file, role):
    """sys.exit(5) at import exited 5 with no message."""
    f = tmp_path / "script.py"
    f.write_text("import sys\nsys.exit(5)\n")
    args = {"model": ["profile", f"{f}:build", "--input", "8,16"],
            "--parallelize": ["profile", f"{user_file}:build", "--input", "8,16",
                              "--parallelize", f"{f}:fn", "--mesh", "dp=2"],
            "--loss": ["profile", f"{user_file}:build", "--input", "8,16", "--loss", f"{f}:fn"]}
    assert_user_error(run(*args[role]), "script.py called sys.exit(5)", "__main__")


def test_sizes_past_a_thousand_gib_use_larger_units():
    """1955628.40 GiB was printed for 1.87 PiB."""
    from tapescope.report.text import fmt_bytes

    assert fmt_bytes(1023 * 2**30) == "1023.00 GiB"
    assert fmt_bytes(3 * 2**39) == "1.50 TiB"
    assert fmt_bytes(int(1955628.40 * 2**30)) == "1.87 PiB"
    assert fmt_bytes(2**62) == "4.00 EiB"


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).relu()
        return x.sum()


# -- the environment, before torch is imported -----------------------------------------------------

@pytest.mark.parametrize("var", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_malformed_alloc_conf_is_an_error_not_an_abort(var):
    """torch parses these when imported and aborts the process (exit -6) on a malformed one,
    before tapescope's own check could answer: the command line checks them first."""
    import os
    import subprocess
    import sys

    env = {**os.environ, var: "garbage"}
    env.pop("PYTORCH_ALLOC_CONF" if var != "PYTORCH_ALLOC_CONF" else "PYTORCH_CUDA_ALLOC_CONF",
            None)
    r = subprocess.run([sys.executable, "-m", "tapescope.cli", "profile"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"'garbage' in {var}" in r.stderr and f"unset {var}" in r.stderr


# -- progress: on a terminal's stderr, saying what is under way; never with --quiet -------------

def _progress_output(monkeypatch, terminal: bool, quiet: bool = False) -> str:
    import io
    import time

    from rich.console import Console

    from tapescope import cli

    buf = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=buf, force_terminal=terminal, width=120))
    with cli._progress("validating m", quiet=quiet, delay=0) as update:
        update("budget 0.5 (1 of 2)")
        update(1, "forward")
        time.sleep(0.4)
    return buf.getvalue()


def test_progress_shows_the_stage_and_the_phase_on_a_terminal(monkeypatch):
    out = _progress_output(monkeypatch, terminal=True)
    assert "validating m - budget 0.5 (1 of 2) - step 1 forward done" in out


def test_progress_off_a_terminal_is_a_plain_line_per_stage(monkeypatch):
    """A CI log or a pipe: no spinner, but a line per stage and phase (issue 36: validate,
    budget-sweep, fit --gpus and --compile were silent there for minutes)."""
    lines = _progress_output(monkeypatch, terminal=False).splitlines()
    assert lines[-2:] == ["tapescope: validating m - budget 0.5 (1 of 2) (0 s)",
                          "tapescope: validating m - budget 0.5 (1 of 2) - step 1 forward done (0 s)"]
    assert "\x1b" not in "".join(lines)  # no terminal control codes in a log


@pytest.mark.parametrize("terminal", [False, True])
def test_no_progress_with_quiet(monkeypatch, terminal):
    assert _progress_output(monkeypatch, terminal, quiet=True) == ""


@pytest.fixture
def recorded_progress(monkeypatch):
    from contextlib import contextmanager

    from tapescope import cli

    calls = []

    @contextmanager
    def record(label, quiet=False, delay=1.0):
        calls.append(("label", label, quiet))
        yield lambda *args: calls.append(args)

    monkeypatch.setattr(cli, "_progress", record)
    return calls


@needs_cuda_build
def test_fit_gpus_says_which_layout_is_under_way(recorded_progress):
    r = run("fit", TINY_LLAMA, "--batch", 2, "--seq", 16, "--gpus", 2, "--quiet")
    assert r.exit_code == 0, r.output
    calls = recorded_progress
    assert calls[0] == ("label", "profiling the layouts of 2 GPUs for zoo:llama", True)
    stages = [c[0] for c in calls[1:] if len(c) == 1]
    assert stages == ["layout FSDP 2 (1 of 2)", "layout TP 2 (2 of 2)"]
    assert any(len(c) == 2 for c in calls[1:])   # the traced phases, too


def test_validate_says_which_part_is_under_way(user_file, recorded_progress):
    r = run("validate", f"{user_file}:build", "--input", "4,16", "--device", "cpu",
            "--warmup", 0, "--steps", 1, "-q")
    assert r.exit_code == 0, r.output
    stages = [c[0] for c in recorded_progress[1:] if len(c) == 1]
    assert stages == ["predicting the step on fake tensors",
                      "running 2 real steps on cpu under the profiler", "timing 0 + 1 real steps"]


# -- the report: repeats at the peak counted over every tensor alive there -----------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class _Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_repeats_at_the_peak_are_counted_over_the_whole_peak_set():
    """'x N' counted only within the 20 largest tensors (Llama showed x3 for a tensor all 8
    layers hold). By hand: each of the 8 blocks saves its 2 tanh outputs (tanh's backward reads
    its output), and blocks 0-6 hand their output to the next block's addmm, which saves it:
    16 and 7 tensors of 512 x 64 fp32, all alive when the backward starts."""
    import tapescope

    p = tapescope.profile(_Deep, tapescope.spec((512, 64)), steps=1)
    groups = {(g.first.category, g.first.op_name): g for g in p.memory.live_groups}
    tanh = groups[("saved activations", "aten.tanh.default")]
    addmm = groups[("saved activations", "aten.addmm.default")]
    assert (tanh.count, addmm.count) == (16, 7)
    assert tanh.first.nbytes == addmm.first.nbytes == 512 * 64 * 4
    saved = sum(g.nbytes for g in p.memory.live_groups if g.first.category == "saved activations")
    assert saved == p.memory.at_peak["saved activations"] == 23 * 512 * 64 * 4
    assert len(p.memory.live_at_peak) == 20  # the JSON keeps the 20 largest tensors themselves


# -- ops: FLOPs in units, exact in --json -------------------------------------------------------

def test_ops_prints_flops_in_units_and_exact_counts_in_json(tmp_path):
    """`ops` printed raw FLOP integers (136 columns wide on Llama). By hand: Linear(8, 16) on a
    4 x 8 input is one addmm of 2 * 4 * 8 * 16 = 1024 FLOPs."""
    import json

    f = tmp_path / "lin.py"
    f.write_text("import torch.nn as nn\ndef build():\n    return nn.Linear(8, 16)\n")
    r = run("ops", f"{f}:build", "--input", "4,8", "--json", tmp_path / "ops.json", "-q")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if "|aten.addmm.default|" in line)
    assert row.split("|")[4] == "1.02 kFLOP"
    ops = json.loads((tmp_path / "ops.json").read_text())["ops"]
    assert [o["flops"] for o in ops if o["name"] == "aten.addmm.default"] == [2 * 4 * 8 * 16]


def test_readme_names_the_cuda_context_the_budget_subtracts():
    """README said 1 GiB for the CUDA context where `fit` subtracted 530 MiB on an H100."""
    import re
    from pathlib import Path

    from tapescope.devices.gpus import cuda_context_bytes, get_gpu

    readme = Path(__file__).parents[1].joinpath("README.md").read_text()
    said = {arch: n for n, arch in re.findall(r"(\d+) MiB on (Hopper|Ampere|Blackwell)", readme)}
    for gpu, arch in (("h100", "Hopper"), ("a100", "Ampere"), ("b200", "Blackwell")):
        assert int(said[arch]) << 20 == cuda_context_bytes(get_gpu(gpu)), arch
    assert "1 GiB for the CUDA context" not in readme


# -- the loss the step trained with is named -----------------------------------------------------

class _WithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        out = self.fc(x)
        return {"logits": out, "loss": out.pow(2).mean()}


@pytest.mark.parametrize("build, loss_fn, said", [
    (lambda: torch.nn.Linear(8, 4), None, "sum of the model's outputs (the default"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Flatten(0)), "mean", "mean"),
    (_WithLoss, None, "the model's .loss"),
    (lambda: torch.nn.Linear(8, 4), lambda out, x: out.abs().sum(), "<lambda>"),
])
def test_the_loss_is_named(build, loss_fn, said):
    """The default `sum` made 40% of the peak in README's parallelize example and was never
    shown: the report names the loss the step used."""
    import tapescope
    from tapescope.report.console import render_summary
    from rich.console import Console

    p = tapescope.profile(build, tapescope.spec((4, 8)), loss_fn=loss_fn, steps=1)
    assert p.facts["loss"].startswith(said) or p.facts["loss"].endswith(said), p.facts["loss"]
    console = Console(record=True, width=200)
    render_summary(p, console)
    assert f"Loss {p.facts['loss']}" in console.export_text()
    assert p.to_dict()["facts"]["loss"] == p.facts["loss"]


def test_a_zoo_model_names_its_own_loss():
    r = run("profile", TINY_LLAMA, "--batch", 1, "--seq", 8, "-q")
    assert r.exit_code == 0, r.output
    assert "Loss the model's scalar output" in r.output


class _CheckpointedDeep(_Deep):
    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.sum()


def test_a_module_never_saved_more_than_the_peak_under_checkpointing():
    """A module's 'saved for backward' added up every saved tensor of the step (883 MiB against a
    392 MiB peak), recomputed ones included. By hand: the checkpoints keep blocks 1-7's inputs
    (blocks 0-6's outputs); recomputing block 7 saves its 2 tanh outputs again: 9 tensors of
    512 x 64 fp32 at most at once, where the sum over the step is 7 + 16 = 23."""
    import tapescope

    p = tapescope.profile(_CheckpointedDeep, tapescope.spec((512, 64)), steps=1, optimizer=None)
    by_name = {m.module: m for m in p.memory.modules}
    assert by_name[""].saved_bytes == 9 * 512 * 64 * 4 == p.memory.at_peak["saved activations"]
    assert by_name["layers.7"].saved_bytes == 2 * 512 * 64 * 4
    assert all(m.saved_bytes <= p.peak_bytes for m in p.memory.modules)


def test_no_source_line_is_tapescopes_own(tmp_path):
    """The built-in step's backward ops showed the CLI's own `cli.py:157 in _run_profile` (and FSDP
    presets `cli.py:127`): a line of tapescope's is never the user's source."""
    f = tmp_path / "lin.py"
    f.write_text("import torch.nn as nn\ndef build():\n    return nn.Sequential(nn.Linear(8, 16), "
                 "nn.ReLU(), nn.Linear(16, 4))\n")
    r = run("profile", f"{f}:build", "--input", "4,8", "--json", tmp_path / "p.json", "-q")
    assert r.exit_code == 0, r.output
    import json

    d = json.loads((tmp_path / "p.json").read_text())
    sources = {o["source"] for o in d["ops"] if o.get("source")}
    assert sources and not any("tapescope" in s and "zoo" not in s for s in sources), sources
    assert "cli.py" not in r.output


@needs_cuda_build
def test_fit_gpus_shows_both_batches_and_names_the_best_layout(tmp_path):
    """Neither the per-rank nor the global batch was shown and the best layout never named. By
    hand: each data-parallel rank takes 2 x 16 tokens, FSDP 4 has 4 of them (global batch 8),
    FSDP 2 x TP 2 has 2 (global batch 4); tokens/s = 32 x data-parallel ranks / step time."""
    import json

    out = tmp_path / "layouts.json"
    r = run("fit", TINY_LLAMA, "--batch", 2, "--seq", 16, "--gpus", 4, "--json", out, "-q")
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    rows = {(x["fsdp"], x["tp"]): x for x in d["layouts"]}
    assert [(k, x["batch_per_rank"], x["global_batch"]) for k, x in rows.items()] == \
        [((4, 1), 2, 8), ((2, 2), 2, 4), ((1, 4), 2, 2)]
    timed = [x for x in rows.values() if x["step_seconds"]]
    for x in timed:
        assert x["tokens_per_second"] == pytest.approx(32 * x["fsdp"] / x["step_seconds"])
    best = max((x for x in timed if x["fits"]), key=lambda x: x["tokens_per_second"])
    name = "FSDP 4" if best["tp"] == 1 else f"FSDP {best['fsdp']} x TP {best['tp']}"
    assert d["best"] == name
    assert f"Best layout: {name}, {best['tokens_per_second']:,.0f} tokens/s at a global batch " \
           f"of {best['global_batch']} (2 per rank)" in " ".join(r.output.split())
    # TP 4 cannot split 2 key/value heads: said below the table, never inside its tokens/s column
    assert rows[(1, 4)]["note"] and rows[(1, 4)]["tokens_per_second"] is None
    tp4 = next(line for line in r.output.splitlines() if line.lstrip().startswith("TP 4 "))
    assert "not run" in tp4 and "heads" not in tp4
    assert f"TP 4 not run: {rows[(1, 4)]['note']}" in " ".join(r.output.split())


@needs_cuda_build
def test_fit_gpus_names_no_capacity_for_a_layout_out_of_memory():
    """The nvidia-smi column showed the GPU's capacity on rows that did not fit (the allocator's
    replay stops there)."""
    r = run("fit", "zoo:llama:dim=4096,n_layers=8,n_heads=32,n_kv_heads=8,ffn_dim=14336,"
            "vocab_size=128", "--batch", 1, "--seq", 16, "--gpus", 1, "--gpu", "l4", "-q")
    assert r.exit_code == 1, r.output
    assert "out of memory" in r.output and "No layout fits" in r.output


# -- budget-sweep: budget 0 and a non-monotonic peak are explained ------------------------------

def test_budget_sweep_explains_budget_0_and_a_higher_peak_at_a_smaller_budget(monkeypatch, tmp_path):
    """budget-sweep showed budget 0 with the highest peak, unexplained. The sweep's points are
    given here (the compiled profiles are test_compile's); what is checked is what the table
    says about them."""
    import json

    import tapescope.sweeps as sweeps
    from tapescope.sweeps import BudgetPoint

    points = {0.0: BudgetPoint(0.0, 900 << 20, 800 << 20, 1 << 20, 40, 10**9, 10**12),
              0.5: BudgetPoint(0.5, 600 << 20, 500 << 20, 100 << 20, 10, 10**8, 10**12),
              1.0: BudgetPoint(1.0, 700 << 20, 600 << 20, 300 << 20, 0, 0, 10**12)}
    monkeypatch.setattr(sweeps, "budget_sweep", lambda w, o, bs, progress=None: [points[bs[0]]])
    out = tmp_path / "sweep.json"
    r = CliRunner().invoke(app, ["budget-sweep", TINY_GPT2_SPEC, "--batch", "1", "--seq", "8",
                                 "--budgets", "0,0.5,1", "--json", str(out), "-q"],
                           terminal_width=300)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "budget 0 saves only the forward's inputs" in text
    assert ("budget 0 peaks at 900.00 MiB, above budget 0.5's 600.00 MiB while saving 1.00 MiB "
            "against 100.00 MiB") in text
    assert "budget 1 peaks at 700.00 MiB, above budget" not in text  # nothing larger after it
    assert len(json.loads(out.read_text())["notes"]) == 2


def test_budget_sweep_refuses_a_budget_outside_0_1():
    assert_user_error(run("budget-sweep", TINY_GPT2_SPEC, "--budgets", "0,1.5"), "1.5", "[0, 1]")


# -- --compile: module FLOPs from the compiled graphs ---------------------------------------------

def test_compiled_module_flops_come_from_the_graphs():
    """Under --compile every module's share showed 0.0% (module hooks do not run inside compiled
    code). By hand, Linear(16, 32) then Linear(32, 4), no bias, on 8 x 16 inputs: the first
    module runs a forward mm and its weight's gradient mm, 2 * 8 * 16 * 32 FLOPs each (its input
    needs no gradient); the second its forward mm, its weight's gradient mm and its input's
    gradient mm, 2 * 8 * 32 * 4 each."""
    import tapescope

    build = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False),  # noqa: E731
                                        torch.nn.Linear(32, 4, bias=False))
    p = tapescope.profile(build, tapescope.spec((8, 16)), compile=True, steps=1, optimizer=None)
    own = p.module_own_flops
    assert own["0"] == 2 * (2 * 8 * 16 * 32)
    assert own["1"] == 3 * (2 * 8 * 32 * 4)
    assert p.module_flops[""] >= own["0"] + own["1"]
    from rich.console import Console
    from tapescope.report.console import render_summary

    console = Console(record=True, width=200)
    render_summary(p, console)
    text = console.export_text()
    share = (own["0"] + own["1"]) / p.flops["total"]   # the two layers are one pattern, "*"
    row = next(line for line in text.splitlines() if line.startswith("* "))
    assert row.split()[-1] == f"{share:.1%}" != "0.0%"
    # the source column named inductor's hashed generated file; now the graph that ran it
    from tapescope.torch_compat import inductor_cache_dir

    assert inductor_cache_dir() not in text and ".py:" not in text.split("Largest tensors")[1]
    assert "compiled graph (forward 0)" in text or "compiled graph (backward 0)" in text
    assert not any(op.source is not None and op.source.filename.startswith(inductor_cache_dir())
                   for op in p.ops)


def test_no_source_line_is_tapescopes_own_under_an_fsdp_preset(tmp_path):
    """Under --fsdp the source column showed tapescope's own `cli.py:127`."""
    import json

    out = tmp_path / "p.json"
    r = run("profile", TINY_LLAMA, "--batch", 2, "--seq", 16, "--fsdp", 2, "--json", out, "-q")
    assert r.exit_code == 0, r.output
    sources = {o["source"] for o in json.loads(out.read_text())["ops"] if o.get("source")}
    assert any("llama.py" in s for s in sources)
    assert not any("tapescope" in s and "zoo" not in s for s in sources), sources
    assert "cli.py" not in r.output


def test_plan_checkpointing_refuses_a_mesh_as_profile_does():
    """profile() refuses a checkpointing plan with a mesh (not yet checked against real ranks);
    plan_checkpointing(mesh=...) re-traced that very pairing and returned a plan."""
    import tapescope
    from tapescope.errors import TapescopeError
    from tapescope.zoo import resolve

    m = resolve(TINY_LLAMA, batch=2, seq=16)
    with pytest.raises(TapescopeError, match="distributed step"):
        tapescope.plan_checkpointing(m.build, *m.inputs, budget="1MiB", loss_fn=m.loss_fn,
                                     mesh={"dp_shard": 2},
                                     parallelize=lambda model, mesh: model)
