"""What the dispatcher does with an op on a device, read from the dispatcher itself.

`torch._C._dispatch_dump_table(op)` prints the computed dispatch table: for every dispatch key, the
kernel that runs and where it was registered ("[kernel]", "[autograd kernel]", "[math kernel]" for a
CompositeImplicitAutograd decomposition, ...). This is the ground truth for questions like "why does
rms_norm decompose on meta but not on CUDA".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache


from ..torch_compat import dispatch_dump_table

__all__ = ["Kernel", "dispatch_table", "decomposes_above_autograd"]

_LINE = re.compile(r"^(?P<key>[\w\[\]]+): (?:registered at )?(?P<where>.*?)\s*\[(?P<kind>[^\]]+)\]\s*$")


@dataclass(frozen=True)
class Kernel:
    key: str       # dispatch key, e.g. "AutogradCUDA"
    kind: str      # "kernel", "autograd kernel", "math kernel", "default backend kernel", ...
    where: str     # registration site, a C++ file:line or a Python file:line


@lru_cache(maxsize=None)  # the dispatch table is fixed once torch is imported
def dispatch_table(op: str) -> dict[str, Kernel]:
    """Computed dispatch table of an op ('aten::rms_norm', 'aten::add.Tensor'), by key."""
    try:
        text = dispatch_dump_table(op)
    except RuntimeError:
        return {}
    table = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            table[m["key"]] = Kernel(m["key"], m["kind"], m["where"])
    return table


def _autograd_key(device_type: str) -> str:
    return {"cpu": "AutogradCPU", "cuda": "AutogradCUDA", "meta": "AutogradMeta"}.get(
        device_type, "AutogradOther")


def decomposes_above_autograd(op: str, device_type: str) -> bool:
    """True if on this device the op runs its CompositeImplicitAutograd decomposition: autograd
    records the ops it calls, and a dispatch mode never sees the op itself."""
    table = dispatch_table(op)
    k = table.get(_autograd_key(device_type)) or table.get("AutogradOther")
    return k is not None and k.kind == "math kernel"
