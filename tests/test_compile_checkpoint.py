"""A compiled step with activation checkpointing, against the same step compiled for real.

Truth: `validate.real.run_real_steps(..., compile=True)` builds the model with the plan applied by
torch's own `checkpoint_wrapper` (capture/checkpointing.py's `apply_policies`, as a user's script
does), compiles it with torch.compile (inductor's C++ backend, real kernels) and runs it under
torch.profiler: the allocator's peaks, and the graphs the real partitioner produced. Dynamo traces a
checkpointed module as a higher-order op, and AOTAutograd's partitioner recomputes its ops in the
backward (all of them for "full", all but the saved ops' outputs for "selective").

Before: the checkpointed blocks left the compiled graph (two graph breaks: the model's private copy
held a copy of `torch.utils.checkpoint.checkpoint`, which dynamo does not recognize, and the
capture's module hooks mutated a list inside the higher-order op) and ran eagerly: 3 MLP blocks,
blocks 0-1 fully checkpointed, steady peak +131,512 B (the eager checkpointed step's).
"""

import pytest
import torch.utils.checkpoint

import tapescope
from tapescope.capture.checkpointing import apply_policies
from tapescope.capture.isolation import Isolation
from tapescope.validate.real import run_real_steps

from .test_compile import _real_saved, mlp_blocks

# the activations dominate the step at this batch, so the plan moves the real peak by 30%
INPUTS = (tapescope.spec((8, 64, 128)),)
SAVE = ("aten.addmm.default",)
PLANS = {
    "full": ["0", "1"],
    "selective": [("0", "selective", SAVE), ("1", "selective", SAVE)],
}


@pytest.fixture(scope="module", params=sorted(PLANS))
def checkpointed(request):
    plan = PLANS[request.param]
    real = run_real_steps(lambda: apply_policies(mlp_blocks(), plan), INPUTS, compile=True)
    return plan, real


def _saved(p) -> list:
    # a model that holds the wrappers itself names its parameters through them
    # ("0._checkpoint_wrapped_module.fc1.bias"); its state_dict, and the truth's names, do not
    return sorted(("input" if s.input and s.input.startswith("input") else
                   (s.input or s.name).replace("_checkpoint_wrapped_module.", ""),
                   s.shape, s.dtype) for s in p.compiled.saved)


@pytest.mark.parametrize("how", ["plan", "in the model"])
def test_compiled_checkpointed_step_matches_allocator(checkpointed, how):
    plan, real = checkpointed
    if how == "plan":
        p = tapescope.profile(mlp_blocks, *INPUTS, compile=True, checkpointing=plan)
    else:  # the user's model already holds checkpoint_wrapper modules
        p = tapescope.profile(lambda: apply_policies(mlp_blocks(), plan), *INPUTS, compile=True)
    assert p.compiled.regions == 1 and not p.compiled.graph_breaks
    # 12 bytes: scalar tensors a CPU kernel makes for Python numbers (as in tests/test_compile.py)
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12
    assert _saved(p) == _real_saved(real)
    assert p.compiled.recompute_flops > 0  # the checkpointed ops run again in the backward
    # the compiled checkpointed step is below the eager checkpointed one (fusion, fewer saves)
    assert p.peak_bytes < p.eager.peak_bytes


def test_the_model_copy_keeps_torch_functions_themselves():
    """Dynamo recognizes `torch.utils.checkpoint.checkpoint` by identity; the private copy of a
    model keeps it (its keyword defaults are a dict, which holds no state of the model)."""
    iso = Isolation(lambda t: t, lambda t: t)
    fn = torch.utils.checkpoint.checkpoint
    assert iso._copy(fn, "checkpoint_fn") is fn
    assert iso._copy(fn.__wrapped__, "checkpoint_fn") is fn.__wrapped__

    def user(x, *, cache={}):  # noqa: B006 - a keyword default that holds state is copied
        return cache

    copied = iso._copy(user, "f")
    assert copied is not user and copied.__kwdefaults__["cache"] is not user.__kwdefaults__["cache"]


