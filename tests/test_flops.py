"""FLOPs against PyTorch's own counter and against formulas derived by hand."""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import tapescope
from tapescope.analysis.flops import attention_pairs
from tapescope.capture.model import real_inputs
from tapescope.capture.step import forward_and_loss

from .conftest import MLP, TINY_GPT2, profile_spec, tiny

aten = torch.ops.aten
MATMUL_CONV = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution,
               aten.convolution_backward)


def _counter_flops(m):
    """FlopCounterMode's counts for a real forward+backward of the same step."""
    model = m.build()
    args, kwargs = real_inputs((m.inputs, m.input_kwargs), "cpu", None, torch.Generator())
    counter = FlopCounterMode(display=False)
    with counter:
        forward_and_loss(model, args, kwargs, m.loss_fn).backward()
    return {k: v for k, v in counter.get_flop_counts()["Global"].items() if k in MATMUL_CONV}


def _ours(p):
    out = {}
    for op in p.ops:
        packet = getattr(aten, op.name.split(".")[1])
        if packet in MATMUL_CONV and op.phase != "optimizer":
            out[packet] = out.get(packet, 0) + op.flops
    return out


@pytest.mark.parametrize("spec,seq", [(TINY_GPT2, 32), ("torchvision:resnet18", 32)])
def test_matmul_and_conv_equal_flop_counter(spec, seq):
    m = tiny(spec, batch=2, seq=seq)
    assert _ours(profile_spec(m, optimizer=None, steps=1)) == _counter_flops(m)


def test_resnet18_matches_flop_counters_published_count():
    """FlopCounterMode's own test asserts resnet18 fwd+bwd = 10,884,440,064 (batch 1, an input
    that requires grad, so the first convolution's input gradient is counted too)."""
    import torchvision

    p = tapescope.profile(torchvision.models.resnet18,
                          tapescope.spec((1, 3, 224, 224), requires_grad=True),
                          optimizer=None, steps=1)
    assert sum(_ours(p).values()) == 10_884_440_064


def test_causal_cpu_attention_counted_by_hand():
    # GPT-2 attention on CPU runs _scaled_dot_product_flash_attention_for_cpu (+ backward)
    B, T, H, C = 2, 32, 4, 64
    m = tiny(TINY_GPT2, batch=B, seq=T)
    p = profile_spec(m, optimizer=None, steps=1)
    fwd = [op for op in p.ops if op.name.startswith("aten._scaled_dot_product_flash_attention_for_cpu.")]
    bwd = [op for op in p.ops if "flash_attention_for_cpu_backward" in op.name]
    assert len(fwd) == len(bwd) == 2
    D = C // H
    pairs = T * (T + 1) // 2  # query i sees keys 0..i
    assert all(op.flops == 2 * B * H * pairs * (D + D) for op in fwd)            # QK^T, PV
    assert all(op.flops == 2 * B * H * pairs * (3 * D + 2 * D) for op in bwd)    # 5 matmuls
    assert attention_pairs(4, 6, "top_left") == 1 + 2 + 3 + 4
    assert attention_pairs(6, 4, "top_left") == 1 + 2 + 3 + 4 + 4 + 4
    assert attention_pairs(4, 6, "bottom_right") == 3 + 4 + 5 + 6


def test_mlp_forward_by_hand():
    B, d, h, o = 8, 16, 32, 4
    p = tapescope.profile(functools.partial(MLP, d, h, o), tapescope.spec((B, d)),
                          optimizer=None, steps=1)
    expected = {
        "aten.addmm.default": 2 * B * d * h + 2 * B * h * o,  # bias adds are not counted (as torch)
        "aten.gelu.default": 5 * B * h,                        # 0.5 * x * (1 + erf(x / sqrt2))
        "aten.sum.default": B * o,
    }
    got = {}
    for op in p.ops:
        if op.phase == "forward" and op.flops:
            got[op.name] = got.get(op.name, 0) + op.flops
    assert got == expected
    assert p.flops["forward"] == sum(expected.values())


def test_hard_activations_by_hand():
    """hardswish_ (in place) and the hard activations' backward ops carry no pointwise tag in
    aten; they are still elementwise: x * relu6(x + 3) / 6 is 4 operations per element,
    relu6(x + 3) / 6 is 3, and their gradients 4 and 2."""
    B, d = 4, 10
    model = lambda: nn.Sequential(nn.Linear(d, d), nn.Hardswish(inplace=True),  # noqa: E731
                                  nn.Linear(d, d), nn.Hardsigmoid())
    p = tapescope.profile(model, tapescope.spec((B, d)), optimizer=None, steps=1)
    got = {}
    for op in p.ops:
        if "hard" in op.name:
            got[op.name] = got.get(op.name, 0) + op.flops
    n = B * d
    assert got == {"aten.hardswish_.default": 4 * n, "aten.hardsigmoid.default": 3 * n,
                   "aten.hardsigmoid_backward.default": 2 * n,
                   "aten.hardswish_backward.default": 4 * n}
    assert not p.uncounted_ops


class _Interpolate(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        y = F.interpolate(self.conv(x), scale_factor=2, mode="bilinear")
        y = y.masked_fill(y > 0, 0.0)
        return torch.ops.aten._safe_softmax(y.flatten(1), -1)


def test_interpolation_selection_and_safe_softmax_by_hand():
    """Bilinear: each output is 4 multiply-adds (8 FLOPs), its backward scatters each output
    gradient to the same 4 taps; masked_fill is a selection per element (1); _safe_softmax is
    softmax (5) plus the all-masked-row check (x == -inf, all, where: 3)."""
    p = tapescope.profile(_Interpolate, tapescope.spec((1, 2, 4, 4)), optimizer=None, steps=1)
    out = 1 * 2 * 8 * 8
    got = {op.name: op.flops for op in p.ops
           if any(k in op.name for k in ("upsample", "masked_fill", "safe_softmax"))}
    assert got == {"aten.upsample_bilinear2d.default": 8 * out,
                   "aten.upsample_bilinear2d_backward.default": 8 * out,
                   "aten.masked_fill.Scalar": out,
                   "aten._safe_softmax.default": 8 * out}
    assert not p.uncounted_ops


@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd"])
def test_optimizer_flops_do_not_depend_on_the_implementation(opt):
    """The for-loop, foreach and fused kernels do the same arithmetic per element."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[opt]
    extra = {"momentum": 0.9} if opt == "sgd" else {}
    totals = {}
    for impl in ("for-loop", "foreach", "fused"):
        kw = {"foreach": impl == "foreach", "fused": impl == "fused" or None}
        if impl != "fused":
            kw["fused"] = False
        p = tapescope.profile(functools.partial(MLP, 16, 32, 4), tapescope.spec((8, 16)),
                              optimizer=lambda ps, kw=kw: cls(ps, lr=0.1, **extra, **kw))
        assert p.facts["optimizer"]["implementation"] == impl
        totals[impl] = p.flops["optimizer"]
    assert totals["for-loop"] == totals["foreach"] == totals["fused"] > 0


def test_ops_without_a_formula_are_listed():
    class Sorter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sort(self.fc(x), dim=-1).values.sum()

    p = tapescope.profile(Sorter, tapescope.spec((4, 8)), optimizer=None, steps=1)
    assert "aten.sort.default" in p.uncounted_ops or "aten.sort.stable" in p.uncounted_ops
    counted = [op for op in p.ops if op.flops is None]
    assert all(op.name in p.uncounted_ops for op in counted)
