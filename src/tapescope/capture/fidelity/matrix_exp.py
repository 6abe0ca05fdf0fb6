"""`linalg_matrix_exp` on the CPU: the temporaries of its Taylor approximations, as the kernel
itself allocates them for the degree the matrix's norm selects.

LinearAlgebra.cpp `mexp_impl` takes each matrix's 1-norm, and per interval of norms
(thresholds `thetas`: float 1.19e-7, 5.98e-4, 5.12e-2, 0.580, 1.46, 3.01) gathers the matrices
of that interval (`nonzero`, `index_select`), approximates them with a Taylor polynomial of
degree 1, 2, 4, 8 or 12 (`compute_T1` ... `compute_T12`: a buffer of 2 to 5 matrix powers,
linear combinations, products) and scatters the results back (`index_put_`: a sort of the
indices, their counts, a cat); a norm above theta_12 takes degree 18 on the matrix scaled by
2^-s, s = ceil(log2(norm / theta_18)), then squares it s times. A fake tensor has no norm, and
the buffers differ per degree (at n = 16, float32: 4 KiB above the input at degree 1, 19 KiB at
degree 18 with squarings). The backward (FunctionsManual.cpp linalg_matrix_exp_differential)
exponentiates the 2n x 2n block matrix [[A^H, G], [0, A^H]] with the same op.

The degree is decided by a value, and each degree's sequence is ~100 allocations of ATen's own
helpers (index_put_'s sort, cumsum and cat among them) whose order decides the op's peak. So
rather than transcribe them, the rule runs the CPU kernel itself, once per (shape, dtype,
degrees), on a stand-in matrix whose 1-norm falls in the same interval (and gives the same s),
under torch.profiler's allocator events, and replays that sequence: the kernel is its own
account of what it allocates, and nothing in it depends on values but the degree and s.

The norm: the matrix's own when the capture knows its values (data_values.py), else a named
assumption with its source line in the report - the degree-18 approximation with two or more
squarings, the most memory any norm takes (a bound: a smaller norm allocates less). A stand-in
larger than `_MEASURE_LIMIT` is not run: its temporaries are then noted as not counted.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ...torch_compat import (disable_current_modes, disable_torch_function, profiler_event_tree,
                             profiler_event_types, profiler_running, unset_fake_temporarily)
from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = []

aten = torch.ops.aten

# LinearAlgebra.cpp `mexp`: the upper norm of degrees 1, 2, 4, 8, 12, 18 (thetas_float/_double)
_THETAS = {
    torch.float32: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02,
                    5.800524627688768e-01, 1.461661507209034e+00, 3.010066362817634e+00),
    torch.float64: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04,
                    4.991228871115323e-02, 2.996158913811580e-01, 1.090863719290036e+00),
}
_DEGREES = (1, 2, 4, 8, 12, 18)
_ASSUMED = (5, 2)  # degree 18 (index 5), two squarings: the loop's largest live set
_MEASURE_LIMIT = 256 * 2 ** 20  # bytes of one input the stand-in run may take (~16x that live)


def _bucket(norm: float, dtype) -> tuple[int, int]:
    """(degree index, squarings) mexp_impl picks for a matrix of this 1-norm."""
    thetas = _THETAS[dtype]
    for i in range(5):
        if norm <= thetas[i]:
            return i, 0
    return 5, max(0, math.ceil(math.log2(norm / thetas[5]))) if norm > 0 else 0


def _stand_in_norm(bucket: tuple[int, int], dtype) -> float:
    """A 1-norm inside the bucket's interval, away from its ends."""
    thetas, (i, s) = _THETAS[dtype], bucket
    if i == 0:
        return thetas[0] / 2
    if i < 5:
        return (thetas[i - 1] + thetas[i]) / 2
    if s == 0:
        return (thetas[4] + thetas[5]) / 2
    return thetas[5] * 2 ** (s - 1) * 1.5


def _kernel_allocations(shape: tuple, dtype, buckets: tuple) -> tuple | None:
    """The allocator's events inside linalg_matrix_exp on a stand-in of `shape` whose matrices
    fall in `buckets`: ((size, key), ...) with key the allocation's index, negative sizes for
    frees; None where a profiler is already running (a second one cannot start)."""
    if profiler_running():
        return None
    return _measured(shape, dtype, buckets)


