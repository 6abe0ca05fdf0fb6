"""tapescope's peak memory on CPU against the real allocator running the same step.

Truth: `validate.real.run_real_steps` runs the step for real under torch.profiler with
profile_memory=True and reads the allocator's own running total of allocated bytes.
"""

import pytest
import torch

from tapescope.devices.cpu import cpu_target
from tapescope.validate.real import run_real_steps

from .conftest import TINY_GPT2, TINY_LLAMA, profile_spec, tiny


def _rel(a, b):
    return abs(a - b) / b


@pytest.mark.parametrize("spec", [TINY_GPT2, TINY_LLAMA])
@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", None])
def test_zoo_peak_matches_allocator(spec, optimizer):
    m = tiny(spec)
    p = profile_spec(m, optimizer=optimizer)
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, optimizer=optimizer)
    # Goal: 1%. What remains is the allocator seeing 8-12 byte Python-scalar temporaries.
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3


# oneDNN's convolution kernels allocate scratch (layout reorders, per-thread weight-gradient
# buffers) that depends on the kernel oneDNN picks for the CPU's ISA: capture/fidelity/convolution.py
# models it from oneDNN's sources and is measured exact on AVX2 and AVX-512 hosts
# (tests/test_kernel_workspace.py); on other ISAs it is a heuristic (the profile says so).
_ONEDNN_SCRATCH = pytest.mark.xfail(
    cpu_target().isa not in ("avx2", "avx512"),
    reason="oneDNN convolution scratch is measured on AVX2 and AVX-512 only", strict=False)


@pytest.mark.parametrize("spec,seq,steady", [
    pytest.param("torchvision:convnext_tiny", 64, True, marks=_ONEDNN_SCRATCH),
    ("torchvision:convnext_tiny", 64, False),
    ("torchvision:mobilenet_v2", 64, True),
    ("torchvision:mobilenet_v2", 64, False),
])
def test_vision_peak_matches_allocator(spec, seq, steady):
    m = tiny(spec, batch=2, seq=seq)
    p = profile_spec(m)
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn)
    if steady:
        assert _rel(p.peak_bytes, real.peaks[2]) < 1e-2
    else:
        assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-2


def test_steady_state_holds_optimizer_state():
    """Adam keeps two moments per parameter: step 2 starts with them alive."""
    m = tiny(TINY_GPT2)
    p = profile_spec(m, optimizer="adamw")
    param_bytes = p.memory.at_peak["parameters"] if p.memory.at_peak["parameters"] else None
    state = sum(s.nbytes for s in p.trace.storages if "optimizer state" in s.roles
                and s.device == p.trace.device)
    params = sum(s.nbytes for s in p.trace.storages if "parameters" in s.roles)
    # exp_avg and exp_avg_sq have each parameter's size; `step` is one 4-byte scalar per parameter
    n_params = len([s for s in p.trace.storages if "parameters" in s.roles])
    assert state == 2 * params + 4 * n_params
    assert p.memory.initial_bytes >= params + state
    assert param_bytes is not None


class _InPlaceOnView(torch.nn.Module):
    """An in-place op on a view of an activation (`x.view(...).relu_()`, Dropout(inplace) after
    flatten): autograd rebases the view onto a CopySlices node, and the op's saved output is
    unpacked from inside it."""

    def __init__(self):
        super().__init__()
        self.lin, self.out = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)

    def forward(self, x):
        v = self.lin(x).view(-1, 16, 16)
        v.relu_()
        return self.out(v.flatten(1))


@pytest.mark.parametrize("optimizer", ["adamw", None])
def test_in_place_op_on_a_view_matches_allocator(optimizer):
    import tapescope

    inputs = (tapescope.spec((32, 64)),)
    p = tapescope.profile(_InPlaceOnView, *inputs, optimizer=optimizer)
    real = run_real_steps(_InPlaceOnView, inputs, optimizer=optimizer)
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3


# ---- the for-loop optimizer's loop-carried temporaries ----------------------------------------
# Truth: the real allocator. torch's for-loop Adam (`_single_tensor_adam`, the CPU default) binds
# each parameter's `denom` to a local that lives until the next parameter's `denom` replaces it,
# so the step peaks holding two of them (plus the next one's `sqrt`). A replay of the optimizer
# one parameter at a time (docs/benchmarks.md, candidate 1) would free each `denom` early and
# miss one whole parameter-sized buffer here (4 MiB of 46 MiB).

class _ThreeSquareLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(1024, 1024, bias=False)
        self.b = torch.nn.Linear(1024, 1024, bias=False)
        self.c = torch.nn.Linear(1024, 8, bias=False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _for_loop_adamw(params):
    return torch.optim.AdamW(params, foreach=False)


def test_for_loop_adam_holds_the_previous_parameters_denominator():
    import tapescope

    inputs = (torch.randn(2, 1024),)
    p = tapescope.profile(_ThreeSquareLinears, *inputs, optimizer=_for_loop_adamw)
    real = run_real_steps(_ThreeSquareLinears, inputs, optimizer=_for_loop_adamw)
    square = 1024 * 1024 * 4
    state = 4 * (2 * square + 1024 * 8 * 4)  # parameters, gradients, two moments
    # the case exercises what it guards: the real step holds sqrt + two denominators at once
    assert real.peaks[2] >= state + 3 * square
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3


# ---- how long the loss lives -------------------------------------------------------------------
# Truth: a training loop written out by hand (not capture.step.train_step), run for real under
# torch.profiler; validate.real._read_allocations only reads the allocator's running total.

class _Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256)

    def forward(self, x, y):
        return self.b(self.a(x).relu())


