"""tapescope: see a whole PyTorch training step before it runs.

    import tapescope
    p = tapescope.profile(model, tapescope.spec((8, 1024), dtype="int64"))
    print(p.summary())
"""

__version__ = "0.1.0"

from .api import Profile, profile
from .checkpointing import Plan, plan_checkpointing
from .capture.model import Spec, spec
from .errors import TapescopeError
from .options import CompileOptions

__all__ = ["profile", "Profile", "plan_checkpointing", "Plan", "spec", "Spec", "CompileOptions",
           "TapescopeError", "__version__"]
