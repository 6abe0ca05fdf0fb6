"""Library ops whose CPU kernel is the library's own Python code: run that code on the fake
tensors, so every torch op inside it is traced.

A library can register a custom op (`torch.library.define`) with a fake kernel that only makes
the outputs, and a CPU kernel written in Python with torch ops. bitsandbytes' 8-bit optimizers do
that: `bitsandbytes::optimizer_update_8bit_blockwise` on CPU dequantizes each 8-bit state into an
fp32 copy, casts the gradient and the parameter to fp32, updates, and quantizes back
(bitsandbytes/backends/cpu/ops.py) - several parameter-sized fp32 temporaries that the fake
kernel (which allocates nothing) never shows: a real step of AdamW8bit peaked at 8,173,648 B where
the fake kernel's trace said 3,005,700. The dispatcher keeps the Python kernel inside C++, so the
rule names it by module and attribute (`_KERNELS`); the FUNCTION rule then runs it for the
user's call, and its ops (nested library ops too, through their fake kernels) are recorded.

Targets are LibraryOps: resolved per capture, only if the library was imported (tapescope never
imports it).
"""

from __future__ import annotations

import importlib

from .registry import FUNCTION, RULES, LibraryOp

__all__ = []

# op -> (module, function): the Python CPU kernel the library registers for it
_KERNELS = {
    "bitsandbytes::optimizer_update_8bit_blockwise":
        ("bitsandbytes.backends.cpu.ops", "_optimizer_update_8bit_blockwise_cpu"),
    "bitsandbytes::optimizer_update_32bit":
        ("bitsandbytes.backends.cpu.ops", "_optimizer_update_32bit_cpu"),
}


@RULES.register(FUNCTION, *(LibraryOp(name) for name in _KERNELS), devices={"cpu"},
                source="bitsandbytes/backends/cpu/ops.py (register_kernel(..., 'cpu'))",
                test="tests/test_library_kernels.py::test_bitsandbytes_optimizer_on_cpu")
def library_python_kernel(ctx, func, args, kwargs):
    """Run the library's CPU kernel (Python, torch ops) in place of the op's fake kernel."""
    name = getattr(func, "_qualified_op_name", None) or func.name()  # a packet, an overload
    module, attribute = _KERNELS[name]
    kernel = getattr(importlib.import_module(module), attribute, None)
    if kernel is None:  # another version of the library: its op, as it is
        return func(*args, **kwargs)
    return kernel(*args, **kwargs)
