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
]


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


def _where(exc) -> str:
    module = getattr(exc, "tapescope_module", None)
    frame = getattr(exc, "tapescope_frame", None)
    phase = getattr(exc, "tapescope_phase", None)
    parts = []
    if module is not None:
        parts.append(f"in module '{module or '(root)'}'")
    if phase:
        parts.append(f"during {phase}")
    if frame is not None:
        parts.append(f"at {frame.filename}:{frame.lineno} ({frame.function})")
    return " ".join(parts)


def from_trace_failure(exc: BaseException) -> TapescopeError:
    """Turn an exception raised while tracing the step into a message that says what to do."""
    from .torch_compat import (DataDependentOutputException, DynamicOutputShapeException,
                               GuardOnDataDependentSymNode, UnsupportedOperatorException)

    op = getattr(exc, "tapescope_op", None) or getattr(exc, "func", None)
    where = _where(exc)
    if isinstance(exc, (DataDependentOutputException, GuardOnDataDependentSymNode)):
        return DataDependentError(
            f"{op} {where} reads a tensor's value (like .item() or a Python `if` on a tensor); "
            "fake tensors have shapes but no values, so the step cannot be traced past it. "
            "Fix: compute the value from shapes or Python numbers, or move the check out of "
            "forward/backward.")
    if isinstance(exc, DynamicOutputShapeException):
        return DataDependentError(
            f"{op} {where} returns a tensor whose shape depends on tensor values (nonzero, "
            "boolean-mask indexing, unique); fake tensors have no values to decide it. "
            "Fix: use a fixed-shape form (torch.where, masked_fill, multiplying by the mask) in "
            "the model, or profile the rest of the model without that module.")
    if isinstance(exc, UnsupportedOperatorException):
        return UnsupportedOpError(
            f"{op} {where} has no meta/fake implementation, so it cannot run without real data. "
            f"Fix: register one with torch.library.register_fake('{_op_name(op)}') (it only has to "
            "return an empty tensor of the right shape), or replace the op.")
    text = str(exc)
    if op is not None and ("no fake impl" in text or "'Meta' backend" in text
                           or isinstance(exc, NotImplementedError)):
        return UnsupportedOpError(
            f"{op} {where} cannot run on fake tensors: {exc}. Fix: register a fake implementation "
            f"with torch.library.register_fake('{_op_name(op)}').")
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelError(f"the model raised {type(exc).__name__} {where}: {msg}".replace("  ", " "))


def _op_name(op) -> str:
    name = getattr(op, "_schema", None)
    return name.name if name is not None else str(op)
