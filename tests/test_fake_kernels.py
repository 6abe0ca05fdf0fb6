"""Fake kernels installed for a capture (capture/fidelity/fake_kernels.py) against the real kernels.

Truth: the real CPU kernel's output shape and strides, and whether it refuses the inputs.
"""

import pytest
import torch

import tapescope
from tapescope.capture.session import Recorder
from tapescope.torch_compat import FakeTensorMode

CPU = torch.device("cpu")
OFFS = [3, 6, 9, 12]


def _cases():
    """(mat_a, mat_b, offs) makers for each layout the real kernel takes; sizes chosen so that
    some outputs need their rows padded to 16 bytes."""
    def offs(): return torch.tensor(OFFS, dtype=torch.int32)
    return {
        "2d x 3d": lambda dt: (torch.randn(12, 8, dtype=dt), torch.randn(4, 8, 16, dtype=dt), offs()),
        "2d x 3d, b transposed": lambda dt: (torch.randn(12, 8, dtype=dt),
                                             torch.randn(4, 16, 8, dtype=dt).transpose(-2, -1),
                                             offs()),
        "2d x 3d, padded rows": lambda dt: (torch.randn(12, 8, dtype=dt),
                                            torch.randn(4, 6, 8, dtype=dt).transpose(-2, -1),
                                            offs()),
        "2d x 2d (weight gradient)": lambda dt: (torch.randn(12, 8, dtype=dt).t(),
                                                 torch.randn(12, 16, dtype=dt), offs()),
        "3d x 2d": lambda dt: (torch.randn(4, 8, 16, dtype=dt), torch.randn(16, 16, dtype=dt),
                               torch.tensor([4, 8, 12, 16], dtype=torch.int32)),
        "3d x 3d": lambda dt: (torch.randn(4, 12, 8, dtype=dt), torch.randn(4, 8, 16, dtype=dt),
                               None),
    }


def _fake_grouped_mm(a, b, offs):
    rec = Recorder.create(CPU)
    with rec.tape:
        fa, fb = rec.tape.from_tensor(a), rec.tape.from_tensor(b)
        fo = None if offs is None else rec.tape.from_tensor(offs)
        out = torch._grouped_mm(fa, fb, offs=fo)
        return tuple(out.shape), out.stride(), out.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(_cases()))
def test_grouped_mm_matches_the_real_kernel(case, dtype):
    a, b, offs = _cases()[case](dtype)
    real = torch._grouped_mm(a, b, offs=offs)
    assert _fake_grouped_mm(a, b, offs) == (tuple(real.shape), real.stride(), real.dtype)


@pytest.mark.parametrize("make", [
    lambda: (torch.randn(12, 8), torch.randn(4, 8, 6), torch.tensor(OFFS, dtype=torch.int32)),
    lambda: (torch.randn(12, 8).long(), torch.randn(4, 8, 16).long(),
             torch.tensor(OFFS, dtype=torch.int32)),
    lambda: (torch.randn(12, 8), torch.randn(4, 8, 16), torch.tensor(OFFS)),
    lambda: (torch.randn(12, 8), torch.randn(4, 8, 16), None),
], ids=["row stride not 16 bytes", "int64", "int64 offsets", "no offsets"])
def test_grouped_mm_refuses_what_the_real_kernel_refuses(make):
    a, b, offs = make()
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=offs)
    with pytest.raises(RuntimeError):
        _fake_grouped_mm(a, b, offs)


def test_fake_kernel_lives_only_as_long_as_the_capture():
    """After a capture torch's own fake kernel is back: fp32 is refused again, also for the inputs
    the capture ran (FakeTensorMode's process-wide cache kept nothing of the rule's)."""
    a, b, offs = _cases()["2d x 3d"](torch.float32)
    _fake_grouped_mm(a, b, offs)
    with FakeTensorMode() as mode:
        fa, fb, fo = mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="BFloat16|BF16"):  # torch 2.14 | 2.13 meta kernel
            torch._grouped_mm(fa, fb, offs=fo)


MIXTRAL = ("hf:MixtralConfig:num_hidden_layers=2,hidden_size=64,intermediate_size=128,"
           "num_attention_heads=4,num_key_value_heads=2,vocab_size=256,num_local_experts=4,"
           "num_experts_per_tok=2")


