"""Libraries that ask "is this a FakeTensor?" and take another branch when it is.

A model library may check for fake tensors itself to avoid a data-dependent branch it assumes
nobody can answer while tracing. tapescope's fake tensors stand for a real eager step, which takes
the other branch; where the library's question changes the op sequence or the memory, the real
answer is given for the capture's own tensors, and the branch's data-dependent question goes to
tapescope like any other (values from data_values.py; otherwise a retry or a clear message).

A rule names the module, the attribute that answers, and how to answer for the capture
(`answer(original, tape) -> replacement`). Why a module attribute and not the TorchFunctionMode
that carries FUNCTION rules: these are plain Python functions of the library, which no torch
mode sees; they are looked up as module globals at each call, so replacing the attribute for
the capture's duration (and restoring it after, also on error) changes nothing elsewhere - a
fake tensor of any other FakeTensorMode still gets the library's own answer. A library not
imported by the time the capture starts is left alone (the model was built before it: a model
that uses the library has imported it).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

__all__ = ["LibraryBranch", "LIBRARY_BRANCHES", "library_branches"]


@dataclass(frozen=True)
class LibraryBranch:
    module: str
    attribute: str
    answer: Callable  # (original, tape) -> the attribute's value during the capture
    source: str
    test: str


def _not_fake_for_the_capture(original, tape):
    def is_fake_tensor(x) -> bool:
        if getattr(x, "fake_mode", None) is tape:
            return False  # a tensor of the eager step tapescope stands for
        return original(x)
    return is_fake_tensor


LIBRARY_BRANCHES = (
    # transformers' is_tracing(t) is true for a FakeTensor, and its masking code then skips the
    # checks of an eager step: find_packed_sequence_indices returns the packed-sequence mask
    # without asking whether position_ids hold one sequence (they do: arange), and a full 4-D
    # attention mask is built where the eager step passes none to SDPA (+2.35% on a 2-layer
    # Llama with use_cache=False, +1.40% with gradient checkpointing). Under torch.compile,
    # is_tracing stays true through is_torchdynamo_compiling(), as in the real compiled step.
    LibraryBranch("transformers.utils.import_utils", "is_fake_tensor",
                  _not_fake_for_the_capture,
                  source="transformers/utils/import_utils.py (is_tracing, is_fake_tensor); "
                         "masking_utils.py (find_packed_sequence_indices, _ignore_causal_mask_sdpa)",
                  test="tests/test_checkpoint.py::test_transformers_decoder_takes_the_eager_mask_path"),
)


@contextmanager
def library_branches(tape, branches=LIBRARY_BRANCHES):
    """The libraries' own fake-tensor questions answered as for the eager step, for this block."""
    done = []
    try:
        for b in branches:
            module = sys.modules.get(b.module)
            if module is None or not hasattr(module, b.attribute):
                continue
            original = getattr(module, b.attribute)
            setattr(module, b.attribute, b.answer(original, tape))
            done.append((module, b.attribute, original))
        yield
    finally:
        for module, attribute, original in reversed(done):
            setattr(module, attribute, original)
