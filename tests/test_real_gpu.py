"""On a machine with a GPU: the GPU-less trace equals what the GPU runs, op for op, and the memory
and time predictions are compared with torch.cuda's. Skipped without a GPU (CI has none)."""

import pytest
import torch

from tapescope.validate.harness import validate

from .conftest import TINY_GPT2, TINY_LLAMA, tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("spec", [TINY_GPT2, TINY_LLAMA])
@pytest.mark.parametrize("amp", [None, "bf16"])
def test_gpu_less_trace_is_what_the_gpu_runs(spec, amp):
    m = tiny(spec, batch=4, seq=64)
    v = validate(m.build, *m.inputs, loss_fn=m.loss_fn, input_kwargs=m.input_kwargs,
                 device="cuda", amp=amp, name=m.name)
    assert v.ops_match, v.ops_diff
    assert abs(v.error("max_memory_allocated (steady)")) < 0.01
    assert abs(v.error("max_memory_reserved (steady)")) < 0.03
