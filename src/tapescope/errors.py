"""Errors a user can act on.

Every failure a user can cause (a bad spec, a model that reads tensor values, an op fake tensors
cannot run, a shape mismatch, a torch build without CUDA) becomes a TapescopeError whose message
names the op, the module and the source line, and says what to do. The CLI prints the message and
exits 1, without an internal traceback.
"""

from __future__ import annotations

__all__ = [
    "TapescopeError",
    "SpecError",
    "ModelBuildError",
    "DeviceError",
    "DataDependentError",
    "UnsupportedOpError",
    "ModelError",
    "from_trace_failure",
    "passes_user_calls",
    "user_error",
    "raised_by_tapescope",
    "source_dirs",
    "SourceDirs",
    "user_frame_of",
]

import functools
import os
from dataclasses import dataclass


class TapescopeError(Exception):
    """A failure with a message meant for the user."""


class SpecError(TapescopeError):
    """The model spec or input description could not be understood."""


class ModelBuildError(TapescopeError):
    """The model could not be built without allocating it."""


class DeviceError(TapescopeError):
    """The requested device cannot be traced with this torch build."""


class DataDependentError(TapescopeError):
    """The model needs tensor values (`.item()`, `nonzero`, boolean masks), which fake tensors lack."""


class UnsupportedOpError(TapescopeError):
    """An op has no fake (meta) implementation."""


class ModelError(TapescopeError):
    """The model's own code raised (a shape mismatch, say)."""


# Code of tapescope functions that only pass the user's call on to torch (the function rules, the
# dispatch front): an error raised by the torch call they make is the user's, not tapescope's.
# Filled at import by `passes_user_calls`, never changed after.
_PASS_THROUGH_CODE: set = set()


def user_error(exc: BaseException) -> BaseException:
    """Mark an error tapescope raises on PyTorch's behalf (what the real engine or kernel would
    raise for the user's step) as the user's, not a bug of tapescope's."""
    exc.tapescope_user = True
    return exc


def passes_user_calls(fn):
    """Mark `fn` as passing the user's own call on to torch (see raised_by_tapescope)."""
    _PASS_THROUGH_CODE.add(fn.__code__)
    return fn


@dataclass(frozen=True)
class SourceDirs:
    """Where code lives, each folder ending in a separator: the one place the rules of "which
    frame is the user's" take their folders from. Two rules read it, for two questions:
    `user_frame_of` (an error's line: any code but torch's, tapescope's and the standard
    library's; the zoo's models count as the user's) and the Tape's line of an op
    (capture/tape.py, cached per code object: torch.optim's update lines and tapescope's own
    models and losses are shown; the capture machinery, api.py, torch_compat.py and distributed/,
    which runs the user's parallelize, are not)."""

    torch: str
    stdlib: str
    package: str  # tapescope
    zoo: str
    capture: str
    distributed: str

    @property
    def torch_optim(self) -> str:
        return self.torch + "optim" + os.sep

    def in_package(self, *names: str) -> tuple[str, ...]:
        """Files or folders of tapescope by name ("api.py", "capture/"), as paths."""
        return tuple(self.package + name.replace("/", os.sep) for name in names)


@functools.cache
def source_dirs() -> SourceDirs:
    """This install's folders (fixed for the process: the same answer every call)."""
    import sysconfig

    import torch

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return SourceDirs(torch=os.path.dirname(torch.__file__) + os.sep,
                      stdlib=sysconfig.get_paths()["stdlib"] + os.sep, package=package,
                      zoo=os.path.join(package, "zoo") + os.sep,
                      capture=os.path.join(package, "capture") + os.sep,
                      distributed=os.path.join(package, "distributed") + os.sep)


def raised_by_tapescope(e: BaseException) -> bool:
    """True if tapescope's own code raised `e` (a bug to report with its traceback): the innermost
    Python frame is tapescope's (not the zoo's) and it did not just pass the user's call on to
    torch, and no op of the user's step raised it."""
    if getattr(e, "tapescope_op", None) is not None or getattr(e, "tapescope_user", False):
        return False
    if isinstance(getattr(e, "inner_exception", None), TapescopeError):
        return False  # a refusal tapescope raised inside a compile backend, which dynamo wraps
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code
        tb = tb.tb_next
    if last is None or last in _PASS_THROUGH_CODE:
        return False
    dirs = source_dirs()
    return last.co_filename.startswith(dirs.package) and not last.co_filename.startswith(dirs.zoo)


def user_frame_of(exc):
    """The innermost frame of the user's code in the exception's traceback (not torch's, not
    tapescope's, not the standard library's; the zoo's models are the user's), as 'file:line
    (function)'. By the installed folders, not by a folder's name: a user's checkout under a
    folder called tapescope is the user's."""
    dirs = source_dirs()
    skip, zoo = (dirs.torch, dirs.package, dirs.stdlib), dirs.zoo
    tb, found = exc.__traceback__, None
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        installed = "site-packages" in f or "dist-packages" in f
        if not f.startswith(skip) or f.startswith(zoo) or (installed and not f.startswith(skip[:2])):
            found = f"{f}:{tb.tb_lineno} ({tb.tb_frame.f_code.co_name})"
        tb = tb.tb_next
    return found


