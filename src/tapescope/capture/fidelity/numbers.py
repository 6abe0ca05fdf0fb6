"""CPU elementwise ops: the copies TensorIterator makes of operands of another dtype, and the 0-d
tensors Python numbers become.

A Python number given where an op takes a Tensor (`x / 2.0`, `step_t += 1`: the argument parser's
numbers-as-tensors, `scalar_to_tensor`) becomes a 0-d "wrapped number" tensor, allocated by the
CPU allocator before the op and freed after it: 8 bytes for an int (int64) or a float (double), 1
for a bool, 16 for a complex. The `.Scalar` overloads of the binary ops (`mul.Scalar`, `gt.Scalar`,
`rsub.Scalar`, ...: what C++ autograd formulas and `x > 0.5` call) make the same tensor inside
their kernel (`wrapped_scalar_tensor(other)`, BinaryOps.cpp and friends). A fake tensor's
dispatch sees the plain number in both cases and allocates nothing.

On CPU, TensorIterator then promotes every operand to the op's common dtype
(`TensorIteratorBase::compute_types`, `promote_inputs_to_common_dtype_`: "if (common_device ==
kCPU) ... op.tensor().to(common_dtype_)"): an operand of another dtype is copied whole, the
wrapped number included (4 bytes for a float32 op on a double), and an in-place op whose tensor
has another dtype than the common one also writes into a temporary of the common dtype
(`cast_common_dtype_to_outputs_`), copied back at the end. So `h * mask` of a float activation
and a bool mask copies the mask as floats, and `bf16.add_(fp32)` makes two float32 copies the size
of the tensor. On CUDA neither happens (the kernels cast as they load, and a wrapped number stays
a CPU scalar read by value): these rules are CPU's.

Measured with torch.profiler's memory events (tests/test_kernel_workspace.py): `x / 2.0` on float32
allocates 8 (the double), 4 (its float copy), the output, then frees 4 and 8; on float64 only the
8; `pow(x, 2)`, `clamp`, `masked_fill`, `fill_`, `lerp_` and the activations take their Scalar by
value and allocate nothing. The wrapped numbers are the 12-16 bytes the CPU peaks had missed at an
optimizer's `exp_avg_sq.sqrt() / bias_correction2_sqrt` (docs/validation.md).
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = ["promotion_temporaries", "TENSOR_OVERLOADS", "SCALAR_OVERLOADS", "OPERANDS"]

aten = torch.ops.aten

# the dtype scalar_to_tensor gives each kind of Python number (bool before int: a bool is an int)
_WRAPPED = ((bool, torch.bool), ((int, torch.SymInt), torch.int64),
            ((float, torch.SymFloat), torch.float64), (complex, torch.complex128))


def _overloads(names: str, overload: str) -> tuple:
    return tuple(getattr(getattr(aten, n), overload) for n in names.split())


# Tensor overloads of binary ops: a Python number reaches them as `other` (wrapped by the parser)
TENSOR_OVERLOADS = (_overloads("add add_ sub sub_ mul mul_ div div_ rsub remainder remainder_ "
                               "fmod fmod_ floor_divide_ true_divide true_divide_ eq eq_ ne ne_ "
                               "lt lt_ le le_ gt gt_ ge ge_", "Tensor")
                    + _overloads("div div_", "Tensor_mode")
                    + _overloads("floor_divide maximum minimum", "default"))
# Scalar overloads whose CPU kernel wraps `other` itself (each measured: the tests below)
SCALAR_OVERLOADS = _overloads("add add_ sub sub_ mul mul_ div div_ rsub remainder remainder_ "
                              "fmod fmod_ eq eq_ ne ne_ lt lt_ le le_ gt gt_ ge ge_ floor_divide "
                              "floor_divide_ copysign copysign_", "Scalar")
# op -> the positions of its operands TensorIterator promotes to one common dtype
OPERANDS = {**{op: (0, 1) for op in TENSOR_OVERLOADS + SCALAR_OVERLOADS},
            aten.where.self: (1, 2),
            **{op: (0, 1, 2) for op in _overloads("addcmul addcmul_ addcdiv addcdiv_", "default")}}
_TRUE_DIVISIONS = frozenset((aten.div.Tensor, aten.div_.Tensor, aten.div.Scalar,
                             aten.div_.Scalar, aten.true_divide.Tensor, aten.true_divide_.Tensor,
                             aten.addcdiv.default, aten.addcdiv_.default))
_COMPARISONS = frozenset(_overloads("eq eq_ ne ne_ lt lt_ le le_ gt gt_ ge ge_", "Tensor")
                         + _overloads("eq eq_ ne ne_ lt lt_ le le_ gt gt_ ge ge_", "Scalar"))


def _wrapped_dtype(x):
    for kinds, dtype in _WRAPPED:
        if isinstance(x, kinds):
            return dtype
    return None


def _combine(higher, lower):
    """c10's `combine_categories` (ATen/native/TypeProperties.cpp): the dtype of a higher-priority
    operand class (tensors with dimensions over 0-d tensors over wrapped numbers), raised to the
    lower class's category only where that is higher. None: no operand in that class."""
    if higher is None or lower is None:
        return higher or lower
    if higher.is_complex:
        return higher
    if lower.is_complex:  # a floating type keeps its width, as the matching complex one
        return _TO_COMPLEX.get(higher, lower) if higher.is_floating_point else lower
    if higher.is_floating_point:
        return higher
    if higher == torch.bool or lower.is_floating_point:
        return torch.promote_types(higher, lower)
    return higher


