"""CPU factorizations (SVD, QR, LU unpacking, determinants): the buffers their kernels allocate
inside themselves, in the kernels' order.

Counted, exact against the allocator (tests/test_linalg_memory.py):
- `_linalg_svd` (BatchLinearAlgebra.cpp `_linalg_svd_out`, BatchLinearAlgebraKernel.cpp
  `svd_kernel` / `apply_svd`): its outputs (U, then Vh, then S), an int32 info per matrix, a
  column-major copy of the input for gesdd to overwrite, freed, then the info check. gesdd's own
  `work` and `iwork` are std::vectors, never the allocator's: nothing to count.
- `linalg_qr` (`linalg_qr_out`): Q and R, tau (min(m, n) per matrix), geqrf's work array, freed,
  then orgqr's (when Q is computed), freed. Each work array is as long as LAPACK's answer to its
  workspace query (lapack_query.py asks the library this torch runs). Where geqrf's m x n
  workspace fits neither Q nor R (mode "r" of a tall matrix), a column-major copy of the input.
- `linalg_householder_product` (`householder_product_out_helper`): the result, a contiguous
  copy of a strided tau, orgqr's work array (its query's answer).
- `lu_unpack` with its pivots (`lu_unpack_out`): the identity permutation `arange(m)` as int64,
  expanded over the batch and made contiguous (a copy only for a batch).
- `_linalg_det` / `_linalg_slogdet` (LinearAlgebra.cpp, BatchLinearAlgebra.cpp): their outputs,
  lu_factor_ex's info, then `lu_det_P(pivots)`: `arange(1, n + 1)` as int32, `!= pivots` (a bool
  per pivot), `sum(dtype=long)` (its bool input cast to int64 first), `fmod_(2)`, `mul_(-2)`,
  `add_(1)` (each wraps its number as an int64 0-d tensor); det multiplies it by the product of
  U's diagonal (computed first: the compiler evaluates the arguments right to left), casting the
  int64 sign to the result's dtype; slogdet takes `sgn` of the diagonal, its product, the same
  cast, then `abs` of the diagonal for the log.
"""

from __future__ import annotations

import torch

from .lapack_query import workspace_elements
from .linalg import _info_check, _matrices
from .registry import FUNCTION, RULES, WORKSPACE, Alloc, Free, Output
from .triangular import batch_packed

__all__ = []

aten = torch.ops.aten
_TEST = "tests/test_linalg_memory.py::test_factorizations_match_the_allocator"
_REAL = (torch.float32, torch.float64)


def _batch(shape) -> int:
    batch = 1
    for s in shape[:-2]:
        batch *= s
    return batch


def _estimate(ctx, func, why: str) -> None:
    name = func.name().split("::")[-1].lstrip("_")
    ctx.note("matrix function temporaries", f"{name}: {why} (an estimate)")


@RULES.register(WORKSPACE, aten._linalg_svd.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (_linalg_svd_out), "
                       "BatchLinearAlgebraKernel.cpp (svd_kernel, apply_svd)")
def svd_copies_its_input(ctx, func, args, kwargs, out):
    a = args[0]
    if a.dtype not in _REAL:
        _estimate(ctx, func, "complex SVD's real work array is not counted")
        return None
    batch = _batch(a.shape)
    return [Output(0), Output(2), Output(1), Alloc("infos", batch * 4),
            Alloc("input copy (column-major)", a.numel() * a.dtype.itemsize),
            Free("input copy (column-major)")] + _info_check(batch) + [Free("infos")]


@RULES.register(WORKSPACE, aten.linalg_qr.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_qr_out), "
                       "BatchLinearAlgebraKernel.cpp (apply_geqrf, apply_orgqr)")
