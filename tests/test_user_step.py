"""A user's own training step (`profile(..., step=fn, setup=fn)`), run as written.

Truth: the same functions run for real on the CPU under torch.profiler (validate.real
.run_real_steps(step=fn, setup=fn): the allocator's running total, the outermost dispatched ops
with the phase each ran in, marked the way capture marks them).
"""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope
from tapescope.capture.records import BACKWARD, FORWARD, OPTIMIZER, OTHER
from tapescope.errors import TapescopeError
from tapescope.validate.harness import same_ops
from tapescope.validate.real import run_real_steps

from .conftest import optimizer_in_backward

BATCH = (tapescope.spec((32, 64)), tapescope.spec((32,), dtype=torch.long))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x, y=None):  # y: the labels the built-in step passes too
        return self.c(self.b(self.a(x).relu()).relu())


def _sgd(params):
    # SGD with momentum: step 1 makes the buffers. (AdamW's update wraps Python numbers in
    # 0-d tensors, 12 bytes tapescope does not model: docs/validation.md)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _truth(build, inputs=BATCH, **kw):
    """The profile, the real run of the same step, and whether their step-2 ops (with phases)
    are the same."""
    p = tapescope.profile(build, *inputs, **kw)
    real = run_real_steps(build, inputs, **kw)
    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops
                            if s == 2 and ph])
    return p, real, ok, diff


def _phases(p, step=2) -> list:
    """The phases of a step in order, each run once per stretch."""
    out = []
    for s in p.trace.segments:
        if s.step == step and len(s.ops) and (not out or out[-1] != s.phase):
            out.append(s.phase)
    return out


# ---- clipping, an EMA of the weights, a scheduler ---------------------------------------------

def _clip_setup(model):
    optimizer = _sgd(model.parameters())
    return {"optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
            "ema": [p.detach().clone() for p in model.parameters()]}


def _clip_step(foreach):
    def step(model, batch, state):
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
        state["optimizer"].step()
        state["optimizer"].zero_grad(set_to_none=True)
        state["scheduler"].step()
        with torch.no_grad():
            for e, p in zip(state["ema"], model.parameters()):
                e.lerp_(p, 0.01)
        return loss.detach()
    return step


def _deepcopy_ema_setup(model):
    import copy

    # the EMA as a whole model, as many training scripts write it (a deepcopy made in setup)
    return {"optimizer": _sgd(model.parameters()), "ema": copy.deepcopy(model)}


def _deepcopy_ema_step(model, batch, state):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    with torch.no_grad():
        for e, p in zip(state["ema"].parameters(), model.parameters()):
            e.lerp_(p, 0.01)


def test_an_ema_deepcopied_in_setup_matches_a_real_run():
    """`copy.deepcopy(model)` in setup copies each fake tensor's dict, which names its fake mode:
    the copy stays in the capture's mode ("Mixing fake modes NYI" before), and its weights are
    new storages, kept from step to step."""
    p, real, ok, diff = _truth(_Net, step=_deepcopy_ema_step, setup=_deepcopy_ema_setup,
                               optimizer=None)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach-default", "for-loop"])
def test_clip_ema_scheduler_step_matches_a_real_run(foreach):
    step = _clip_step(foreach)
    p, real, ok, diff = _truth(_Net, step=step, setup=_clip_setup, optimizer=None)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    names = {op.name for op in p.ops if op.phase == OTHER}
    # torch's default for plain CPU tensors is the foreach norm (fidelity/libraries.py: fake
    # tensors get the plain tensor's answer); foreach=False takes one norm per gradient
    assert ("aten._foreach_norm.Scalar" in names) == (foreach is None)
    assert "aten.lerp_.Scalar" in names                       # the EMA, the step's own code
    assert _phases(p) == [FORWARD, OTHER, BACKWARD, OTHER, OPTIMIZER, OTHER]
    # the EMA's copy of the weights is kept from step to step, as optimizer state is
    params = sum(q.numel() * 4 for q in _Net().parameters())
    assert p.memory.at_peak["optimizer state"] == 2 * params   # momentum buffers + the EMA
    assert p.facts["step"] == {"fn": "_clip_step.<locals>.step", "setup": "_clip_setup",
                               "optimizers": 1}
    assert p.flops["other"] > 0


# ---- two optimizers: a GAN's discriminator and generator ---------------------------------------

class _GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 64))
        self.D = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))


