"""README lists what `.ci/run` installs (issue 36: README's install omitted the g++ and torchtitan
CI uses), and `.ci/run` builds its CPU-only venv from an explicit CPU build: read from the script
itself, so that a package added to CI and not to README fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci() -> str:
    return (ROOT / ".ci" / "run").read_text()


def _installed(script: str) -> set[str]:
    """Every apt package, pip requirement (name==version) and extra that the script installs."""
    names = set()
    for line in re.sub(r"\\\n\s*", " ", script).splitlines():
        line = line.split("#", 1)[0]
        if "apt-get install" in line:
            names |= {w for w in line.split("install", 1)[1].split() if not w.startswith(("-", ">"))
                      and not w.startswith("/")}
        if "pip install" in line:
            names |= set(re.findall(r"[\w.-]+==[\w.+-]+", line))
            names |= {f"[{e}]" for e in re.findall(r'"\.\[([\w,]+)\]"', line)}
    return names


def test_readme_names_everything_ci_installs():
    readme = (ROOT / "README.md").read_text()
    installed = _installed(_ci())
    assert {"g++", "chromium", "torchtitan==0.3.0", "torch==2.14.1"} <= installed, installed
    for pinned in ("torch==2.14.1", "torchtitan 0.3.0", "bitsandbytes==0.50.2", "torchao==0.18.0",
                   "torch==2.13.0+cpu"):   # the versions that matter, as README writes them
        assert pinned in readme, pinned
    for item in installed:
        if item.startswith("["):
            assert f'".{item}"' in readme or f"{item[1:-1]}" in readme, item
        elif "==" in item:
            name = item.split("==")[0]
            assert name == "numpy" or f"{name}" in readme, item   # numpy: torch's own dependency
        else:
            assert f"`{item}`" in readme, item


def test_the_cpu_only_venv_takes_an_explicit_cpu_build():
    """PyPI's torch for Linux is the CUDA build: the CPU venv pins a `+cpu` local version, which
    only a CPU wheel source can satisfy (a folder of wheels or PyTorch's CPU index), and checks
    the build it got has no CUDA."""
    script = re.sub(r"\\\n\s*", " ", _ci())   # continued lines joined
    pins = re.findall(r'CPU_TORCH="(torch==[\d.]+\+cpu)"', script)
    assert len(pins) == 1, pins
    cpu_lines = [line for line in script.splitlines()
                 if "venv-cpu/bin/python -m pip install" in line and "CPU_TORCH" in line]
    assert len(cpu_lines) == 2 and all("--find-links" in line or "https://download.pytorch.org/whl/cpu"
                             in line for line in cpu_lines), cpu_lines
    assert "torch.backends.cuda.is_built()" in script and "sys.exit(" in script
