"""tapescope: see a whole PyTorch training step before it runs.

    import tapescope
    p = tapescope.profile(model, tapescope.spec((8, 1024), dtype="int64"))
    print(p.summary())

The public names are imported on first use, so that `tapescope --help` (and anything else that
only needs the command line) answers without importing torch.
"""

from .version import __version__

__all__ = ["profile", "Profile", "search", "plan_checkpointing", "Plan", "spec", "Spec",
           "CompileOptions", "Sizes", "TapescopeError", "calibrate", "Calibration", "__version__"]

_LAZY = {"profile": ".api", "search": ".layout_search", "Profile": ".api", "spec": ".capture.model", "Spec": ".capture.model",
         "TapescopeError": ".errors", "CompileOptions": ".options",
         "Sizes": ".values.sizes", "calibrate": ".calibration",
         "Calibration": ".devices.calibration",
         "plan_checkpointing": ".checkpointing", "Plan": ".checkpointing"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tapescope' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
