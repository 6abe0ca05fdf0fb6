"""What a real kernel refuses and a meta kernel lets through: a step PyTorch would refuse is refused.

Fake tensors run the Python meta kernels of torch/_meta_registrations.py, which compute output
shapes and skip checks the real kernels make (the C++ structured-meta checks of matmul, the CPU
kernels' dtype checks). A model that mixes dtypes would then get a profile of a step that cannot
run. Each rule below repeats one real check, with the real kernel's message, for the devices
whose kernels make it; tests/test_reliability.py runs each case for real on the CPU and compares
the messages. The differences were found by running every op of a list of candidates (matmuls,
norms, losses, indexing, convolutions, attention) on real CPU tensors and on fake ones with mixed
dtypes; the cases where both refuse (bmm, baddbmm, conv, SDPA, cat ...) need no rule.
"""

from __future__ import annotations

import torch

from .registry import CHECK, RULES

__all__ = ["scalar_type_name", "type_meta_name"]

aten = torch.ops.aten
_REAL_DEVICES = ("cpu", "cuda")  # a meta device's real kernels are the meta kernels

# c10::toString(ScalarType): the names most kernel messages print
_SCALAR_TYPE = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
                torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
# caffe2::TypeMeta names (what `tensor.dtype()` prints in C++)
_TYPE_META = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16"}


def scalar_type_name(dtype: torch.dtype) -> str:
    return _SCALAR_TYPE.get(dtype, str(dtype).replace("torch.", ""))


def type_meta_name(dtype: torch.dtype) -> str:
    return _TYPE_META.get(dtype, str(dtype).replace("torch.", ""))


def _refuse(message: str):
    raise RuntimeError(message)


