"""LAPACK's own answer to a workspace query, from the LAPACK this torch runs.

ATen sizes the work array of geqrf and orgqr (QR) by asking LAPACK first (`lwork = -1`: the
routine writes the size it wants into `work[0]` and computes nothing), then allocates it with
`at::empty` - a buffer the allocator sees. The answer is the library's own blocking (MKL's differs
from LAPACK's documented minimum, and between float32 and float64: orgqr of a 40 x 24 matrix asks
for 1408 floats but 24 doubles), so no formula reproduces it; asking the same library the same
question does. torch's CPU build exports the routines it links (MKL's `sgeqrf_`, ...) from
libtorch_cpu, so ctypes reaches them without a matrix: the query reads only the sizes.

ATen then rounds the answer up by one ULP before casting (BatchLinearAlgebraKernel.cpp
`lapack_work_to_int`: `ceil(nextafter(val, inf))`), which for a whole number is one element more.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

__all__ = ["workspace_elements"]

_PREFIX = {torch.float32: ("s", ctypes.c_float), torch.float64: ("d", ctypes.c_double)}


@functools.cache
def _library():
    """The loaded libtorch_cpu (ctypes returns the process's handle), or None where it cannot be
    opened. Cached: the same library answers for the whole process."""
    try:
        return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    except OSError:
        return None


def _ceil_after(value: float, dtype: torch.dtype) -> int:
    """lapack_work_to_int: one ULP up in the query's own precision, then the ceiling."""
    t = torch.tensor(value, dtype=dtype)
    return max(1, int(torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype)).ceil()))


@functools.cache
def workspace_elements(routine: str, dtype: torch.dtype, *sizes: int) -> int | None:
    """The elements ATen allocates for `routine`'s work array ("geqrf": m, n; "orgqr": m, n, k),
    as this process's LAPACK answers the query; None where the routine cannot be reached (a
    build without it exported). Cached: a pure function of the sizes and the library."""
    lib = _library()
    if dtype not in _PREFIX or lib is None:
        return None
    prefix, scalar = _PREFIX[dtype]
    fn = getattr(lib, f"{prefix}{routine}_", None)
    if fn is None:
        return None
    m = sizes[0]
    ints = [ctypes.c_int(s) for s in sizes]
    a, tau, work = (scalar * 1)(), (scalar * 1)(), (scalar * 1)()
    lda, lwork, info = ctypes.c_int(max(1, m)), ctypes.c_int(-1), ctypes.c_int(0)
    # geqrf(m, n, a, lda, tau, work, lwork, info); orgqr(m, n, k, a, lda, tau, work, lwork, info)
    fn(*[ctypes.byref(i) for i in ints], a, ctypes.byref(lda), tau, work, ctypes.byref(lwork),
       ctypes.byref(info))
    if info.value != 0:
        return None
    return _ceil_after(work[0], dtype)


@functools.cache
def syevd_workspace(dtype: torch.dtype, n: int, vectors: bool) -> tuple[int, int] | None:
    """(work elements, iwork elements) ATen allocates for syevd of an n x n matrix, as this
    process's LAPACK answers the query (BatchLinearAlgebraKernel.cpp apply_lapack_eigh: work by
    `lapack_work_to_int`, iwork by `max(1, iwkopt)`); None where the routine cannot be reached."""
    lib = _library()
    if dtype not in _PREFIX or lib is None:
        return None
    prefix, scalar = _PREFIX[dtype]
    fn = getattr(lib, f"{prefix}syevd_", None)
    if fn is None:
        return None
    jobz, uplo = ctypes.c_char(b"V" if vectors else b"N"), ctypes.c_char(b"L")
    a, w, work = (scalar * 1)(), (scalar * 1)(), (scalar * 1)()
    iwork = (ctypes.c_int * 1)()
    n_, lda = ctypes.c_int(n), ctypes.c_int(max(1, n))
    lwork, liwork, info = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(0)
    # syevd(jobz, uplo, n, a, lda, w, work, lwork, iwork, liwork, info, [hidden char lengths])
    fn(ctypes.byref(jobz), ctypes.byref(uplo), ctypes.byref(n_), a, ctypes.byref(lda), w, work,
       ctypes.byref(lwork), iwork, ctypes.byref(liwork), ctypes.byref(info),
       ctypes.c_size_t(1), ctypes.c_size_t(1))
    if info.value != 0:
        return None
    return _ceil_after(work[0], dtype), max(1, iwork[0])
