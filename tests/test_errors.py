"""User mistakes become messages that name the op, the module and the line, and say what to do."""

import os

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

import tapescope
from tapescope.cli import app
from tapescope.errors import (DataDependentError, DeviceError, ModelError, SpecError,
                              UnsupportedOpError)


class Item(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum().item() > 0:  # reads a value
            y = y * 2
        return y.sum()


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()  # boolean mask: value-dependent shape


class Nonzero(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        return self.inner(x).nonzero().float().sum()


class WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        return self.fc(x).sum()


@pytest.mark.parametrize("model,op", [(Item, "_local_scalar_dense"), (Masked, "aten.index"),
                                      (Nonzero, "aten.nonzero")])
def test_data_dependent_ops(model, op):
    with pytest.raises(DataDependentError) as e:
        tapescope.profile(model, tapescope.spec((2, 4)))
    msg = str(e.value)
    assert op in msg and "test_errors.py" in msg and "Fix:" in msg


def test_data_dependent_names_the_module():
    with pytest.raises(DataDependentError, match="module 'inner.0'|module '\\(root\\)'"):
        tapescope.profile(Nonzero, tapescope.spec((2, 4)))


def test_shape_mismatch_keeps_the_models_message_and_names_the_module():
    with pytest.raises(ModelError) as e:
        tapescope.profile(WrongShape, tapescope.spec((2, 4)))
    assert "module 'fc'" in str(e.value) and "[2, 4] X [5, 4]" in str(e.value)


def test_op_without_fake_kernel():
    lib = torch.library.Library("tapescope_test", "DEF")  # noqa: F841 - kept alive for the test
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")

    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.ops.tapescope_test.double(self.fc(x)).sum()

    with pytest.raises(UnsupportedOpError, match="tapescope_test.double.*register_fake"):
        tapescope.profile(Custom, tapescope.spec((2, 4)))


def test_unknown_devices_and_specs():
    with pytest.raises(DeviceError):
        tapescope.profile(WrongShape, tapescope.spec((2, 5)), device="xla")
    from tapescope.zoo import resolve
    with pytest.raises(SpecError, match="Accepted forms"):
        resolve("resnet")
    with pytest.raises(SpecError, match="zoo has"):
        resolve("zoo:gpt5")
    with pytest.raises(SpecError, match="did you mean resnet18"):
        resolve("torchvision:resnet81")


def test_cli_reports_errors_without_traceback():
    r = CliRunner().invoke(app, ["profile", "torchvision:resnet81"])
    assert r.exit_code == 1
    assert "did you mean" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["profile", "zoo:gpt2:n_layers=2"])
    assert r.exit_code == 1 and "has no option n_layers" in r.output


# .ci/run runs these in a venv with a CPU-only torch and sets TAPESCOPE_EXPECT_CPU_ONLY_TORCH=1:
# there a CUDA build (a wheel index that resolved torch==2.13.0 to a CUDA build) must fail the
# run loudly, or CI would pass without ever testing the guards against the process abort.
_EXPECT_CPU_ONLY = os.environ.get("TAPESCOPE_EXPECT_CPU_ONLY_TORCH") == "1"


def _needs_cpu_only_torch():
    if not torch.backends.cuda.is_built():
        return
    if _EXPECT_CPU_ONLY:
        pytest.fail(f"TAPESCOPE_EXPECT_CPU_ONLY_TORCH=1 but torch {torch.__version__} is a CUDA "
                    "build: the CPU-only guards would go untested. Install a CPU-only wheel "
                    "(torch==2.13.0 from the CPU index) in this environment.")
    pytest.skip("needs a CPU-only torch build (CI's CPU-only venv runs it)")


def test_cuda_on_cpu_only_torch_fails_cleanly():
    _needs_cpu_only_torch()
    with pytest.raises(DeviceError, match="CUDA build"):
        tapescope.profile(WrongShape, tapescope.spec((2, 5)), device="cuda")
    r = CliRunner().invoke(app, ["profile", "zoo:gpt2:n_layer=1", "--device", "cuda"])
    assert r.exit_code == 1 and "CUDA build" in r.output


_ABORT_CASES = {
    "cuda input spec on a cpu profile": """
        tapescope.profile(lambda: nn.Linear(4, 4),
                          tapescope.spec((2, 4), device="cuda", requires_grad=True), device="cpu")
    """,
    "forward makes a cuda tensor that requires grad": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                b = torch.zeros(4, device="cuda", requires_grad=True)
                return (self.fc(x) + b.cpu()).sum()
        tapescope.profile(M, tapescope.spec((2, 4)))
    """,
    "forward moves a tensor to cuda": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                return self.fc(x).cuda().sum()
        tapescope.profile(M, tapescope.spec((2, 4)))
    """,
}


@pytest.mark.parametrize("case", _ABORT_CASES)
def test_cuda_on_cpu_only_torch_never_aborts_the_process(case):
    """Torch itself aborts the process (SIGABRT, exit 134) on these; tapescope must refuse them
    with a message. Each runs in its own process, so an abort fails the test, not the run."""
    import subprocess
    import sys
    import textwrap

    _needs_cpu_only_torch()
    code = ("import torch, torch.nn as nn, tapescope\n"
            "try:\n" + textwrap.indent(textwrap.dedent(_ABORT_CASES[case]), "    ") +
            "except tapescope.TapescopeError as e:\n    print('CLEAN:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "CLEAN:" in r.stdout and ("CUDA build" in r.stdout or "cuda" in r.stdout), r.stdout


def test_the_users_frame_under_a_folder_named_tapescope(tmp_path):
    """A user's checkout under a folder called tapescope (README's `git clone ... tapescope`) is
    still the user's code: the folders are the installed ones, not found by name."""
    import importlib.util

    from tapescope.errors import user_frame_of

    folder = tmp_path / "tapescope"
    folder.mkdir()
    source = folder / "user_model.py"
    source.write_text("import torch.nn as nn\n\n\n"
                      "class Broken(nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__()\n"
                      "        self.fc = nn.Linear(4, 4)\n\n"
                      "    def forward(self, x):\n"
                      "        return self.fc(x.t())  # line 10: (4, 2) into a 4-wide layer\n\n\n"
                      "def fail():\n"
                      "    raise ValueError('the user raised')  # line 14\n")
    spec = importlib.util.spec_from_file_location("tapescope_user_model", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    with pytest.raises(ValueError) as raised:
        module.fail()
    assert user_frame_of(raised.value) == f"{source}:14 (fail)"
    with pytest.raises(ModelError) as e:
        tapescope.profile(module.Broken, tapescope.spec((3, 4)))
    assert f"{source}:10" in str(e.value)