def _gan_setup(model):
    return _sgd(model.G.parameters()), _sgd(model.D.parameters())


def _lsgan_step(model, batch, optimizers):
    """Least-squares GAN: the discriminator's step on real and generated samples, then the
    generator's through the discriminator."""
    z, real = batch
    opt_g, opt_d = optimizers
    fake = model.G(z)
    ones, zeros = real.new_ones(real.shape[0], 1), real.new_zeros(real.shape[0], 1)
    d_loss = F.mse_loss(model.D(real), ones) + F.mse_loss(model.D(fake.detach()), zeros)
    opt_d.zero_grad(set_to_none=True)
    d_loss.backward()
    opt_d.step()
    g_loss = F.mse_loss(model.D(fake), ones)
    opt_g.zero_grad(set_to_none=True)
    g_loss.backward()
    opt_g.step()


def test_two_optimizers_step_matches_a_real_run():
    inputs = (tapescope.spec((32, 16)), tapescope.spec((32, 64)))
    p, real, ok, diff = _truth(_GAN, inputs, step=_lsgan_step, setup=_gan_setup, optimizer=None)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    assert p.facts["step"]["optimizers"] == 2
    assert _phases(p) == [FORWARD, OTHER, FORWARD, OTHER, FORWARD, OTHER, BACKWARD, OPTIMIZER,
                          FORWARD, OTHER, BACKWARD, OPTIMIZER]
    # both optimizers' momentum buffers are optimizer state
    params = sum(q.numel() * 4 for q in _GAN().parameters())
    state = sum(s.nbytes for s in p.trace.storages if "optimizer state" in s.roles)
    assert state == params


# ---- the optimizer inside the backward (torchtune's low-memory recipes) -------------------------

def _in_backward_setup(model):
    return optimizer_in_backward(model, _sgd)


def _backward_only_step(model, batch, optimizers):
    x, y = batch
    F.cross_entropy(model(x), y).backward()


def _plain_step(model, batch, optimizer):
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_optimizer_in_backward_matches_a_real_run():
    p, real, ok, diff = _truth(_Net, step=_backward_only_step, setup=_in_backward_setup,
                               optimizer=None)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    n = len(list(_Net().parameters()))
    assert p.facts["step"]["optimizers"] == n
    # each optimizer steps inside the backward, once its parameter's gradient is ready
    assert _phases(p) == [FORWARD, OTHER] + [BACKWARD, OPTIMIZER] * n
    # the point of the recipe: the gradients are never all alive, so the step peaks lower than
    # the same step with one optimizer after the backward
    plain = tapescope.profile(_Net, *BATCH, step=_plain_step, optimizer=_sgd)
    params = sum(q.numel() * 4 for q in _Net().parameters())
    assert p.memory.at_peak["gradients"] < params <= plain.memory.at_peak["gradients"]
    assert p.peak_bytes < plain.peak_bytes


# ---- hooks on autograd's C++ nodes (torch.distributed.pipelining's split backward) -------------

def _cpp_node_hooks_step(model, batch, optimizer):
    x, y = batch
    hidden = model.a(x).relu()
    loss = F.cross_entropy(model.c(model.b(hidden).relu()), y)
    loss.grad_fn.register_prehook(lambda grads: (grads[0] * 2,))      # a pre-hook replacing
    removed = hidden.grad_fn.register_prehook(lambda grads: (grads[0] * 0,))
    removed.remove()                                                   # removed: never runs
    hidden.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0].clone(),))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_hooks_on_cpp_nodes_run_as_in_a_real_run():
    """Hooks filed on C++ autograd nodes (NllLossBackward0, ReluBackward0) go through no Python
    method of the node: tapescope reads them back from the dict torch keeps them in. The
    pre-hook's multiply and the post-hook's clone are in the real backward and in the trace;
    the removed hook runs in neither."""
    p, real, ok, diff = _truth(_Net, step=_cpp_node_hooks_step, optimizer=_sgd)
    assert ok, diff
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    backward = [op.name for op in p.ops if op.phase == BACKWARD]
    assert backward[:2] == ["aten.ones_like.default", "aten.mul.Tensor"]   # the pre-hook, first
    assert "aten.clone.default" in backward


# ---- activation offloading with saved-tensor hooks --------------------------------------------

def _save_on_cpu_step(model, batch, optimizer):
    x, y = batch
    with torch.autograd.graph.save_on_cpu():
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _copy(t):
    return t.detach().clone()  # what an offloading pack hook does (a copy in host memory)