def _mse(out, x, y):
    return torch.nn.functional.mse_loss(out, y)


def _sgd_momentum(params):
    # momentum: step 1's optimizer allocates the buffers, so the step peaks in optimizer.step()
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _hand_written_loop(accumulate: int):
    """Two steps of the loop a user writes; `loss` is a local of the step's body, alive through
    optimizer.step() and zero_grad() (a micro-batch's until the next one's is assigned)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from tapescope.validate.real import _read_allocations

    gen = torch.Generator().manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("tapescope::step0"):
            model = _Regressor()
            x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
            opt = _sgd_momentum(model.parameters())

        def step():
            for _ in range(accumulate):
                loss = torch.nn.functional.mse_loss(model(x, y), y)
                if accumulate > 1:
                    loss = loss / accumulate
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        for s in (1, 2):
            with record_function(f"tapescope::step{s}"):
                step()
    return _read_allocations(prof, torch.device("cpu")).peaks


@pytest.mark.parametrize("accumulate", [1, 2])
def test_loss_lives_through_the_optimizer_step(accumulate):
    """mse_loss's 0-d result keeps a 64x256 float storage (capture/fidelity/losses.py); a loop's
    `loss` holds it through optimizer.step(), where this step peaks."""
    import tapescope

    inputs = (tapescope.spec((64, 256)), tapescope.spec((64, 256)))
    p = tapescope.profile(_Regressor, *inputs, loss_fn=_mse, optimizer=_sgd_momentum,
                          accumulate=accumulate)
    real = _hand_written_loop(accumulate)
    assert p.first_step_peak_bytes == real[1]
    assert p.peak_bytes == real[2]


class _ScaledChain(torch.nn.Module):
    """Python numbers multiplied into and dividing activations that require grad, in every
    spelling (`*`, `/`, `2 / x`, `.mul`, `torch.div`, `mul_`, an int and a bool), as attention
    scales and normalising constants are; and the same under no_grad, where nothing is saved."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        for _ in range(4):
            h = h * 0.5
            h = h / 3
            h = h.mul(2.0)
            h = torch.div(h, 1.5)
            h = 1.0 / (h + 10.0)
            h = h * True
            h = h.clone().mul_(0.25)
        with torch.no_grad():
            h.detach() * 0.5
        return h


def test_python_numbers_saved_for_backward():
    """Truth: the allocator's peaks of the real step, and the count of saved wrapped numbers from
    autograd itself (each node's `_saved_other` is the 0-dim tensor the number became): the
    4 x 7 ops keep 24 wrapped float64/int64 numbers and 4 bools alive to the backward (196 B)."""
    import tapescope

    inputs = (tapescope.spec((64, 32)),)
    p = tapescope.profile(_ScaledChain, *inputs, optimizer="sgd")
    real = run_real_steps(_ScaledChain, inputs, optimizer="sgd")
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])

    out, saved, seen = _ScaledChain()(torch.randn(64, 32)), [], set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        other = getattr(node, "_saved_other", None)
        if isinstance(other, torch.Tensor) and other.dim() == 0:
            saved.append(other.element_size())
        stack.extend(fn for fn, _ in node.next_functions)
    assert sorted(saved) == [1] * 4 + [8] * 24


class _AutocastEncoder(torch.nn.Module):
    """nn.TransformerEncoder, batch_first: MultiheadAttention hands its in-projection a
    transposed (non-contiguous) input, so Linear.cpp takes the matmul + add_(bias) branch."""

    def __init__(self, layers: int = 4, width: int = 64):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


def test_autocast_weight_casts_cached_through_the_forward():
    """Under CPU autocast every linear's weight and bias casts (fp32 leaves that require grad)
    sit in autocast's cast cache until the autocast ends, the in-projection's too (4 x
    (192 x 64 + 192) bf16 = 99,840 B). A trace that ran linear's matmul + add_ branch in Python
    cast `weight.t()` (a view, never cached) and left the bias fp32: before, 8 forward ops
    unmatched, 26,112 B fewer live at the end of the forward, steady peak +384 B here (-0.6%
    with dropout 0.1). Truth: the allocator's steady peak, its forward ops and live bytes."""
    import tapescope
    from tapescope.validate.per_op import compare_ops

    inputs = (tapescope.spec((4, 16, 64)),)
    p = tapescope.profile(_AutocastEncoder, *inputs, optimizer="adamw", amp="bf16")
    real = run_real_steps(_AutocastEncoder, inputs, optimizer="adamw", amp="bf16")
    assert p.peak_bytes == real.peaks[2]
    # the first step differs by the 12 B of Python-number temporaries (docs/validation.md)
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 16
    forward = [o for o in compare_ops(p, real, 2) if o.phase == "forward"]
    real_forward = [name for s, phase, name in real.ops if s == 2 and phase == "forward"]
    assert len(forward) == len(real_forward)  # every forward op matched, the casts included
    end = forward[-1]
    assert end.measured_before - forward[0].measured_before == \
        end.predicted_before - forward[0].predicted_before
