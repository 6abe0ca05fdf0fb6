"""float8 matrix products (`torch._scaled_mm`, what torchao's float8 training runs): the GPUs that
have them, and the CPU kernel's scratch.

torch's meta kernel (`_check_scaled_mm_sizes` in torch/_meta_registrations.py) already follows the
real kernels' shape, stride and dtype checks (row-major `self`, column-major `mat2`, dimensions
divisible by 16 on CUDA; tensorwise / rowwise / blockwise scales), so the fake kernel is torch's.
Three things the real kernels do are not in it:

- CUDA refuses the op on a GPU without float8 tensor cores (`_scaled_mm_allowed_device`: sm89 and
  newer); a fake tensor has no device to ask, so the profiled GPU answers.
- The CPU kernel is an emulation (`_scaled_mm_out_cpu_emulated`, aten/src/ATen/native/Blas.cpp):
  it copies the operands contiguous, widens both to fp32 and multiplies in their scales, runs an
  fp32 matmul, then narrows the result into the output; every one of those tensors is allocated
  inside the op and freed when it returns. A CPU with AMX (Sapphire Rapids and newer) takes
  oneDNN's `mkldnn_scaled_mm` instead when MKLDNN is enabled; that path is not modelled (no
  target ISA here names AMX).
- torch has no fake kernel for the `out=` overload, which inductor's generated code calls
  (`extern_kernels._scaled_mm(..., out=buf)`): FakeTensorMode then runs the real kernel on real
  copies of the inputs, which needs the GPU ("Found no NVIDIA driver"). A KERNEL rule is that
  fake kernel: torch's own checks (the default overload's meta kernel), then the output written
  into `out`, as `_scaled_mm_out_cuda` / `_scaled_mm_out_cpu` do.
"""

from __future__ import annotations

import torch

from .registry import CHECK, KERNEL, RULES, WORKSPACE, Alloc, Free, Output

__all__ = ["scaled_mm_allowed", "FLOAT8_MIN_CAPABILITY"]

aten = torch.ops.aten

# _scaled_mm_allowed_device() (aten/src/ATen/native/cuda/Blas.cpp): major >= 9, or exactly 8.9
FLOAT8_MIN_CAPABILITY = (8, 9)
_REFUSAL = ("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 "
            "or 8.9, or ROCm MI300+")


def scaled_mm_allowed(compute_capability: tuple) -> bool:
    """Whether CUDA's _scaled_mm runs on a GPU of this compute capability."""
    major, minor = compute_capability
    return major >= 9 or (major, minor) == FLOAT8_MIN_CAPABILITY


@RULES.register(CHECK, aten._scaled_mm.default, aten._scaled_mm.out, devices=("cuda",),
                source="aten/src/ATen/native/cuda/Blas.cpp (_scaled_mm_out_cuda: "
                       "_scaled_mm_allowed_device)",
                test="tests/test_float8.py::test_scaled_mm_is_refused_on_a_gpu_without_float8")
def scaled_mm_needs_float8_tensor_cores(ctx, func, args, kwargs):
    """The profiled GPU must have float8 tensor cores (sm89 and newer)."""
    gpu = ctx.gpu
    if gpu is not None and not scaled_mm_allowed(gpu.compute_capability):
        major, minor = gpu.compute_capability
        raise RuntimeError(f"{_REFUSAL} (the profiled GPU, {gpu.name}, is sm{major}{minor}: "
                           f"profile on an sm89+ GPU, such as --gpu h100 or --gpu l4)")


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


# at::mul(tensor, Scalar) wraps the scalar in a 0-d double tensor (wrapped_scalar_tensor), which
# the CPU allocator allocates like any other, and TensorIterator casts it to float (4 bytes more)
_WRAPPED_SCALAR = (torch.float64.itemsize, torch.float32.itemsize)