@functools.cache
def _measured(shape: tuple, dtype, buckets: tuple) -> tuple:
    """Cached: a pure function of its arguments and this torch, so two profiles in one process
    see the same answer."""
    n = shape[-1]
    norms = torch.tensor([_stand_in_norm(b, dtype) for b in buckets], dtype=dtype)
    # every column of ones/n sums to 1: the 1-norm of each matrix is its factor
    a = (torch.full((len(buckets), n, n), 1.0 / n, dtype=dtype) * norms.view(-1, 1, 1))
    a = a.reshape(shape)
    events = profiler_event_types()
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        result = aten.linalg_matrix_exp.default(a)
        del result
    found: list = []

    def walk(e, inside):
        if e.tag == events.Allocation and inside:
            f = e.extra_fields
            found.append((e.start_time_ns, f.alloc_size, f.ptr))
        inside = inside or (e.tag == events.TorchOp and e.name == "aten::linalg_matrix_exp")
        for c in e.children:
            walk(c, inside)

    for root in profiler_event_tree(prof):
        walk(root, False)
    walk = None  # noqa: F841 - break its self-reference while the session's events are alive
    found.sort(key=lambda r: r[0])
    live, steps = {}, []
    for k, (_, size, ptr) in enumerate(found):
        if size > 0:
            live[ptr] = k
            steps.append((size, k))
        elif ptr in live:
            steps.append((size, live.pop(ptr)))
    return tuple(steps)


def _steps(events) -> list:
    """Alloc/Free steps; the one allocation never freed inside the op is its result."""
    freed = {k for size, k in events if size < 0}
    kept = [k for size, k in events if size > 0 and k not in freed]
    steps = []
    for size, k in events:
        if size > 0 and k == kept[-1]:
            steps.append(Output(0))
        elif size > 0:
            steps.append(Alloc(f"mexp {k}", size))
        else:
            steps.append(Free(f"mexp {k}"))
    return steps


def _user_line(ctx) -> str:
    """The user's source line of the op (in the backward, of the forward op it differentiates)."""
    frame = ctx.where() if ctx.where is not None else None
    if frame is not None:
        return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "linalg_matrix_exp in the " + ("backward" if ctx.node is not None else "forward")


@RULES.register(WORKSPACE, aten.linalg_matrix_exp.default, devices={"cpu"},
                source="aten/src/ATen/native/LinearAlgebra.cpp (mexp_impl, compute_T1..T18, "
                       "compute_T18_scale_square)",
                test="tests/test_linalg_memory.py::test_matrix_exp_matches_the_allocator")
def matrix_exp_temporaries(ctx, func, args, kwargs, out):
    a = args[0]
    n = a.shape[-1] if a.dim() >= 2 else 0
    if n <= 1 or a.numel() == 0:
        return None  # a.clone() / a.exp(): its output only
    name = "linalg_matrix_exp"
    if a.dtype not in _THETAS:
        ctx.note("matrix function temporaries", f"{name} of {a.dtype}: the buffers its CPU "
                 "kernel allocates inside itself are not counted (an estimate)")
        return None
    if a.numel() * a.dtype.itemsize > _MEASURE_LIMIT:
        ctx.note("matrix function temporaries", f"{name} of a {tuple(a.shape)} input: its "
                 "Taylor buffers are not counted (the stand-in run is too large; an estimate)")
        return None
    known = ctx.values.value(a) if ctx.values is not None else None
    if known is not None:
        norms = known[0].reshape(-1, n, n).abs().sum(-2).amax(-1).tolist()
        buckets = tuple(_bucket(x, a.dtype) for x in norms)
    else:
        buckets = (_ASSUMED,) * (a.numel() // (n * n))
        theta = _THETAS[a.dtype][5]
        detail = (f"the 1-norm of each {n} x {n} matrix linalg_matrix_exp exponentiates is taken "
                  f"above {2 * theta:.3g} (its values are unknown): the degree-18 Taylor "
                  "approximation with two or more squarings, the most memory any norm takes; a "
                  "smaller norm allocates less")
        if ctx.values is not None:
            ctx.values.assume("matrix norm", _user_line(ctx), detail)
        else:
            ctx.note("matrix function temporaries", f"{name}: {detail}")
    # the stand-in is a plain CPU tensor: no fake mode, dispatch mode or function mode sees it
    with unset_fake_temporarily(), disable_current_modes(), disable_torch_function():
        events = _kernel_allocations(tuple(a.shape), a.dtype, buckets)
    if events is None:
        ctx.note("matrix function temporaries", f"{name}: not measured while a profiler runs; "
                 "its Taylor buffers are not counted (an estimate)")
        return None
    return _steps(events)
