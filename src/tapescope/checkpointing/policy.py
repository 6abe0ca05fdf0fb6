"""What to recompute, as data, and how torch's own APIs apply it.

A checkpointing plan is a list of `UnitPolicy`: a module (its fqn) and a mode. The value type
lives below every stage (values/checkpointing.py, an option holds it) and `apply_policies` in
capture/checkpointing.py (capture applies it to the traced copy); both are importable from here.

What "full" and "selective" do is capture/checkpointing.py's docstring.

`apply_policies` wraps the modules of a model in place, the way `apply_activation_checkpointing`
does; `policy_code` writes the same as Python a user pastes into a training script.
"""

from __future__ import annotations

from ..capture.checkpointing import apply_policies, wrap
from ..values.checkpointing import FULL, MODES, SELECTIVE, UnitPolicy, resolve_op

__all__ = ["UnitPolicy", "MODES", "FULL", "SELECTIVE", "apply_policies", "policy_code",
           "resolve_op", "wrap"]


def _ranges(names: list[str]) -> list[str]:
    """Python expressions for a list of fqns, runs of `prefix.N` written as comprehensions."""
    out, i = [], 0
    while i < len(names):
        prefix, _, last = names[i].rpartition(".")
        if last.isdigit():
            j, n = i, int(last)
            while j + 1 < len(names) and names[j + 1] == f"{prefix}.{n + (j + 1 - i)}":
                j += 1
            if j - i >= 2:
                # the prefix as a quoted literal: a module name is data, never code
                out.append(f"*({prefix + '.'!r} + str(i) for i in range({n}, {n + j - i + 1}))")
                i = j + 1
                continue
        out.append(repr(names[i]))
        i += 1
    return out


def policy_code(policies, comment: str = "") -> str:
    """Python that applies `policies` to a model with torch's own APIs (paste it into a
    training script and call `apply_checkpointing(model)` before creating the optimizer)."""
    policies = [UnitPolicy.of(p) for p in policies]
    full = [p.module for p in policies if p.mode == FULL]
    selective = [p for p in policies if p.mode == SELECTIVE]
    save = sorted({op for p in selective for op in p.save_ops})
    lines = ["import functools", "",
             "import torch",
             "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (",
             "    CheckpointImpl, checkpoint_wrapper)",
             "from torch.utils.checkpoint import create_selective_checkpoint_contexts", ""]
    if comment:
        import textwrap

        lines += ["# " + line for line in textwrap.wrap(comment, 96)]
    lines.append("FULL = [" + ", ".join(_ranges(full)) + "]")
    lines.append("SELECTIVE = [" + ", ".join(_ranges([p.module for p in selective])) + "]")
    if any(tuple(sorted(p.save_ops)) != tuple(save) for p in selective):
        lines.append("SAVE = {" + ", ".join(
            f"{p.module!r}: [{', '.join('torch.ops.' + o for o in p.save_ops)}]"
            for p in selective) + "}")
        save_of = "SAVE[name]"
    else:
        lines.append("SAVE = [" + ", ".join("torch.ops." + o for o in save) + "]")
        save_of = "SAVE"
    lines += [
        "",
        "",
        "def apply_checkpointing(model):",
        '    """Checkpoint FULL whole and SELECTIVE keeping only the outputs of the SAVE ops."""',
        "    for name in FULL + SELECTIVE:",
        "        parent_name, _, child = name.rpartition('.')",
        "        parent = model.get_submodule(parent_name)",
        "        kwargs = {}",
        "        if name in SELECTIVE:",
        "            kwargs['context_fn'] = functools.partial(create_selective_checkpoint_contexts,",
        f"                                                     {save_of})",
        "        setattr(parent, child, checkpoint_wrapper(",
        "            parent.get_submodule(child), checkpoint_impl=CheckpointImpl.NO_REENTRANT,",
        "            **kwargs))",
        "    return model",
    ]
    return "\n".join(lines) + "\n"