def qr_work_arrays(ctx, func, args, kwargs, out):
    a = args[0]
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "reduced")
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    if a.dtype not in _REAL or a.numel() == 0:
        return None
    q = out[0]
    compute_q = mode != "r"
    geqrf = workspace_elements("geqrf", a.dtype, m, n)
    orgqr = workspace_elements("orgqr", a.dtype, m, q.shape[-1], k) if compute_q else 0
    if geqrf is None or orgqr is None:
        _estimate(ctx, func, "LAPACK's workspace query is not reachable here; geqrf's and "
                  "orgqr's work arrays are not counted")
        return None
    s = a.dtype.itemsize
    steps = [Output(0), Output(1), Alloc("tau", _batch(a.shape) * k * s)]
    fits = (compute_q and q.shape[-1] == n) or out[1].shape[-2] == m
    if not fits:
        steps.append(Alloc("input copy (column-major)", a.numel() * s))
    steps += [Alloc("geqrf work", geqrf * s), Free("geqrf work")]
    if compute_q:
        steps += [Alloc("orgqr work", orgqr * s), Free("orgqr work")]
    return steps


@RULES.register(WORKSPACE, aten.lu_unpack.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (lu_unpack_out)")
def lu_unpack_builds_the_permutation(ctx, func, args, kwargs, out):
    lu = args[0]
    unpack_pivots = args[3] if len(args) > 3 else kwargs.get("unpack_pivots", True)
    if not unpack_pivots:
        return None
    m, batch = lu.shape[-2], _batch(lu.shape)
    steps = [Output(0), Output(1), Output(2), Alloc("arange", m * 8)]
    if lu.dim() > 2:  # expand(...).contiguous() copies only over a batch
        steps += [Alloc("permutation", batch * m * 8), Free("arange")]
    return steps


@RULES.register(WORKSPACE, aten.linalg_householder_product.default, devices={"cpu"},
                test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp "
                       "(householder_product_out_helper), BatchLinearAlgebraKernel.cpp "
                       "(apply_orgqr)")
def householder_product_work_array(ctx, func, args, kwargs, out):
    """The result (the input copied in), a contiguous copy of a strided tau, and orgqr's work
    array as LAPACK's workspace query answers (the orthogonal parametrization of a non-square
    weight: torch.nn.utils.parametrizations.orthogonal's default map)."""
    a, tau = args[0], args[1]
    if a.dtype not in _REAL or a.numel() == 0:
        return None
    m, n, k = a.shape[-2], a.shape[-1], tau.shape[-1]
    elements = workspace_elements("orgqr", a.dtype, m, n, k)
    if elements is None:
        _estimate(ctx, func, "LAPACK's workspace query is not reachable here; orgqr's work "
                  "array is not counted")
        return None
    steps = [Output(0)]
    if not tau.is_contiguous():
        steps.append(Alloc("tau (contiguous)", tau.numel() * tau.dtype.itemsize))
    return steps + [Alloc("orgqr work", elements * a.dtype.itemsize), Free("orgqr work")]


def _det_p(batch: int, n: int) -> list:
    """lu_det_P(pivots): the int64 sign of the permutation, left alive as "det_P"."""
    steps = [Alloc("arange", n * 4), Alloc("ne", batch * n), Alloc("det_P", batch * 8),
             Alloc("ne as int64", batch * n * 8), Free("ne as int64")]
    for op in ("fmod_", "mul_", "add_"):
        steps += [Alloc(f"{op} number", 8), Free(f"{op} number")]
    return steps + [Free("ne"), Free("arange")]


@RULES.register(WORKSPACE, aten._linalg_det.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/LinearAlgebra.cpp (_linalg_det_out, lu_det_P)")
def det_from_lu(ctx, func, args, kwargs, out):
    a = args[0]
    if a.dtype not in _REAL:
        return None
    batch, n = _matrices(a.shape)
    s = a.dtype.itemsize
    return ([Output(0), Output(1), Output(2), Alloc("info", batch * 4),
             Alloc("prod of diagonal", batch * s)] + _det_p(batch, n)
            + [Alloc("det_P as result dtype", batch * s), Free("det_P as result dtype")])


@RULES.register(WORKSPACE, aten._linalg_slogdet.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/LinearAlgebra.cpp (_linalg_slogdet_out, lu_det_P)")
def slogdet_from_lu(ctx, func, args, kwargs, out):
    a = args[0]
    if a.dtype not in _REAL:
        return None
    batch, n = _matrices(a.shape)
    s = a.dtype.itemsize
    return ([Output(0), Output(1), Output(2), Output(3), Alloc("info", batch * 4)]
            + _det_p(batch, n)
            + [Alloc("sgn of diagonal", batch * n * s), Alloc("prod", batch * s),
               Alloc("det_P as result dtype", batch * s), Free("det_P as result dtype"),
               Free("prod"), Free("sgn of diagonal"), Free("det_P"),
               Alloc("abs of diagonal", batch * n * s), Free("abs of diagonal")])


@RULES.register(WORKSPACE, aten.linalg_lu.default, devices={"cpu"}, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_lu_out, "
                       "linalg_lu_factor_ex_out, lu_unpack_out)")
def lu_factors_into_l_or_u(ctx, func, args, kwargs, out):
    """P, L, U; lu_factor_ex into L (tall) or U: a column-major copy where that output is
    row-major, with the pivots and info, the copy freed once written back; then lu_unpack_out's
    triangle of the other factor (triu/tril copy a batch whose matrices are not packed) and the
    permutation."""
    a = args[0]
    if a.dtype not in _REAL or a.numel() == 0:
        return None
    m, n = a.shape[-2], a.shape[-1]
    k, batch, s = min(m, n), _batch(a.shape), a.dtype.itemsize
    factored = out[1] if m > n else out[2]
    steps = [Output(0), Output(1), Output(2)]
    copy = not factored.mT.is_contiguous()
    if copy:
        steps.append(Alloc("LU (column-major)", factored.numel() * s))
    steps += [Alloc("pivots", batch * k * 4), Alloc("info", batch * 4)]
    if copy:
        steps.append(Free("LU (column-major)"))
    # lu_unpack_out: the triangle read from the factored output, narrowed to k x k
    narrowed = factored[..., :n, :] if m > n else factored[..., :, :m]
    if m != n and not batch_packed(narrowed):
        steps += [Alloc("triangle input copy", narrowed.numel() * s),
                  Free("triangle input copy")]
    steps.append(Alloc("arange", m * 8))
    if a.dim() > 2:
        steps += [Alloc("permutation", batch * m * 8), Free("arange")]
    return steps


# ---- values-only calls: the branch a plain tensor takes ------------------------------------------
# BatchLinearAlgebra.cpp `_may_require_fw_or_bw_grad(A)` decides whether eigvalsh / svdvals also
# compute eigenvectors / singular vectors (for the backward): `(GradMode && A.requires_grad()) ||
# A has a forward grad || isTensorSubclassLike(A)`. A FakeTensor is a subclass, so the traced call
# always takes the slower branch: syevd with jobz='V' and U, Vh outputs that a plain tensor which
# needs no gradient never allocates. These rules call the kernel the way a plain tensor does.

def _needs_vectors(a) -> bool:
    from torch.autograd.forward_ad import unpack_dual

    return (torch.is_grad_enabled() and a.requires_grad) or unpack_dual(a).tangent is not None


@RULES.register(FUNCTION, torch.linalg.eigvalsh, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_eigvalsh, "
                       "_may_require_fw_or_bw_grad)")
def eigvalsh_of_a_plain_tensor(ctx, func, args, kwargs):
    a = args[0] if args else kwargs.get("input")
    if kwargs.get("out") is not None or not isinstance(a, torch.Tensor) or _needs_vectors(a):
        return func(*args, **kwargs)
    uplo = args[1] if len(args) > 1 else kwargs.get("UPLO", "L")
    return aten._linalg_eigh.default(a, uplo, False)[0]


@RULES.register(FUNCTION, torch.linalg.svdvals, test=_TEST,
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_svdvals, "
                       "_may_require_fw_or_bw_grad)")
def svdvals_of_a_plain_tensor(ctx, func, args, kwargs):
    a = args[0] if args else kwargs.get("A")
    if kwargs.get("out") is not None or not isinstance(a, torch.Tensor) or _needs_vectors(a):
        return func(*args, **kwargs)
    driver = kwargs.get("driver")
    return aten._linalg_svd.default(a, False, False, driver=driver)[1]