def _same(t):
    return t


def _copying_hooks_step(model, batch, optimizer):
    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(_copy, _same):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_save_on_cpu_matches_a_real_run():
    """On a cpu device, torch's save_on_cpu packs a tensor as `tensor.cpu()`: itself, no copy."""
    p, real, ok, diff = _truth(_Net, step=_save_on_cpu_step, optimizer=_sgd)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    plain = tapescope.profile(_Net, *BATCH, step=_plain_step, optimizer=_sgd)
    assert p.peak_bytes == plain.peak_bytes


def test_offloading_hooks_copies_are_counted_as_a_real_run_counts_them():
    """A pack hook that copies (the host copy offloading makes): on cpu the copies are the same
    memory as the device's, alive until their node runs."""
    p = tapescope.profile(_Net, *BATCH, step=_copying_hooks_step, optimizer=_sgd)
    real = run_real_steps(_Net, BATCH, step=_copying_hooks_step, optimizer=_sgd)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    # the clones a pack hook makes run inside the op that saves (the profiler nests them there,
    # so its outermost ops do not show them); every other op is the same
    ops = [op for op in p.ops if op.name != "aten.clone.default"]
    real_names = [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops if s == 2 and ph]
    assert [f"{op.phase} {op.name.rsplit('.', 1)[0]}" for op in ops] == real_names
    plain = tapescope.profile(_Net, *BATCH, step=_plain_step, optimizer=_sgd)
    assert p.peak_bytes > plain.peak_bytes


def test_offloading_to_the_host_leaves_a_cuda_step_s_device_memory():
    """A GPU-less CUDA step whose pack hook copies to the CPU: the copies are host memory, not in
    the device's peak; the activations they replace are freed on the device."""
    if not torch.backends.cuda.is_built():
        pytest.skip("a CUDA trace needs a CUDA build of torch")

    def to_host(t):
        return t.device, t.to("cpu")

    def back(packed):
        device, t = packed
        return t.to(device)

    def offload_step(model, batch, optimizer):
        x, y = batch
        with torch.autograd.graph.saved_tensors_hooks(to_host, back):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def before_backward(p):  # live device bytes, and saved ones, when the backward starts
        i = next(i for i, op in enumerate(p.ops) if op.phase == BACKWARD) - 1
        return p.memory.timeline[i], p.memory.timeline_by_category["saved activations"][i]

    p = tapescope.profile(_Net, *BATCH, step=offload_step, optimizer=_sgd, device="cuda")
    plain = tapescope.profile(_Net, *BATCH, step=_plain_step, optimizer=_sgd, device="cuda")
    (live, saved), (plain_live, plain_saved) = before_backward(p), before_backward(plain)
    assert saved == 0 < plain_saved
    assert live < plain_live
    host = sum(s.nbytes for s in p.trace.storages if s.device.type == "cpu")
    assert host >= plain_saved


# ---- the built-in step is one program among others ---------------------------------------------

def _builtin_as_written(model, batch, optimizer):
    """capture/step.py's step, written out as a user would: the same ops, the loss in OTHER."""
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _ce(out, x, y):
    return F.cross_entropy(out, y)


def test_the_built_in_step_written_out_is_the_same_step():
    builtin = tapescope.profile(_Net, *BATCH, loss_fn=_ce, optimizer="adamw")
    mine = tapescope.profile(_Net, *BATCH, step=_builtin_as_written, optimizer="adamw")
    assert mine.first_step_peak_bytes == builtin.first_step_peak_bytes
    assert mine.peak_bytes == builtin.peak_bytes
    assert [op.name for op in mine.ops] == [op.name for op in builtin.ops]
    # the loss is the step's own code; its backward still maps to the op that made it
    loss_ops = [op for op in mine.ops if op.phase == OTHER]
    assert [op.name for op in loss_ops] == ["aten._log_softmax.default",
                                            "aten.nll_loss_forward.default"]
    mapped = [mine.ops[op.forward_op].name for op in mine.ops
              if op.phase == BACKWARD and op.forward_op is not None]
    assert "aten.nll_loss_forward.default" in mapped
    assert mine.facts["step2"] == "traced" and builtin.facts["step2"] == "reused"


# ---- mistakes ---------------------------------------------------------------------------------

def _shape_mistake(model, batch, optimizer):
    x, y = batch
    model(x) @ torch.ones(3, 3)


