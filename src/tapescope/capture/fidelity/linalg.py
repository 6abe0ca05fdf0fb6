"""CPU matrix functions: buffers their kernels allocate inside themselves.

Counted (aten/src/ATen/native/BatchLinearAlgebra.cpp, BatchLinearAlgebraKernel.cpp), exact against
the allocator (tests/test_kernel_workspace.py::test_linear_algebra_matches_the_allocator):
- `linalg_lu_solve` checks its pivots (`(pivots > 0).all()`, `(pivots <= n).all()`): each
  comparison wraps its number as an int64 0-d tensor, casts it to int32, makes a bool per pivot,
  and `all` a 1-byte result;
- `_linalg_solve_ex` (solve) factors into its LU and pivots outputs, then runs that check;
- `linalg_inv_ex` solves against the identity in its result through a solve of its own: an LU
  copy and int32 pivots, the check, freed before it returns;
- `_linalg_eigh` (LAPACK syevd): an int32 info per matrix, then the work arrays LAPACK's
  workspace query asks for (lapack_query.py asks it; with eigenvectors it answers LAPACK's
  documented `lwork = 1 + 6n + 2n^2` and `liwork = 3 + 5n`), ATen's work one element more
  (`lapack_work_to_int`, below) - then the check of the infos (`any`: a byte and a bool per
  info). Without eigenvectors (eigvalsh, jobz='N') a copy of the input comes first: syevd
  overwrites it;
- `_linalg_check_errors` after a factorization (`info.any()`, the same).

The SVD, QR, LU and determinant kernels are linalg_factorizations.py; matrix_exp's Taylor
buffers are matrix_exp.py. The `+ 1` of syevd's work array is ATen's `lapack_work_to_int`
(one ULP up before the cast: a whole-number answer becomes one element more).

Not counted, and said in the report: the general eigendecomposition (`linalg_eig`, geev: its
complex results are rebuilt from the real ones).
"""

from __future__ import annotations

import torch

from .lapack_query import syevd_workspace
from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = []

aten = torch.ops.aten
_SOURCE = "aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_lu_solve, linalg_solve_ex, " \
          "linalg_inv_ex, linalg_eigh, _linalg_check_errors)"
_TEST = "tests/test_kernel_workspace.py::test_linear_algebra_matches_the_allocator"


def _pivot_checks(pivots: int) -> list:
    """linalg_lu_solve's two pivot checks over `pivots` int32 pivots (each `pivots > 0` /
    `pivots <= n`: the number wrapped as int64, cast to int32, a bool per pivot; `all`)."""
    steps = []
    for check in ("gt", "le"):
        steps += [Alloc(f"{check} number", 8), Alloc(f"{check} number as int", 4),
                  Alloc(f"{check} mask", pivots), Free(f"{check} number"),
                  Free(f"{check} number as int"), Alloc(f"{check} all", 1),
                  Free(f"{check} all"), Free(f"{check} mask")]
    return steps


def _info_check(infos: int) -> list:
    """`info.any()` over `infos` int32 infos: its 1-byte result, then the infos cast to bool
    (ReduceOps.cpp: `any` of a non-bool input reduces a bool copy), both freed."""
    return [Alloc("any", 1), Alloc("infos as bool", infos), Free("infos as bool"), Free("any")]


def _matrices(shape) -> tuple[int, int]:
    """(how many matrices, n) of a batch of square matrices."""
    batch = 1
    for s in shape[:-2]:
        batch *= s
    return batch, shape[-1]


@RULES.register(WORKSPACE, aten.linalg_lu_solve.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def lu_solve_checks_its_pivots(ctx, func, args, kwargs, out):
    pivots = args[1]
    return [Output(0)] + _pivot_checks(pivots.numel())


@RULES.register(WORKSPACE, aten._linalg_solve_ex.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def solve_checks_its_pivots(ctx, func, args, kwargs, out):
    """Its outputs (result, LU, pivots, info) first, then linalg_lu_solve's check."""
    pivots = out[2]
    return [Output(0), Output(1), Output(2), Output(3)] + _pivot_checks(pivots.numel())


@RULES.register(WORKSPACE, aten.linalg_inv_ex.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def inverse_solves_inside(ctx, func, args, kwargs, out):
    """The inverse and info, then linalg_solve_ex's LU copy and pivots, its check, freed."""
    a = args[0]
    batch, n = _matrices(a.shape)
    return [Output(0), Output(1), Alloc("LU", a.numel() * a.dtype.itemsize),
            Alloc("pivots", batch * n * 4)] + _pivot_checks(batch * n) + [Free("pivots"),
                                                                           Free("LU")]


@RULES.register(WORKSPACE, aten._linalg_eigh.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def eigh_work_arrays(ctx, func, args, kwargs, out):
    """syevd's work arrays (see the module docstring); without eigenvectors (eigvalsh), a copy of
    the input for syevd to overwrite first, and the work arrays of jobz='N'."""
    a = args[0]
    compute_v = args[2] if len(args) > 2 else kwargs.get("compute_v", True)
    if a.dtype not in (torch.float32, torch.float64):
        ctx.note("matrix function temporaries", "complex eigh: the work arrays of its CPU kernel "
                 "are not counted (an estimate)")
        return None
    batch, n = _matrices(a.shape)
    asked = syevd_workspace(a.dtype, n, bool(compute_v))
    if asked is None:  # LAPACK's documented minimum for jobz='V' (MKL answers it), + 1
        if not compute_v:
            ctx.note("matrix function temporaries", "eigvalsh: LAPACK's workspace query is not "
                     "reachable here; its work arrays are not counted (an estimate)")
            return None
        asked = 1 + 6 * n + 2 * n * n + 1, 3 + 5 * n
    lwork, liwork = asked
    outputs = [Output(1), Output(0)] if compute_v else [
        Output(0), Output(1), Alloc("input copy", a.numel() * a.dtype.itemsize)]
    return outputs + [Alloc("infos", batch * 4),
                      Alloc("work", lwork * a.dtype.itemsize), Alloc("iwork", liwork * 4),
                      Free("iwork"), Free("work")] + _info_check(batch) + [Free("infos")]


@RULES.register(WORKSPACE, aten._linalg_check_errors.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def check_errors_reads_the_infos(ctx, func, args, kwargs, out):
    return _info_check(args[0].numel())


# SVD, QR, LU unpacking and determinants: linalg_factorizations.py (lu_factor_ex allocates only
# its outputs)
# matrix_exp: matrix_exp.py
_NOT_MODELLED = (aten.linalg_eig.default,)


@RULES.register(WORKSPACE, *_NOT_MODELLED, devices={"cpu"},
                source="aten/src/ATen/native/BatchLinearAlgebra.cpp (linalg_eig_out), "
                       "BatchLinearAlgebraKernel.cpp (apply_linalg_eig)",
                test="tests/test_linalg_memory.py::test_eig_says_it_is_an_estimate")
def matrix_function_temporaries(ctx, func, args, kwargs, out):
    """Notes the op's in-kernel temporaries as not counted (see the module docstring)."""
    name = func.name().split("::")[-1].lstrip("_")
    ctx.note("matrix function temporaries", f"{name}: the buffers its CPU kernel allocates "
             "inside itself are not counted (an estimate)")
    return None
