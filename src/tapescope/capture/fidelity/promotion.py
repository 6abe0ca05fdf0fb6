"""CPU binary ops on tensors of different dtypes: the temporaries TensorIterator makes.

A binary op (`add`, `sub`, `mul`, `div`) computes in the operands' common dtype. On CPU,
TensorIteratorBase::compute_types makes a temporary of the common dtype for each input tensor of
another dtype (`op.tensor().to(common_dtype)`: `h * mask` of float activations and a bool mask
copies the whole mask as float), and for an output of another dtype (`bf16.add_(fp32)` computes
into a float32 temporary and casts back at the end); each lives until the op returns. A fake
kernel makes none. 0-dim operands (wrapped Python numbers, CPU scalars) are left out: their 4-8
bytes are the Python-scalar residual (docs/validation.md).
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten

_OUT_OF_PLACE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
_IN_PLACE = (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor)


@RULES.register(WORKSPACE, *_OUT_OF_PLACE, *_IN_PLACE, devices={"cpu"},
                source="aten/src/ATen/TensorIterator.cpp (TensorIteratorBase::compute_types: "
                       "promote_inputs_to_common_dtype, cast_common_dtype_to_outputs on CPU)",
                test="tests/test_kernel_workspace.py::test_mixed_dtype_operands_are_copied")
def promoted_operand_copies(ctx, func, args, kwargs, out):
    """Bytes of the common-dtype temporaries of a mixed-dtype binary op's tensor operands."""
    a, b = args[0], args[1]
    if not isinstance(b, torch.Tensor) or a.dtype == b.dtype:
        return None
    common = torch.result_type(a, b)
    if func in _OUT_OF_PLACE and func is aten.div.Tensor and not common.is_floating_point:
        common = torch.get_default_dtype()  # true division of integers
    copies = []
    if func in _IN_PLACE and a.dtype != common and a.dim() > 0:
        copies.append(a.numel() * common.itemsize)  # the output's temporary
    for t in (a, b):
        if t.dtype != common and t.dim() > 0:
            copies.append(t.numel() * common.itemsize)
    return copies or None
