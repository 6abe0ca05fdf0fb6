"""Which module is running: a stack of fully qualified names during forward.

Backward ops are attributed through seq_nr to the forward op that recorded their autograd node, which
is exact; hook-based backward tracking (ModTracker's multi-grad hooks) is not needed, and it would add
a hook per module output to the graph we are measuring. So this tracks forward only, with the two
global module hooks, removed on exit.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["track_modules", "module_names"]


def module_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> fqn, the root being "" (a module reachable twice keeps its first name)."""
    names: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    return names


@contextmanager
def track_modules(stack: list[str], names: dict[int, str]):
    """Keep `stack` equal to the fqns of the modules currently in forward, innermost last.

    Modules outside the model (a loss module, say) appear under their class name.
    """

    # Where dynamo traces a module call (torch.compile), the hooks are traced with it and have
    # nothing to do: the ops run later inside a compiled graph, which has no module stack. Traced,
    # their list mutation would be a side effect dynamo replays after the graph, and one it
    # refuses inside a higher-order op (a checkpointed region: a graph break real torch does not
    # have). `is_compiling()` is a constant to dynamo, so the branch is not traced at all.
    def pre(mod, _args):
        if torch.compiler.is_compiling():
            return
        name = names.get(id(mod))
        stack.append(type(mod).__name__ if name is None else name)

    def post(mod, _args, _out):
        # is_compiling() first: dynamo would guard on the length of `stack` if it read it, and
        # recompile a block whose call found another length (a second layer, a later profile)
        if torch.compiler.is_compiling() or not stack:
            return
        name = stack.pop()
        # always_call: this also runs while an error leaves the module's forward; the
        # innermost module it leaves is where the error happened
        e = sys.exc_info()[1]
        if e is not None and getattr(e, "tapescope_module", None) is None:
            try:
                e.tapescope_module = name
            except AttributeError:  # exception types that refuse attributes
                pass

    h1 = register_module_forward_pre_hook(pre)
    h2 = register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()