def test_mixtral_grouped_mm_experts_match_the_allocator():
    """transformers' default experts path (torch._grouped_mm, fp32 on CPU) profiles, and its peak
    is the allocator's."""
    pytest.importorskip("transformers")
    from tapescope.validate.real import run_real_steps

    from .conftest import profile_spec, tiny

    m = tiny(MIXTRAL, batch=2, seq=16)
    p = profile_spec(m)
    assert "aten._grouped_mm.default" in {op.name for op in p.ops}
    # the router's routing is assumed (balanced), and the report says no size depends on it
    (a,) = p.data_sizes.assumptions
    assert a.kind == "routing" and "balanced" in a.detail and not a.decided
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn)
    # what remains is the allocator seeing 8-12 byte Python-scalar temporaries
    assert abs(p.first_step_peak_bytes - real.peaks[1]) / real.peaks[1] < 1e-3
    assert abs(p.peak_bytes - real.peaks[2]) / real.peaks[2] < 1e-3


class _CTC(torch.nn.Module):
    """Frames -> characters, trained with the CTC loss (speech recognition heads)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 12)

    def forward(self, frames, targets, input_lengths, target_lengths):
        log_probs = self.proj(frames).log_softmax(-1).transpose(0, 1)   # (T, B, C)
        return torch.nn.functional.ctc_loss(log_probs, targets, input_lengths, target_lengths)


def _values_of(rec, *tensors):
    from tapescope.capture.data_values import DataValues, Sizes

    return DataValues(Sizes(), None)


def _fake_known(rec, x):
    """A fake tensor that keeps the values of `x` (the capture's value model), or `x` itself."""
    if not isinstance(x, torch.Tensor):
        return x
    f = rec.tape.from_tensor(x)
    rec.fidelity.values.give_input(f, x, "lengths")
    return f


def _ctc_inputs():
    targets = torch.randint(1, 12, (3, 7))
    return (torch.randn(3, 20, 16), targets, torch.tensor([20, 18, 20]), torch.tensor([7, 4, 6]))


def test_ctc_loss_matches_the_real_kernel():
    """torch has no fake kernel for the CTC loss with tensor lengths (its output is as long as
    the longest target): the rules', given the lengths' values, return the real outputs' shapes;
    the op sequence (the plain-tensor path reads the lengths on the host) and the step's peak (the
    backward's log_beta scratch included) are the real step's."""
    from tapescope.validate.harness import same_ops
    from tapescope.validate.real import run_real_steps

    frames, targets, il, tl = _ctc_inputs()
    log_probs = torch.randn(20, 3, 12).log_softmax(-1)
    for overload, lengths in ((torch.ops.aten._ctc_loss.Tensor, (il, tl)),
                              (torch.ops.aten._ctc_loss.default, (il.tolist(), tl.tolist()))):
        real = overload(log_probs, targets, *lengths)
        rec = Recorder.create(CPU)
        rec.fidelity.values = _values_of(rec, il, tl)
        with rec.tape:
            fake = overload(rec.tape.from_tensor(log_probs), rec.tape.from_tensor(targets),
                            *[_fake_known(rec, x) for x in lengths])
            assert [(tuple(f.shape), f.stride()) for f in fake] == \
                [(tuple(r.shape), r.stride()) for r in real]
    p = tapescope.profile(_CTC, frames, targets, il, tl)
    measured = run_real_steps(_CTC, (frames, targets, il, tl))
    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in measured.ops
                            if s == 2 and ph])
    assert ok, diff
    assert abs(p.first_step_peak_bytes - measured.peaks[1]) / measured.peaks[1] < 1e-3
    assert abs(p.peak_bytes - measured.peaks[2]) / measured.peaks[2] < 1e-3
    assert {a.where for a in p.data_sizes.assumptions if a.decided} == {"input2", "input3"}


def test_ctc_loss_without_the_lengths_values_says_what_is_missing():
    frames, targets, il, tl = _ctc_inputs()
    with pytest.raises(tapescope.TapescopeError, match="_ctc_loss"):
        tapescope.profile(_CTC, frames, tapescope.spec((3, 7), dtype=torch.int64),
                          tapescope.spec((3,), dtype=torch.int64),
                          tapescope.spec((3,), dtype=torch.int64))