def _where(exc) -> str:
    module = getattr(exc, "tapescope_module", None)
    frame = getattr(exc, "tapescope_frame", None)
    phase = getattr(exc, "tapescope_phase", None)
    parts = []
    if module is not None:
        parts.append(f"in module '{module or '(root)'}'")
    if phase == "other":  # a user's step, outside forward, backward and optimizer steps
        parts.append("in the step's own code")
    elif phase:
        parts.append(f"during {phase}")
    if frame is not None:
        parts.append(f"at {frame.filename}:{frame.lineno} ({frame.function})")
    else:
        line = user_frame_of(exc)
        if line is not None:
            parts.append(f"at {line}")
    return " ".join(parts)


def from_trace_failure(exc: BaseException) -> TapescopeError:
    """Turn an exception raised while tracing the step into a message that says what to do."""
    from .torch_compat import (DataDependentOutputException, DynamicOutputShapeException,
                               GuardOnDataDependentSymNode, UnsupportedOperatorException)

    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, TapescopeError):  # tapescope's refusal, inside a compile backend
        return inner
    op = getattr(exc, "tapescope_op", None) or getattr(exc, "func", None)
    where = _where(exc)
    if isinstance(exc, UnknownValueRead) and exc.kind == "random":
        return DataDependentError(
            f"{op} {where} reads a random number the step drew at {exc.source} and decides on it "
            "(a random resize, a random permutation), so the step's memory depends on the draw, "
            "which fake tensors do not make (a small torch.rand / randn / bernoulli / randint "
            "draw is taken at its median; this one is not). Fix: switch that randomness off "
            "while profiling (one fixed size), or profile each outcome with a model that takes it.")
    if isinstance(exc, UnknownValueRead):
        return DataDependentError(
            f"{op} {where} reads the value of {exc.source}, which is on the meta device and "
            "has no values (the model was built on meta, or its build computed the buffer in a "
            "way tapescope could not follow), while the real model computes sizes from it. "
            "Fix: build the model on the CPU and pass the nn.Module to profile() (tapescope "
            "copies it onto fake tensors and never changes it; small integer buffers keep "
            "their values).")
    if isinstance(exc, (DataDependentOutputException, GuardOnDataDependentSymNode)):
        return DataDependentError(
            f"{op} {where} reads a tensor's value (like .item() or a Python `if` on a tensor); "
            "fake tensors have shapes but no values, so the step cannot be traced past it. "
            "Fix: compute the value from shapes or Python numbers, or move the check out of "
            "forward/backward" + ("; a step function that logs `loss.item()`: leave the "
                                  "logging out while profiling"
                                  if getattr(exc, "tapescope_phase", None) == "other" else "")
            + ". (Values a mixture-of-experts router decides are assumed from its "
            "routing, sizes='balanced' by default, when the router selects with torch.topk, "
            "argmax or max(dim).)")
    if isinstance(exc, DynamicOutputShapeException):
        return DataDependentError(
            f"{op} {where} returns a tensor whose shape depends on tensor values (nonzero, "
            "boolean-mask indexing, unique); fake tensors have no values to decide it. "
            "Fix: give the fraction of elements the mask keeps, sizes={'mask': F} (CLI: "
            "--mask-fraction F); or use a fixed-shape form (torch.where, masked_fill, multiplying "
            "by the mask).")
    if isinstance(exc, UnsupportedOperatorException):
        return UnsupportedOpError(
            f"{op} {where} has no meta/fake implementation, so it cannot run without real data. "
            f"Fix: register one with torch.library.register_fake('{_op_name(op)}') (it only has to "
            "return an empty tensor of the right shape), or replace the op.")
    text = str(exc)
    if any(m in text for m in _VALUE_READS):
        return DataDependentError(
            f"the model reads a tensor's values {where} ({text.strip().splitlines()[0]}); fake "
            "tensors have shapes but no values. Fix: keep the computation in torch ops, or move "
            "it out of forward/backward (a metric computed after the step, say).")
    if op is not None and ("no fake impl" in text or "'Meta' backend" in text
                           or isinstance(exc, NotImplementedError)):
        return UnsupportedOpError(
            f"{op} {where} cannot run on fake tensors: {exc}. Fix: register a fake implementation "
            f"with torch.library.register_fake('{_op_name(op)}').")
    msg = _all_lines(exc)
    who = "the step" if getattr(exc, "tapescope_phase", None) == "other" else "the model"
    return ModelError(" ".join(filter(None, (f"{who} raised {type(exc).__name__}", where)))
                      + f": {msg}")


def _all_lines(exc: BaseException) -> str:
    """Every line of what `exc` says, joined: torch's wrappers put the cause after a first line
    of their own ("Failed to run stage backward:"), so the first alone says nothing; for an error
    torch.compile wraps, the wrapped error's, named by its type."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):
        return f"{type(inner).__name__}: {_all_lines(inner)}"
    text = str(exc)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or \
        type(exc).__name__


# What torch says when a tensor subclass (a fake tensor) is asked for its data.
_VALUE_READS = (".numpy() is not supported for tensor subclasses",
                "Cannot access data pointer of Tensor", "doesn't support data access")


def _op_name(op) -> str:
    name = getattr(op, "_schema", None)
    return name.name if name is not None else str(op)


class UnknownValueRead(RuntimeError):
    """The step reads a value no one knows: a random draw no rule gives a value, a meta buffer."""

    def __init__(self, func, unknown):
        """`unknown`: capture.data_values.Unknown (its kind and source)."""
        what = "a random number drawn at" if unknown.kind == "random" else "the value of"
        super().__init__(f"{func} reads {what} {unknown.source}")
        self.func, self.kind, self.source = func, unknown.kind, unknown.source
        self.tapescope_user = True  # the step's read, not a bug of the capture