def test_an_error_in_the_step_names_its_line_and_restores_torch():
    backward, grad = torch.autograd.backward, torch.autograd.grad
    with pytest.raises(TapescopeError) as e:
        tapescope.profile(_Net, *BATCH, step=_shape_mistake)
    msg = str(e.value)
    assert "\n" not in msg
    assert "the step raised RuntimeError in the step's own code" in msg
    assert f"{__file__}:" in msg and "(_shape_mistake)" in msg
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    # the global module and optimizer-step hooks that found the phases are gone
    from torch.nn.modules import module
    from torch.optim import optimizer

    assert not module._global_forward_pre_hooks and not module._global_forward_hooks
    assert not optimizer._global_optimizer_pre_hooks
    assert not optimizer._global_optimizer_post_hooks


@pytest.mark.parametrize("kw,why", [
    ({"loss_fn": "sum"}, "loss_fn"), ({"accumulate": 2}, "accumulate"), ({"amp": "bf16"}, "amp"),
    ({"compile": True}, "compile")])
def test_options_of_the_built_in_step_are_refused_with_a_step(kw, why):
    with pytest.raises(TapescopeError, match=why):
        tapescope.profile(_Net, *BATCH, step=_plain_step, **kw)


def test_setup_needs_a_step():
    with pytest.raises(TapescopeError, match="setup= goes with step="):
        tapescope.profile(_Net, *BATCH, setup=_clip_setup)


def test_cli_step_and_setup_from_files(tmp_path):
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", "examples/my_model.py:build", "--input", "2,3,32,32",
                                 "--input", "2:int64", "--step", "examples/my_step.py:train_step",
                                 "--setup", "examples/my_step.py:setup", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "your step train_step" in r.output and "other" in r.output
    facts = json.loads(out.read_text())["facts"]
    assert facts["step"] == {"fn": "train_step", "setup": "setup", "optimizers": 1}


# ---- GradScaler with fp16 autocast; a chunked cross-entropy --------------------------------------

def _scaler_setup(model):
    return {"optimizer": _sgd(model.parameters()), "scaler": torch.amp.GradScaler("cpu")}


def _scaler_step(model, batch, state):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    state["scaler"].scale(loss).backward()
    state["scaler"].unscale_(state["optimizer"])      # found_inf is read back with .item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    state["scaler"].step(state["optimizer"])
    state["scaler"].update()
    state["optimizer"].zero_grad(set_to_none=True)


def test_grad_scaler_step_matches_a_real_run_assuming_finite_gradients():
    p, real, ok, diff = _truth(_Net, step=_scaler_step, setup=_scaler_setup, optimizer=None)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    names = {op.name for op in p.ops}
    assert "aten._amp_foreach_non_finite_check_and_unscale_.default" in names
    assert "aten._amp_update_scale_.default" in names
    kinds = [a.kind for a in p.trace.assumptions if a.decided]
    assert kinds == ["finite gradients"]   # said in the report: the optimizer steps


def _chunked_step(model, batch, optimizer):
    x, y = batch
    h = model.b(model.a(x).relu()).relu()
    total = 0
    for hc, yc in zip(h.chunk(4), y.chunk(4)):  # the head and its loss a quarter at a time
        total = total + F.cross_entropy(model.c(hc), yc, reduction="sum")
    (total / y.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_chunked_cross_entropy_step_matches_a_real_run():
    p, real, ok, diff = _truth(_Net, step=_chunked_step, optimizer=_sgd)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    assert ok, diff
    assert sum(op.name == "aten._log_softmax.default" for op in p.ops) == 4


def test_validate_runs_the_users_own_step(tmp_path):
    """validate --step: the user's step predicted and run for real under the profiler (the CPU
    allocator's events), the peaks within the 12 bytes README states for every step."""
    from tapescope.validate.harness import validate

    f = tmp_path / "mystep.py"
    f.write_text("import torch.nn.functional as F\n\n"
                 "def step(model, batch, opt):\n"
                 "    x, y = batch\n"
                 "    F.cross_entropy(model(x), y).backward()\n"
                 "    opt.step(); opt.zero_grad(set_to_none=True)\n")
    v = validate(_Net, *BATCH, step=f"{f}:step", warmup=0, steps=1, device="cpu")
    assert v.ops_match
    for quantity, predicted, measured in v.rows[:2]:
        assert 0 <= measured - predicted <= 12, (quantity, predicted, measured)
