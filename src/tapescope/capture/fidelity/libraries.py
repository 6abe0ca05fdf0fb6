"""Libraries that ask "is this a FakeTensor?" (or "is there a GPU?") and take another branch.

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

torch itself asks such a question: `torch.autocast("cuda")` switches itself off (with a warning)
when `torch.cuda.amp.common.amp_definitely_not_available()` says there is no GPU, and checks
`torch.cuda.is_bf16_supported()`, which asks the driver. A CUDA step traced on a machine without
a GPU stands for the step on the profiled GPU, where both answer yes: every autocast the step
opens (the step's own, torch.utils.checkpoint's around each recomputation, the model's) must
stay on, as it would there, or a recomputation runs in fp32 where its forward ran in bf16.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager
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


def _gpu_present_for_cuda(original, tape):
    """amp_definitely_not_available() for a CUDA trace: False, as on the profiled GPU."""
    if tape.fidelity.device.type != "cuda":
        return original
    return lambda: False


def _bf16_as_on_the_gpu(original, tape):
    """is_bf16_supported() for a CUDA trace, as the profiled GPU answers: sm80 and newer natively;
    older GPUs with emulation (torch makes a bf16 tensor there, which every CUDA GPU can)."""
    if tape.fidelity.device.type != "cuda":
        return original
    gpu = tape.fidelity.gpu
    native = gpu is None or gpu.compute_capability[0] >= 8

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return native or including_emulation
    return is_bf16_supported


def _fake_tensors_as_plain(original, tape):
    """The tensor types torch's foreach decisions accept, with FakeTensor among them: a
    FakeTensor stands for the plain tensor the real step has."""
    from ...torch_compat import FakeTensor

    return [*original, FakeTensor]


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
    # torch.autocast("cuda") asks whether a GPU exists and turns itself off where none does;
    # torch.utils.checkpoint opens one around each recomputation with the forward's autocast
    # state, so without this the recomputation of a bf16 forward ran in fp32 and torch raised
    # CheckpointError ("different metadata") - or, reentrant, silently recomputed in fp32.
    LibraryBranch("torch.cuda.amp.common", "amp_definitely_not_available", _gpu_present_for_cuda,
                  source="torch/amp/autocast_mode.py (autocast.__init__); "
                         "torch/utils/checkpoint.py (recompute_fn, CheckpointFunction.backward)",
                  test="tests/test_checkpoint.py::test_checkpoint_recomputes_under_cuda_autocast"),
    # An optimizer built without foreach= (by a user's step or setup, or an optimizer factory)
    # and clip_grad_norm_ / clip_grad_value_ choose foreach kernels only for plain tensors
    # (`type(t) in _foreach_supported_types`): on fake tensors they took the for-loop path the
    # real step does not take (a for-loop norm makes one 0-d norm per gradient; foreach one
    # list of them, alive together).
    LibraryBranch("torch.optim.optimizer", "_foreach_supported_types", _fake_tensors_as_plain,
                  source="torch/optim/optimizer.py (_default_to_fused_or_foreach)",
                  test="tests/test_user_step.py::test_clip_ema_scheduler_step_matches_a_real_run"),
    LibraryBranch("torch.utils._foreach_utils", "_foreach_supported_types",
                  _fake_tensors_as_plain,
                  source="torch/utils/_foreach_utils.py (_has_foreach_support: clip_grad_norm_)",
                  test="tests/test_user_step.py::test_clip_ema_scheduler_step_matches_a_real_run"),
    LibraryBranch("torch.cuda", "is_bf16_supported", _bf16_as_on_the_gpu,
                  source="torch/amp/autocast_mode.py (autocast.__init__: bf16 on CUDA)",
                  test="tests/test_checkpoint.py::test_checkpoint_recomputes_under_cuda_autocast"),
)


@contextmanager
def library_branches(tape, branches=LIBRARY_BRANCHES):
    """The libraries' own fake-tensor questions answered as for the eager step, for this block."""
    from ...torch_compat import patched

    with ExitStack() as stack:
        for b in branches:
            module = sys.modules.get(b.module)
            if module is None or not hasattr(module, b.attribute):
                continue
            original = getattr(module, b.attribute)
            stack.enter_context(patched(module, **{b.attribute: b.answer(original, tape)}))
        yield
