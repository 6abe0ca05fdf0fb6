"""CPU matrix functions: buffers their kernels allocate inside themselves, not modelled yet - said.

`linalg_matrix_exp` (LinearAlgebra.cpp `mexp_impl`) picks the degree of its Taylor / Padé
approximation from the matrix's 1-norm - a value a fake tensor lacks - and each degree makes its
own powers and products; its backward (`backward_analytic_function_of_a_matrix`) exponentiates a
2n x 2n block matrix with the same kernel (an orthogonal parametrization's step measured 0.23x the
allocator's peak without them). The LAPACK-backed decompositions (eigh, svd, qr, cholesky, LU,
inverse, solve, det) allocate work arrays and column-major copies sized by LAPACK's workspace
queries. None is counted yet: each such op notes that the step's figure is an estimate, so the
report does not call it exact.
"""

from __future__ import annotations

import torch

from .registry import RULES, WORKSPACE

__all__ = []

aten = torch.ops.aten

_MATRIX_FUNCTIONS = (aten.linalg_matrix_exp.default, aten._linalg_eigh.default,
                     aten._linalg_svd.default, aten.linalg_qr.default,
                     aten.linalg_cholesky_ex.default, aten.linalg_inv_ex.default,
                     aten._linalg_solve_ex.default, aten.linalg_lu_factor_ex.default,
                     aten._linalg_slogdet.default, aten._linalg_det.default,
                     aten.linalg_eig.default)


@RULES.register(WORKSPACE, *_MATRIX_FUNCTIONS, devices={"cpu"},
                source="aten/src/ATen/native/LinearAlgebra.cpp (mexp_impl), "
                       "BatchLinearAlgebra.cpp (LAPACK workspace queries)",
                test="tests/test_kernel_workspace.py::test_matrix_functions_say_they_are_estimates")
def matrix_function_temporaries(ctx, func, args, kwargs, out):
    """Notes the op's in-kernel temporaries as not counted (see the module docstring)."""
    name = func.name().split("::")[-1].lstrip("_")
    ctx.note("matrix function temporaries", f"{name}: the buffers its CPU kernel allocates "
             "inside itself are not counted (an estimate)")
    return None
