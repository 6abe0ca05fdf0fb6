"""Library ops whose CPU kernel is Python (capture/fidelity/library_kernels.py), against the CPU
allocator: bitsandbytes' 8-bit AdamW, which builds its quantization maps with
`linspace(...).tolist()` while the optimizer is constructed (a value read: small factories keep
their values there) and updates through `bitsandbytes::optimizer_update_8bit_blockwise`, whose
CPU kernel dequantizes each state to fp32.

Truth: the same step run for real under torch.profiler (validate.real), its allocator peaks.
"""

import pytest
import torch

import tapescope
from tapescope.validate.real import run_real_steps


@pytest.mark.parametrize("name", ["AdamW8bit", "Adam32bit"])
def test_bitsandbytes_optimizer_on_cpu(name):
    bnb = pytest.importorskip("bitsandbytes")
    build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(),  # noqa: E731
                                        torch.nn.Linear(4096, 8))
    optimizer = lambda params: getattr(bnb.optim, name)(params)  # noqa: E731
    x = tapescope.spec((16, 64))
    p = tapescope.profile(build, x, optimizer=optimizer)
    real = run_real_steps(build, (x,), optimizer=optimizer)
    # what remains is the allocator's 8-12 byte Python-scalar temporaries (README, Accuracy)
    for predicted, measured in ((p.first_step_peak_bytes, real.peaks[1]),
                                (p.peak_bytes, real.peaks[2])):
        assert 0 <= measured - predicted <= 12, (predicted, measured)
