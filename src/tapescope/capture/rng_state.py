"""RNG states: real CPU tensors a step makes outside the dispatcher.

`torch.get_rng_state()` copies the CPU generator's state into a new uint8 tensor (5056 bytes for
the Mersenne Twister) without dispatching an op, so a fake mode never sees it, even inside a fake
step: the tensor is real, and a real step takes it from the CPU allocator. torch.utils.checkpoint
keeps one per checkpointed call (`preserve_rng_state=True`, the default) until that call is
recomputed and released, and `torch.random.fork_rng` makes one around each recomputation. Over
a few dozen checkpointed blocks that is a few hundred KiB of the CPU peak, so the tape is told
about each: a storage from its making to its death, like any other.

The CUDA generator's state (`torch.cuda.get_rng_state`) is a CPU tensor too and is not device
memory of a CUDA step; it is left alone.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..torch_compat import patched

__all__ = ["track_rng_states"]


@contextmanager
def track_rng_states(tape):
    """While the step runs, every `torch.get_rng_state()` is adopted by `tape` (torch's own
    callers - checkpoint, fork_rng - look it up on the torch module at call time)."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tape.adopt(state)
        return state

    with patched(torch, get_rng_state=get_rng_state):
        yield
