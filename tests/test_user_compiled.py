"""Code the user compiled with torch.compile outside the model, in an eager profile: torchtitan's
`--compile.components loss` wraps its loss function in torch.compile (components/loss.py,
`BaseLoss._maybe_compile`). Before, inductor compiled it and ran its CPU kernels on the fake
tensors' data: the process died (segfault, exit 139). Now it runs as dynamo captured it, and the
console says so.

Truth: a real CPU step of the same model and the same loss uncompiled (the eager step the profile
claims to be), under the allocator's profiler (validate.real).
"""

import pytest
import torch
from rich.console import Console

import tapescope
from tapescope.report.console import render_summary
from tapescope.validate.real import run_real_steps

INPUT = tapescope.spec((8, 64))


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _loss(out, x):
    return (out.float() - x).square().mean()


def _console(p) -> str:
    console = Console(record=True, width=300)
    render_summary(p, console)
    return console.export_text()


def test_a_compiled_loss_runs_eagerly_with_a_printed_line():
    p = tapescope.profile(_model, INPUT, loss_fn=torch.compile(_loss), device="cpu")
    real = run_real_steps(_model, (INPUT,), loss_fn=_loss, steps=2)
    assert p.first_step_peak_bytes == pytest.approx(real.peaks[1], abs=16)
    assert p.peak_bytes == pytest.approx(real.peaks[2], abs=16)
    assert "compiled with torch.compile outside the model (a compiled loss, ...: 1 graph(s)) " \
           "ran eagerly" in _console(p)


def test_torchtitan_compiled_loss_runs_eagerly_with_a_printed_line():
    """torchtitan's own CrossEntropyLoss built with `--compile.enable --compile.components loss`
    (its `fn` is torch.compile'd), on a GPU-less H100 profile: it traces and the console says it
    ran eagerly."""
    pytest.importorskip("torchtitan")
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig

    titan_loss = CrossEntropyLoss(CrossEntropyLoss.Config(),
                                  compile_config=CompileConfig(enable=True, components=["loss"]))
    assert hasattr(titan_loss.fn, "_torchdynamo_orig_callable")  # compiled by torchtitan

    def loss(logits, tokens):
        return titan_loss(logits, tokens)[0] / tokens.numel()

    def build():
        return torch.nn.Sequential(torch.nn.Embedding(128, 64), torch.nn.Linear(64, 128))

    p = tapescope.profile(build, tapescope.spec((2, 32), dtype=torch.long), loss_fn=loss,
                          gpu="h100")
    assert "ran eagerly in this profile" in _console(p)


def test_torchtitan_apply_compile_without_compile_runs_eagerly_with_a_printed_line():
    """torchtitan's `--compile.enable` (apply_compile: `block.compile(fullgraph=True)` on every
    block) profiled without compile=True: the blocks run eagerly and the console says which, and
    how to profile them compiled."""
    pytest.importorskip("torchtitan")
    from .test_torchtitan import _config, _loss, _parallelize_compiled

    p = tapescope.profile(_config().build, tapescope.spec((2, 128), dtype=torch.long),
                          loss_fn=_loss, mesh={"fsdp": 2}, parallelize=_parallelize_compiled,
                          gpu="h100")
    text = _console(p)
    assert "modules compiled with Module.compile() (layers.0, layers.1) ran eagerly in this " \
           "profile; pass --compile (compile=True)" in text, text


def _sum_loss(out, x):
    return out.sum()


def test_compiled_loss_in_a_compiled_profile_against_a_real_compiled_step():
    """A torch.compile'd loss under compile=True. Before, inductor compiled the loss for real and
    its wrapper allocated real buffers (`empty_strided_cpu` bypasses the fake mode): backward
    stopped at "Please convert all Tensors to FakeTensors". Now the loss is compiled by
    tapescope's backend, a region of the compiled step beside the model's. Truth: the same model
    and compiled loss run for real with torch.compile on this CPU (inductor's C++ kernels),
    under the allocator's profiler; the 12 bytes are the scalar tensors CPU kernels make for
    Python numbers, as in tests/test_compile.py. (A bias-free linear and a sum: one C++ kernel
    to build for the real run.)"""
    def build():
        return torch.nn.Linear(64, 64, bias=False)

    loss = torch.compile(_sum_loss)
    p = tapescope.profile(build, INPUT, loss_fn=loss, compile=True)
    real = run_real_steps(build, (INPUT,), loss_fn=loss, compile=True)
    assert p.compiled.regions == 2   # the model's graph and the loss's
    assert any("aten.sum" in g.graph.code for g in p.compiled.graphs if g.kind == "forward")
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12
