"""The profile as JSON-ready data (`Profile.to_dict`, the CLI's --json)."""

from __future__ import annotations

import torch

__all__ = ["profile_dict"]


def _n(x):
    """Exact ints stay ints; symbolic sizes become their text."""
    return x if x is None or isinstance(x, (int, float)) else str(x)


def profile_dict(p, with_ops: bool = True, with_timeline: bool = True) -> dict:
    from ..version import __version__

    d = {
        "tapescope_version": __version__, "torch_version": torch.__version__,
        "model": p.model, "device": p.device, "dtype": p.dtype,
        "inputs": p.inputs, "steps": p.steps,
        "peak_bytes": _n(p.peak_bytes), "first_step_peak_bytes": _n(p.first_step_peak_bytes),
        "flops": {k: _n(v) for k, v in p.flops.items()},
        "recompute_flops": _n(p.recompute_flops),
        "uncounted_ops": p.uncounted_ops,
        "facts": dict(p.facts),
        "memory": p.memory.to_dict(with_timeline),
        "first_step_memory": p.first_step_memory.to_dict(False),
        "module_flops": {k: _n(v) for k, v in p.module_flops.items()},
    }
    if p.gpu is not None:
        d["gpu"] = {"key": p.gpu.key, "name": p.gpu.name}
    cm = p.cuda_memory
    if cm is not None:
        d["cuda_memory"] = {k: getattr(cm, k) for k in (
            "max_allocated", "max_reserved", "steady_allocated", "steady_reserved",
            "fragmentation", "context_bytes", "capacity", "oom", "oom_at")}
        d["cuda_memory"]["nvidia_smi"] = cm.nvidia_smi
        d["cuda_memory"]["allocator_settings"] = cm.settings
        if cm.stream_cached:
            d["cuda_memory"]["stream_cached"] = cm.stream_cached
    if p.time is not None:
        d["time"] = p.time.to_dict()
    if p.symbolic is not None:
        sp = p.symbolic
        d["symbolic"] = {"dims": list(sp.names), "ranges": sp.ranges,
                         "peak_bytes": str(sp.peak_expr()),
                         "flops": {k: str(v) for k, v in sp.flops.items()},
                         "guards": [g.__dict__ for g in sp.guards],
                         "specialized": sp.specialized, "fitted": sp.fitted}
    if p.compiled is not None:
        from ..analysis.compiled import side_by_side

        d["compiled"] = p.compiled.to_dict()
        d["eager"] = profile_dict(p.eager, with_ops=False, with_timeline=False)
        d["eager_vs_compiled"] = {k: {"eager": _n(e), "compiled": _n(c)}
                                  for k, (e, c) in side_by_side(p.eager, p).items()}
        if "time_seconds" in d["eager_vs_compiled"]:
            from ..analysis.compiled import speedup

            d["eager_vs_compiled"]["time_seconds"]["speedup"] = speedup(p.eager, p)
    if p.ranks is not None:
        d["distributed"] = p.distributed.to_dict()
        d["ranks"] = [r.to_dict() for r in p.ranks]
        d["collectives"] = [row.to_dict() for row in p.collective_table]
    if with_ops:
        d["ops"] = [op.to_dict() for op in p.ops]
    return d


def to_jsonable(x):
    """Plain JSON data from results: dataclasses by field, sequences and dicts by item,
    exact integers as numbers, anything else (dtypes, devices, symbolic sizes) as its text."""
    import dataclasses

    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: to_jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)
                if f.repr}
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in x]
    return str(x)


def ops_dict(p, phases) -> dict:
    """`tapescope ops --json`: the op table of the phases shown."""
    return {"model": p.model, "device": p.device,
            "ops": [op.to_dict() for op in p.ops if op.phase in phases]}


def diff_dict(a, b, d) -> dict:
    """`tapescope diff --json`: both steps' totals and each difference with its reasons."""
    def side(p):
        return {"device": p.device, "ops": len(p.ops), "peak_bytes": _n(p.peak_bytes),
                "at_peak": {k: _n(v) for k, v in p.memory.at_peak.items()},
                "flops": {k: _n(v) for k, v in p.flops.items()}}

    return {"model": a.model, "a": side(a), "b": side(b), "same_ops": d.same_ops,
            "differences": to_jsonable(d.hunks)}


def fit_dict(r, name: str, options, sweep_rows=None) -> dict:
    """`tapescope fit --json`: the answer, the budget, the formula and the probes."""
    sp = r.profile.symbolic
    return {
        "model": name, "device": str(options.device),
        "gpu": None if options.gpu is None else options.gpu.name,
        "dim": r.dim, "fits": r.value is not None, "largest": r.value,
        "peak_bytes": r.peak_bytes, "budget_bytes": r.budget, "budget_note": r.budget_note,
        "next_peak_bytes": r.next_peak, "limit": r.limit, "search_limit": r.search_limit,
        "reached_search_limit": r.reached_search_limit,
        "inputs": r.profile.inputs,
        "peak_formula_for_large_size": str(sp.large_size_peak_expr(r.dim)),
        "peak_formula": str(sp.peak_expr()),
        "ranges": to_jsonable(sp.ranges),
        "guards": [to_jsonable(g) for g in sp.guards],
        "probes": [list(x) for x in r.probes],
        "sweep": None if sweep_rows is None else [list(x) for x in sweep_rows],
    }