def test_compiled_checkpointed_cuda_step_without_gpu():
    """The same on a GPU-less H100 (capture/gpu_less.py): two Llama-style blocks, block 0
    checkpointed. Truths: each graph's generated wrapper read as text gives the allocations and
    frees the Tape saw (tests/test_compile_cuda.py), and what the forward saves is what real
    torch.compile's partitioner saves for the same model on this CPU (the joint graph of these
    ops, and AOTAutograd's min-cut partition of it, do not depend on the device; inductor's
    code generation, which does, is checked by the wrapper)."""
    from .test_compile_cuda import _source_events, _tape_events, two_blocks

    inputs, plan = (tapescope.spec((8, 128, 128)),), ["0"]
    p = tapescope.profile(two_blocks, *inputs, device="cuda", gpu="h100", compile=True,
                          optimizer=None, steps=1, checkpointing=plan)
    assert p.compiled.regions == 1 and not p.compiled.graph_breaks
    for kind in ("forward", "backward"):
        graph = next(g for g in p.compiled.graphs if g.kind == kind)
        assert _tape_events(p, f"{kind} 0") == _source_events(graph.wrapper_code)
    real = run_real_steps(lambda: apply_policies(two_blocks(), plan), inputs, compile=True,
                          optimizer=None, steps=1)
    assert _saved(p) == _real_saved(real)


def test_cli_profile_compiled_with_checkpointing(tmp_path):
    """`tapescope profile ... --compile --checkpoint MODULE` on a GPU-less H100: the plan is
    applied to both steps, side by side; a bad --checkpoint value is a message, not a traceback."""
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_LLAMA

    out = tmp_path / "p.json"
    args = ["profile", TINY_LLAMA, "--batch", "2", "--seq", "32", "--device", "cuda", "--gpu",
            "h100", "--amp", "bf16", "--compile", "-q"]
    r = CliRunner().invoke(app, args + ["--checkpoint", "layers.0",
                                        "--checkpoint", "layers.1:selective:aten.mm.default",
                                        "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Eager vs torch.compile" in r.output
    d = json.loads(out.read_text())
    assert d["facts"]["checkpointing"] == [
        {"module": "layers.0", "mode": "full"},
        {"module": "layers.1", "mode": "selective", "save_ops": ["aten.mm.default"]}]
    assert d["compiled"]["regions"] == 1 and not d["compiled"]["graph_breaks"]
    bad = CliRunner().invoke(app, args + ["--checkpoint", "layers.9"])
    assert bad.exit_code == 1 and "no module 'layers.9'" in bad.output


def _self_compiled_checkpointed_blocks():
    """torchtune's order: the model's code compiles each layer (`compile_model`), then wraps each
    in a non-reentrant CheckpointWrapper (`set_activation_checkpointing`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from .test_compile import MLPBlock

    m = mlp_blocks(3)
    for block in m:
        block.compile()
    apply_activation_checkpointing(m, auto_wrap_policy=ModuleWrapPolicy({MLPBlock}))
    return m


def test_a_user_step_recomputes_self_compiled_checkpointed_layers_compiled():
    """Truth: the same step and setup (AdamW in the backward) run for real on the model as built.
    Before: the user step's phase hooks were traced into each compiled layer, so dynamo guarded on
    which layer ran and recompiled per layer until its recompile limit (8) sent a layer, its
    recomputation in the backward included, to eager; torch.utils.checkpoint then refused the
    recomputed tensors (CheckpointError). With 3 layers: 2 graphs (the first layer's input does
    not require grad), for both steps: the phase hooks are registered once for the run (they
    were registered each step, and dynamo, guarding on the global hook dicts' keys, recompiled
    both graphs in step 2), as a run without tapescope's hooks compiles them."""
    from .test_compile import _adamw_in_backward, _backward_only

    inputs = (tapescope.spec((4, 32, 128)),)
    real = run_real_steps(_self_compiled_checkpointed_blocks, inputs, step=_backward_only,
                          setup=_adamw_in_backward)
    p = tapescope.profile(_self_compiled_checkpointed_blocks, *inputs, compile=True,
                          step=_backward_only, setup=_adamw_in_backward)
    assert not p.compiled.graph_breaks
    assert p.compiled.regions == 2
    assert {lab for lab, _, _ in p.trace.compiled_calls} >= {"forward 0", "backward 0"}
    # 12 bytes: scalar tensors a CPU kernel makes for Python numbers (as in tests/test_compile.py)
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12
