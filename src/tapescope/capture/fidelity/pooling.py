"""CPU pooling kernels: the copies they make to run in one memory format.

Each CPU pooling kernel (aten/src/ATen/native/cpu/MaxPoolKernel.cpp, AvgPoolKernel.cpp,
AdaptiveMaxPoolKernel.cpp, AdaptiveAvgPoolKernel.cpp) switches on one tensor's
`suggest_memory_format()` (contiguous or channels-last) and then takes `.contiguous(format)` of
every tensor it reads or writes, writing a copied output back at the end. A gradient that arrives
in the other format (an expanded gradient, whose stride-0 channels read as contiguous; a
contiguous gradient of a channels-last activation) is copied, and so are the indices and the
freshly allocated grad_input, which follows the input's format. A fake kernel copies nothing.
"""

from __future__ import annotations

import torch

from ...torch_compat import suggest_memory_format
from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten
_SOURCE = "aten/src/ATen/native/cpu/{} ({}: switch on {}.suggest_memory_format(), then " \
          ".contiguous(format) of each operand and of the output)"
_TEST = "tests/test_kernel_workspace.py::test_pooling_copies_operands_into_one_format"

# op -> (kernel file, kernel function, the argument whose format the kernel switches on (an
# argument index, or "out"), the arguments it reads in that format, in the kernel's order)
_KERNELS = {
    aten.max_pool2d_with_indices_backward.default:
        ("MaxPoolKernel.cpp", "max_pool2d_backward_kernel_impl", 0, (0, 7)),
    aten.max_pool3d_with_indices_backward.default:
        ("MaxPoolKernel.cpp", "max_pool3d_backward_kernel_impl", 0, (0, 7)),
    aten.avg_pool2d_backward.default:
        ("AvgPoolKernel.cpp", "avg_pool2d_backward_kernel_impl", 0, (0,)),
    aten.avg_pool3d_backward.default:
        ("AvgPoolKernel.cpp", "avg_pool3d_backward_kernel_impl", 0, (0,)),
    aten.adaptive_max_pool2d_backward.default:
        ("AdaptiveMaxPoolKernel.cpp", "adaptive_max_pool2d_backward_kernel_impl", "out", (0, 2)),
    aten._adaptive_avg_pool2d_backward.default:
        ("AdaptiveAvgPoolKernel.cpp", "adaptive_avg_pool2d_backward_kernel_impl", 0, (0,)),
    aten.max_pool2d_with_indices.default:
        ("MaxPoolKernel.cpp", "max_pool2d_kernel_impl", 0, (0,)),
    aten.max_pool3d_with_indices.default:
        ("MaxPoolKernel.cpp", "max_pool3d_kernel_impl", 0, (0,)),
    aten.avg_pool2d.default: ("AvgPoolKernel.cpp", "avg_pool2d_kernel_impl", 0, (0,)),
    aten.avg_pool3d.default: ("AvgPoolKernel.cpp", "avg_pool3d_kernel_impl", 0, (0,)),
    aten.adaptive_max_pool2d.default:
        ("AdaptiveMaxPoolKernel.cpp", "adaptive_max_pool2d_kernel_impl", 0, (0,)),
    aten._adaptive_avg_pool2d.default:
        ("AdaptiveAvgPoolKernel.cpp", "adaptive_avg_pool2d_kernel_impl", 0, (0,)),
}


def _copies(ctx, func, args, kwargs, out):
    _, _, switch, reads = _KERNELS[func]
    outputs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
               if isinstance(o, torch.Tensor)]
    fmt = suggest_memory_format(outputs[0] if switch == "out" else args[switch])
    sizes = [t.numel() * t.dtype.itemsize for t in (*(args[i] for i in reads), *outputs)
             if not t.is_contiguous(memory_format=fmt)]
    return sizes or None


for _op, (_file, _kernel, _switch, _) in _KERNELS.items():
    RULES.register(WORKSPACE, _op, devices={"cpu"}, name=f"{_op.__name__}_format_copies",
                   source=_SOURCE.format(_file, _kernel, "grad_input" if _switch == "out" else
                                         ("grad_output" if "backward" in _kernel else "input")),
                   test=_TEST)(_copies)
