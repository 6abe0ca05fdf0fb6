"""What fits: the largest batch (or sequence length) whose training step fits a memory budget.

One symbolic trace gives the step's peak memory as a formula of the dimension; a binary search over
that formula finds the largest size within budget in microseconds per probe. Sizes outside the range
where the formula holds (a guard such as seq <= block_size, or a dimension the model pinned) are
traced concretely instead.

The default budget is the GPU's memory less the CUDA context (devices.gpus.cuda_context_bytes,
the one model of it that the allocator prediction uses too) and 10% for the caching allocator's
rounding and fragmentation, which the predicted allocated bytes do not include.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from .api import profile_workload
from .errors import TapescopeError
from .options import Options, Workload

__all__ = ["FitResult", "fit", "fit_workload", "sweep", "parse_bytes", "parse_sweep",
           "default_budget", "large_size_formula", "ALLOCATOR_SLACK", "SEARCH_LIMIT"]

ALLOCATOR_SLACK = 0.10
# The search doubles the size until the step no longer fits; a step whose peak does not grow with
# the size fits at every size, and the search says so when it reaches this one.
SEARCH_LIMIT = 1 << 62

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40}


def parse_bytes(text) -> int:
    """'24GiB', '80GB', '80e9', 1e9 -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if math.isfinite(text) and text >= 1:
            return int(text)
        raise TapescopeError(f"a memory size must be a number of bytes >= 1, got {text!r}")
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    try:
        n = int(float(m[1]) * _UNITS[m[2].lower()]) if m else None
    except (ValueError, KeyError, OverflowError):
        n = None
    if n is None or n <= 0:
        raise TapescopeError(f"cannot read a memory size from {text!r}; write e.g. 24GiB or 80GB")
    return n


def parse_sweep(text: str) -> tuple[int, int]:
    """'1..4096' -> (1, 4096); '64' -> (64, 64)."""
    a, _, b = str(text).partition("..")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise TapescopeError(f"--sweep takes A..B with 1 <= A <= B, e.g. 1..4096, not {text!r}")
    return lo, hi


def default_budget(gpu) -> int:
    from .devices.gpus import usable_memory_bytes

    return int(usable_memory_bytes(gpu) / (1 + ALLOCATOR_SLACK))


def _budget_note(gpu) -> str:
    from .devices.gpus import cuda_context_bytes
    from .report.text import fmt_bytes

    return (f"{gpu.name} memory less {fmt_bytes(cuda_context_bytes(gpu))} for the CUDA context "
            f"and {ALLOCATOR_SLACK:.0%} for the caching allocator")


@dataclass
class FitResult:
    dim: str
    value: int | None        # the largest size that fits (None: not even the smallest)
    peak_bytes: int | None   # its predicted peak
    budget: int
    next_peak: int | None    # the peak at value + 1 (or at the smallest size when nothing fits)
    limit: int | None        # the largest size the model accepts (a guard), if any
    profile: object          # the symbolic Profile the search used
    probes: list             # (size, peak) pairs evaluated
    budget_note: str = ""    # where the budget comes from, when it was not given
    search_limit: int = SEARCH_LIMIT   # the largest size the search tries
    reached_search_limit: bool = False  # every size up to search_limit fits

    @property
    def headroom(self) -> int | None:
        return None if self.peak_bytes is None else self.budget - self.peak_bytes


def fit(model, *inputs, budget=None, gpu=None, dim: str = "batch", low: int = 1,
        high: int = SEARCH_LIMIT, input_kwargs=None, name=None, progress=None, **options) -> FitResult:
    """Largest `dim` ("batch" or "seq") whose predicted peak fits `budget` (or `gpu`'s memory).

    Other arguments are profile()'s. The other named dimensions keep the sizes the inputs give.
    """
    opts = Options.create(gpu=gpu, **options)
    return fit_workload(Workload(model, tuple(inputs), dict(input_kwargs or {}), name), opts,
                        budget=budget, dim=dim, low=low, high=high, progress=progress)


def fit_workload(workload: Workload, options: Options, *, budget=None, dim: str = "batch",
                 low: int = 1, high: int = SEARCH_LIMIT, progress=None) -> FitResult:
    note = ""
    if budget is None:
        if options.gpu is None:
            raise TapescopeError("give a budget (e.g. '24GiB') or a GPU (e.g. 'h100')")
        budget, note = default_budget(options.gpu), _budget_note(options.gpu)
    budget = parse_bytes(budget)
    if dim not in ("batch", "seq"):
        raise TapescopeError(f"fit searches 'batch' or 'seq', not {dim!r}")
    p = profile_workload(workload, replace(options, symbolic=(dim,)), progress)
    sp = p.symbolic
    lo_ok, hi_ok = sp.ranges[dim]
    limit = hi_ok
    high = min(high, hi_ok) if hi_ok is not None else high
    probes: list = []

    def peak(n: int) -> int:
        e = p.at(**{dim: n})
        v = max(e.peak_bytes, e.first_step_peak_bytes)
        probes.append((n, v))
        return v

    if peak(low) > budget:
        return FitResult(dim, None, None, budget, probes[-1][1], limit, p, probes, note)
    # peak grows with the size: double until it does not fit (or the limit), then bisect
    good, bad = low, None
    n = max(low + 1, 2)
    while n <= high:
        if peak(n) <= budget:
            good, n = n, n * 2
        else:
            bad = n
            break
    if bad is None:
        if good < high and peak(high) <= budget:
            good = high
        elif good < high:
            bad = high
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            if peak(mid) <= budget:
                good = mid
            else:
                bad = mid
    at_good = dict(probes)[good] if good in dict(probes) else peak(good)
    nxt = None if good >= high and bad is None else (dict(probes).get(good + 1) or peak(good + 1))
    return FitResult(dim, good, at_good, budget, nxt, limit, p, probes, note, high,
                     reached_search_limit=good >= high and (limit is None or high < limit))


def large_size_formula(r: FitResult):
    """The peak's formula that holds for large sizes of the searched dimension (analysis/symbolic.py
    SymbolicProfile.large_size_peak_expr)."""
    return r.profile.symbolic.large_size_peak_expr(r.dim)


def sweep(r: FitResult, lo: int, hi: int) -> list[tuple[int, int]]:
    """(size, peak) for powers of two from lo to hi (and the fitting size and the next), within
    the range the model accepts; the peak is the larger of the first and steady steps'."""
    sp = r.profile.symbolic
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n)
        n *= 2
    if r.value and lo <= r.value <= hi:
        sizes = sorted(set(sizes) | {r.value, r.value + 1})
    out = []
    for n in sizes:
        if sp.ranges[r.dim][1] is not None and n > sp.ranges[r.dim][1]:
            continue
        e = r.profile.at(**{r.dim: n})
        out.append((n, max(e.peak_bytes, e.first_step_peak_bytes)))
    return out
