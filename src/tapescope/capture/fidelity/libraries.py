"""Libraries that ask "is this a FakeTensor?" and take another branch when it is.

A model library may check for fake tensors itself to avoid a data-dependent branch it assumes
nobody can answer while tracing. tapescope's fake tensors stand for a real eager step, which takes
the other branch; where the library's question changes the op sequence or the memory, the real
answer is given for the capture's own tensors, and the branch's data-dependent question goes to
tapescope like any other (values from data_values.py), where tapescope can answer it.

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


def _eager_where_answerable(original, tape):
    """is_tracing(t) for the masking code: the eager step's False where tapescope can answer the
    question that follows (the tensor's values are known, data_values.py), the library's own
    answer otherwise. In the first attempt of a capture no values are tracked yet: False lets
    the question reach tapescope, which stops it as data-dependent, and the capture is retried
    with values (session.capture); there an input without values (an attention mask given as a
    shape) keeps the traced path, as before this rule."""
    def is_tracing(tensor=None) -> bool:
        if tensor is None or getattr(tensor, "fake_mode", None) is not tape or original(None):
            return original(tensor)  # not the capture's tensor, or truly compiling / tracing
        values = tape.fidelity.values
        if values is None or values.shape_env is None:
            return False
        return values.value(tensor) is None
    return is_tracing


LIBRARY_BRANCHES = (
    # transformers' masking code asks is_tracing(t), true for any FakeTensor, and then skips the
    # checks of an eager step: find_packed_sequence_indices returns the packed-sequence mask
    # without asking whether position_ids hold one sequence (an arange: they do), and a full
    # 4-D attention mask is built where the eager step gives SDPA none (+2.35% on a 2-layer
    # Llama with use_cache=False, +1.40% with gradient checkpointing, which forces it). Only
    # the masking module's name is answered: other checks (modeling_utils' padding warning reads
    # input_ids) keep the library's answer. Under torch.compile is_tracing stays true, as in the
    # real compiled step.
    LibraryBranch("transformers.masking_utils", "is_tracing", _eager_where_answerable,
                  source="transformers/masking_utils.py (find_packed_sequence_indices, "
                         "_ignore_causal_mask_sdpa); utils/import_utils.py (is_tracing)",
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
