"""Modules with parametrizations (weight_norm, spectral_norm, orthogonal) profile, with the
parametrization's forward inside the step as in a real run.

Truth: the CPU allocator running the same step (validate.real), and its op sequence.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations as P
from torch.nn.utils import parametrize

import tapescope
from tapescope.validate.harness import same_ops
from tapescope.validate.real import run_real_steps

INPUT = (tapescope.spec((8, 16)),)


class _Net(nn.Module):
    def __init__(self, wrap):
        super().__init__()
        self.a, self.b = wrap(nn.Linear(16, 32)), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).pow(2).sum()


WRAPS = {
    "weight_norm": lambda m: P.weight_norm(m),
    "spectral_norm": lambda m: P.spectral_norm(m),
    # 32x16, not square: householder. Its backward formula takes the tensor-subclass branch of
    # FunctionsManual.cpp's householder_product_backward (one `cat` where a plain tensor fills a
    # zeros_like column by column with select + copy_): not modelled, a known miss.
    "orthogonal (householder)": pytest.param(
        lambda m: P.orthogonal(m), marks=pytest.mark.xfail(
            reason="householder_product_backward's tensor-subclass branch", strict=True,
            raises=AssertionError)),
    "weight_norm, deprecated hook": lambda m: torch.nn.utils.weight_norm(m),
}


def _rel(a, b):
    return abs(a - b) / b


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("wrap", list(WRAPS.values()), ids=list(WRAPS))
def test_parametrized_module_matches_the_allocator(wrap):
    torch.manual_seed(0)
    model = lambda: _Net(wrap)  # noqa: E731 - built on meta by tapescope, on the CPU for real
    if wrap is WRAPS["orthogonal (householder)"].values[0]:
        # its init reads values (an orthogonality check), so it cannot be built on meta: pass
        # the module (the deprecated weight_norm's cannot be: it refuses deepcopy)
        model = _Net(wrap)
    p = tapescope.profile(model, *INPUT)
    real = run_real_steps(model, INPUT)
    # what remains is the allocator seeing 8-12 byte Python-scalar temporaries
    assert _rel(p.first_step_peak_bytes, real.peaks[1]) < 1e-3
    assert _rel(p.peak_bytes, real.peaks[2]) < 1e-3
    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops
                            if s == 2 and ph])
    assert ok, diff


def test_parametrization_runs_inside_the_step_and_the_model_is_untouched():
    model = _Net(P.weight_norm)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = tapescope.profile(model, *INPUT)
    forward = [op.name for op in p.ops if op.phase == "forward"]
    assert forward[0] == "aten._weight_norm_interface.default"  # reading .weight runs it
    assert parametrize.is_parametrized(model.a, "weight")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
