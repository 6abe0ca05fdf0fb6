"""What a hostile but fair user types (issue 24's probe): every mistake is one `error:` line that
names the thing and the fix, exit 1, never a traceback; nothing the user typed is read as markup
or silently ignored."""

import pytest
import torch
from typer.testing import CliRunner

from tapescope.cli import app

from .conftest import TINY_LLAMA

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