@RULES.register(CHECK, aten.addmm.default, aten.addmm.out, devices=_REAL_DEVICES,
                source="aten/src/ATen/native/LinearAlgebra.cpp (ADDMM_META: the structured meta "
                       "function every real addmm kernel runs)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def addmm_same_dtype(ctx, func, args, kwargs):
    """self, mat1 and mat2 of addmm must share one dtype (nn.Linear with a bias on a 2-d input)."""
    self, mat1, mat2 = args[:3]
    if self.dtype != mat2.dtype:
        _refuse(f"self and mat2 must have the same dtype, but got {scalar_type_name(self.dtype)} "
                f"and {scalar_type_name(mat2.dtype)}")
    if mat1.dtype != mat2.dtype:
        _refuse(f"mat1 and mat2 must have the same dtype, but got {scalar_type_name(mat1.dtype)} "
                f"and {scalar_type_name(mat2.dtype)}")


@RULES.register(CHECK, aten.mm.default, aten.mm.out, devices=("cpu",),
                source="aten/src/ATen/native/LinearAlgebra.cpp (addmm_impl_cpu_)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def mm_same_dtype_cpu(ctx, func, args, kwargs):
    """mm on CPU (a Linear without bias, matmul of 2-d or flattened 3-d operands)."""
    m1, m2 = args[:2]
    if m1.dtype != m2.dtype:
        _refuse(f"expected m1 and m2 to have the same dtype, but got: {type_meta_name(m1.dtype)} "
                f"!= {type_meta_name(m2.dtype)}")


@RULES.register(CHECK, aten.mm.default, aten.mm.out, devices=("cuda",),
                source="aten/src/ATen/native/cuda/Blas.cpp (addmm_out_cuda_impl)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def mm_same_dtype_cuda(ctx, func, args, kwargs):
    m1, m2 = args[:2]
    if m1.dtype != m2.dtype:
        _refuse(f"expected mat1 and mat2 to have the same dtype, but got: "
                f"{type_meta_name(m1.dtype)} != {type_meta_name(m2.dtype)}")


@RULES.register(CHECK, aten.addmv.default, aten.addmv.out, devices=_REAL_DEVICES,
                source="aten/src/ATen/native/Blas.cpp (TORCH_META_FUNC(addmv))",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def addmv_same_dtype(ctx, func, args, kwargs):
    self, mat, vec = args[:3]
    if not self.dtype == mat.dtype == vec.dtype:
        _refuse(f"addmv input tensors must have the same dtype, but got "
                f"{scalar_type_name(self.dtype)}, {scalar_type_name(mat.dtype)}, and "
                f"{scalar_type_name(vec.dtype)}")


def _mixed_dtype_cpu(input, *params):
    """mixed_data_type.h: the norms' parameters (weight, bias, running stats) may differ from the
    input only as float32 parameters of a bfloat16 / float16 input. Only the combinations whose
    real message was measured are refused: a full-precision input (float32, float64) whose
    parameters have another dtype."""
    defined = [p for p in params if isinstance(p, torch.Tensor)]
    if not defined or defined[0].dtype == input.dtype:
        return
    if input.dtype in (torch.bfloat16, torch.float16):
        return  # mixed precision on CPU: its own rules, not checked here
    if any(p.dtype != torch.float32 for p in defined):
        _refuse("mixed dtype (CPU): expect parameter to have scalar type of Float")
    _refuse("mixed dtype (CPU): all inputs must share same datatype.")


@RULES.register(CHECK, aten.native_layer_norm.default, devices=("cpu",),
                source="aten/src/ATen/native/layer_norm.cpp (layer_norm_cpu) + "
                       "cpu/mixed_data_type.h",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def layer_norm_mixed_dtype(ctx, func, args, kwargs):
    input, _shape, weight, bias = (*args, None, None)[:4]
    _mixed_dtype_cpu(input, weight, bias)


@RULES.register(CHECK, aten.native_group_norm.default, devices=("cpu",),
                source="aten/src/ATen/native/group_norm.cpp (native_group_norm) + "
                       "cpu/mixed_data_type.h",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def group_norm_mixed_dtype(ctx, func, args, kwargs):
    input, weight, bias = args[:3]
    _mixed_dtype_cpu(input, weight, bias)


@RULES.register(CHECK, aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                aten._native_batch_norm_legit_no_training.default, devices=("cpu",),
                source="aten/src/ATen/native/Normalization.cpp (batch_norm_cpu) + "
                       "cpu/mixed_data_type.h",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def batch_norm_mixed_dtype(ctx, func, args, kwargs):
    input, weight, bias, running_mean, running_var = (*args, None, None, None, None)[:5]
    _mixed_dtype_cpu(input, weight, bias, running_mean, running_var)


@RULES.register(CHECK, aten._native_batch_norm_legit.no_stats, devices=("cpu",),
                source="aten/src/ATen/native/Normalization.cpp (batch_norm_cpu) + "
                       "cpu/mixed_data_type.h",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def batch_norm_no_stats_mixed_dtype(ctx, func, args, kwargs):
    input, weight, bias = args[:3]
    _mixed_dtype_cpu(input, weight, bias)


@RULES.register(CHECK, aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
                devices=("cpu",),
                source="aten/src/ATen/native/LossNLL.cpp (nll_loss_forward_out_cpu_template)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def nll_loss_target_dtype(ctx, func, args, kwargs):
    target = args[1]
    if target.dtype not in (torch.int64, torch.uint8):
        _refuse(f"expected target dtype to be Long or Byte, but got "
                f"{scalar_type_name(target.dtype)}")


@RULES.register(CHECK, aten.index_select.default, devices=("cpu",),
                source="aten/src/ATen/native/TensorAdvancedIndexing.cpp (index_select_out_cpu_)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def index_select_index_dtype(ctx, func, args, kwargs):
    if args[2].dtype not in (torch.int64, torch.int32):
        _refuse("index_select(): Expected dtype int32 or int64 for index")


@RULES.register(CHECK, aten.index_add.default, aten.index_add_.default, devices=_REAL_DEVICES,
                source="aten/src/ATen/native/TensorAdvancedIndexing.cpp "
                       "(TORCH_PRECOMPUTE_META_FUNC(index_add))",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def index_add_dtypes(ctx, func, args, kwargs):
    self, _dim, index, source = args[:4]
    if index.dtype not in (torch.int64, torch.int32):
        _refuse(f"index_add_(): Expected dtype int32/int64 for index but got: "
                f"{scalar_type_name(index.dtype)}")
    if self.dtype != source.dtype:
        _refuse(f"index_add_(): self ({scalar_type_name(self.dtype)}) and source "
                f"({scalar_type_name(source.dtype)}) must have the same scalar type")


@RULES.register(CHECK, aten.mv.default, devices=_REAL_DEVICES,
                source="aten/src/ATen/native/Blas.cpp (mv: addmv_ into a result of vec's dtype)",
                test="tests/test_reliability.py::test_mixed_dtypes_are_refused_as_pytorch_refuses")
def mv_same_dtype(ctx, func, args, kwargs):
    mat, vec = args[:2]
    if mat.dtype != vec.dtype:
        _refuse(f"addmv input tensors must have the same dtype, but got "
                f"{scalar_type_name(vec.dtype)}, {scalar_type_name(mat.dtype)}, and "
                f"{scalar_type_name(vec.dtype)}")