_TO_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64,
               torch.float64: torch.complex128}
if hasattr(torch, "bcomplex32"):  # c10's toComplexType(BFloat16), where this torch has one
    _TO_COMPLEX[torch.bfloat16] = torch.bcomplex32


def _common_dtype(operands: list, wrapped: list):
    """TensorIterator's common dtype of the operands (tensors, and Python numbers with the dtype
    `wrapped` names), as `at::result_type` computes it (update_result_type_state: a wrapped float
    counts as the default dtype, a wrapped complex as the default complex one), in Python: a
    rule calling torch.result_type on fake tensors would dispatch an op for every op it looks at."""
    classes = [None, None, None]  # tensors with dimensions, 0-d tensors, wrapped numbers
    for x, w in zip(operands, wrapped):
        if w is not None:
            cls, dtype = 2, (torch.get_default_dtype() if w.is_floating_point else
                             _TO_COMPLEX[torch.get_default_dtype()] if w.is_complex else w)
        else:
            cls, dtype = (0 if x.dim() else 1), x.dtype
        classes[cls] = dtype if classes[cls] is None else torch.promote_types(classes[cls], dtype)
    return _combine(classes[0], _combine(classes[1], classes[2]))


def promotion_temporaries(func, args) -> list | None:
    """Bytes a CPU elementwise op allocates for its operands (`OPERANDS[func]` of `args`): each
    Python number's wrapped 0-d tensor, then a copy in the common dtype of each operand of another
    dtype, and an in-place op's common-dtype result where its tensor has another dtype."""
    positions = OPERANDS[func]
    if len(args) <= max(positions):
        return None
    operands = [args[i] for i in positions]
    wrapped = [_wrapped_dtype(x) if not isinstance(x, torch.Tensor) else None for x in operands]
    numbers = [d for d in wrapped if d is not None]
    if not numbers and len({x.dtype for x in operands if isinstance(x, torch.Tensor)}) <= 1:
        return None  # the common case: one dtype, no number
    if any(d is None and not isinstance(x, torch.Tensor) for d, x in zip(wrapped, operands)):
        return None  # an argument neither a tensor nor a number this knows
    common = _common_dtype(operands, wrapped)
    if func in _TRUE_DIVISIONS and not (common.is_floating_point or common.is_complex):
        common = torch.get_default_dtype()  # promote_integer_inputs_to_float
    steps = [d.itemsize for d in numbers]
    for x, d in zip(operands, wrapped):
        dtype, numel = (d, 1) if d is not None else (x.dtype, x.numel())
        if dtype != common:
            steps.append(numel * common.itemsize)
    mutated = func._schema.is_mutable and isinstance(args[0], torch.Tensor)
    if mutated and func not in _COMPARISONS and args[0].dtype != common:
        steps.append(args[0].numel() * common.itemsize)  # the result, then copied back
    return steps


@RULES.register(WORKSPACE, *OPERANDS, devices={"cpu"},
                source="torch/csrc/utils/python_arg_parser.cpp (numbers as tensors: "
                       "scalar_to_tensor); aten/src/ATen/native/BinaryOps.cpp "
                       "(wrapped_scalar_tensor); aten/src/ATen/TensorIterator.cpp "
                       "(compute_types: CPU operands promoted to the common dtype)",
                test="tests/test_kernel_workspace.py::test_cpu_operands_of_another_dtype_are_copied")
def operands_promoted(ctx, func, args, kwargs, out):
    """Python numbers wrapped as 0-d tensors, and operands of another dtype than the op's common
    one copied into it, alive while the op runs."""
    return promotion_temporaries(func, args)