def _scalar_steps(name: str, present: bool) -> list:
    return [Alloc(f"{name}.scalar{i}", n) for i, n in enumerate(_WRAPPED_SCALAR)] if present else []


def _scalar_frees(name: str, present: bool) -> list:
    return [Free(f"{name}.scalar{i}") for i in reversed(range(len(_WRAPPED_SCALAR)))] \
        if present else []


@RULES.register(WORKSPACE, aten._scaled_mm.default, aten._scaled_mm.out, devices={"cpu"},
                source="aten/src/ATen/native/Blas.cpp (_scaled_mm_out_cpu_emulated)",
                test="tests/test_float8.py::test_float8_linear_peak_matches_a_real_cpu_run")
def scaled_mm_cpu_emulation(ctx, func, args, kwargs, out):
    """The emulated CPU kernel's temporaries, in the kernel's order."""
    mat_a, mat_b, scale_a, scale_b = args[:4]
    bias = args[4] if len(args) > 4 else kwargs.get("bias")
    out_dtype = args[6] if len(args) > 6 else kwargs.get("out_dtype")
    out_dtype = out_dtype or mat_a.dtype
    m, k = mat_a.shape
    n = mat_b.shape[1]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    steps = []
    for name, t in (("a", mat_a), ("b", mat_b)):  # mat.contiguous(): a copy unless it is
        if not t.is_contiguous():
            steps.append(Alloc(f"{name}.contiguous", _nbytes(t.shape, t.dtype)))
    if func is aten._scaled_mm.default:  # resize_output(out, {M, N}) allocates it here
        steps.append(Output(0))
    for name, shape in (("a", (m, k)), ("b", (k, n))):
        # fp32_mat = at::mul(mat_cont.to(kFloat), scale): the widened copy dies with the statement
        steps.append(Alloc(f"{name}.fp32", _nbytes(shape, torch.float32)))
        scalar = tensorwise  # scale.item<float>() passed as a Scalar
        steps += _scalar_steps(name, scalar)
        steps.append(Alloc(f"{name}.scaled", _nbytes(shape, torch.float32)))
        steps += _scalar_frees(name, scalar)
        steps.append(Free(f"{name}.fp32"))
    steps.append(Alloc("fp32 result", _nbytes((m, n), torch.float32)))  # at::matmul: plain mm
    last = "fp32 result"
    if out_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # out_tmp * (1 / output_scale)
        steps += [*_scalar_steps("rescale", True),
                  Alloc("rescaled", _nbytes((m, n), torch.float32)),
                  *_scalar_frees("rescale", True), Free(last)]
        last = "rescaled"
    if out_dtype != torch.float32:  # out_tmp.to(out.scalar_type()) replaces out_tmp
        steps += [Alloc("narrowed", _nbytes((m, n), out_dtype)), Free(last)]
    del bias  # added in place into the fp32 result
    return steps


@RULES.register(KERNEL, aten._scaled_mm.out, devices=("cpu", "cuda"),
                source="aten/src/ATen/native/cuda/Blas.cpp (_scaled_mm_out_cuda), "
                       "aten/src/ATen/native/Blas.cpp (_scaled_mm_out_cpu)",
                test="tests/test_float8.py::test_torchtitan_float8_compiled_on_cuda_without_a_gpu")
def scaled_mm_into_out(ctx, mat_a, mat_b, scale_a, scale_b, bias=None, scale_result=None,
                       out_dtype=None, use_fast_accum=False, *, out):
    """`_scaled_mm(..., out=out)`: the default overload's checks and shape, written into `out`."""
    torch._check(out_dtype is None or out_dtype == out.dtype,
                 lambda: "out_dtype must match output matrix type")
    result = aten._scaled_mm.default(mat_a, mat_b, scale_a, scale_b, bias, scale_result,
                                     out.dtype, use_fast_accum)
    if out.shape != result.shape:
        out.resize_(result.shape)  # at::native::resize_output
    return out
