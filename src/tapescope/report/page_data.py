"""The data the HTML report embeds: a lean, JSON-ready digest of a Profile.

Columns, not records: a 100k-op step is two integer arrays (name id, module id) and two string
tables, not 100k objects with repeated keys. The memory timeline is downsampled (see downsample.py)
with its peak kept exactly. Nothing here is escaped for HTML: the page builds its DOM with
textContent, and html.py escapes the JSON for the <script> element that carries it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

import torch

from ..analysis.modules import ancestors, module_rollup
from ..analysis.ops import param_module
from ..capture.records import ALL_CATEGORIES, BACKWARD, FORWARD, PARAMETER
from .downsample import downsample
from .palette import PHASE_COLORS, category_color
from .phases import phase_runs
from .sections import optional_sections

__all__ = ["page_data", "op_times"]


def page_data(p, max_points: int = 4000) -> dict:
    names, modules = _Interner(), _Interner()
    op_name = [names(op.name) for op in p.ops]
    op_module = [modules(op.module) for op in p.ops]
    times = op_times(p)
    return {
        "meta": _meta(p, times),
        "categories": [{"name": c, "color": category_color(c)} for c in ALL_CATEGORIES],
        "phase_colors": PHASE_COLORS,
        "phases": phase_runs(p.ops),
        "ops": {"name": op_name, "module": op_module, "names": names.table,
                "modules": modules.table},
        "timeline": _timeline(p, max_points, times),
        "peak": _peak(p),
        "live": _live(p),
        "modules": _modules(p, times),
        "fwd_map": _fwd_map(p),
        "uncounted": sorted(([k, v] for k, v in p.uncounted_ops.items()), key=lambda r: (-r[1], r[0])),
        # checkpointing, per-rank and compiled tables: the console's, as text (report/sections.py)
        "sections": [section.to_dict() for section in optional_sections(p)],
    }


class _Interner:
    """Strings -> small ints, so that a repeated op or module name is stored once."""

    def __init__(self):
        self.table: list = []
        self._ids: dict = {}

    def __call__(self, s) -> int:
        i = self._ids.get(s)
        if i is None:
            i = self._ids[s] = len(self.table)
            self.table.append(s)
        return i


def _num(x):
    """JSON-safe number: ints stay exact; symbolic sizes become their text; NaN/inf become None."""
    if x is None or isinstance(x, (bool, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    return str(x)


def op_times(p) -> list | None:
    """Per-op time estimates in seconds, or None when the profile has none.

    Read from the profile's step-time estimate (`p.time`, analysis.timing.StepTime: its per-op
    GPU seconds); the page shows a time column only when there is one (CUDA profiles).
    """
    step_time = p.time
    if step_time is None or len(step_time.op_seconds) != len(p.ops):
        return None
    return list(step_time.op_seconds)


def _time_fact(p, times) -> dict | None:
    """The step's estimated time: the time model's own total (host and GPU overlapped) when it
    gives one, else the sum over ops."""
    if times is None:
        return None
    t = p.time
    return {"seconds": _num(t.seconds), "bound": t.bound or None,
            "mfu": _num(t.mfu) if t.mfu else None, "calibrated": t.calibrated,
            "calibration": t.calibration,
            "error_band": t.band.text() if t.band is not None else None}


def _meta(p, times) -> dict:
    from ..version import __version__

    run = p.run
    counts = dict.fromkeys(("forward", "backward", "optimizer"), 0)
    for op in p.ops:
        counts[op.phase] = counts.get(op.phase, 0) + 1
    gpu = p.gpu.name if p.gpu is not None else None
    cm = p.cuda_memory
    return {
        "model": str(p.model), "device": str(p.device), "dtype": p.dtype, "amp": run.amp,
        "gpu": None if gpu is None else str(gpu),
        "inputs": [i if isinstance(i, Mapping) else {"repr": str(i)} for i in p.inputs],
        "steps": p.steps, "step2": p.trace.step2, "parameters": _num(run.parameters),
        "optimizer": run.optimizer,
        "peak_bytes": _num(p.peak_bytes), "first_step_peak_bytes": _num(p.first_step_peak_bytes),
        "flops": {k: _num(v) for k, v in p.flops.items()},
        "n_ops": len(p.ops), "ops_by_phase": counts,
        "time": _time_fact(p, times),
        "cuda_memory": None if cm is None else {
            "max_allocated": cm.max_allocated, "max_reserved": cm.max_reserved,
            "nvidia_smi": cm.nvidia_smi, "capacity": cm.capacity, "oom": cm.oom,
            "oom_at": cm.oom_at, "settings": cm.settings, "stream_cached": cm.stream_cached},
        "tapescope_version": __version__, "torch_version": torch.__version__,
    }


def _timeline(p, max_points, times=None) -> dict:
    """The chart's points: op indices `x`, and with a time estimate (CUDA profiles) `t`, each
    shown op's start in milliseconds, with `phase_t` (the phases' start and end times) and
    `peak_t`: the page then draws against time, so each phase takes its share of the step's
    time rather than of its op count (an optimizer's many small ops take little)."""
    mem = p.memory
    total = mem.timeline
    keep = [mem.peak_op] if total else []
    idx = downsample(total, max_points, keep)
    series = {}
    for c in ALL_CATEGORIES:
        values = mem.timeline_by_category.get(c)
        if values and any(values):  # a category never alive in the step takes no space
            series[c] = [_num(values[i]) for i in idx]
    out = {"x": idx, "series": series, "n": len(total)}
    if times is not None and total:
        start = [0.0]
        for s in times:
            start.append(start[-1] + s * 1e3)
        out["t"] = [start[i] for i in idx]
        out["t_end"] = start[-1]
        out["phase_t"] = [[ph, start[a], start[b]] for ph, a, b in phase_runs(p.ops)]
        out["peak_t"] = start[mem.peak_op]
    return out


def _peak(p) -> dict:
    mem = p.memory
    return {"op": mem.peak_op if p.ops else None, "bytes": _num(mem.peak_bytes),
            "at_peak": {k: _num(v) for k, v in mem.at_peak.items()},
            "initial_bytes": _num(mem.initial_bytes), "final_bytes": _num(mem.final_bytes)}


def _live(p) -> list:
    """Tensors alive at the peak, repeats grouped (the same size, category, op and line in
    instances of one block, counted over every tensor alive at the peak:
    analysis.memory.group_live_tensors); `bytes` is each one's size."""
    out = []
    for g in p.memory.live_groups:
        t = g.first
        out.append({"bytes": _num(t.nbytes), "count": g.count, "category": t.category,
                    "op": t.op, "op_name": t.op_name,
                    "module": t.module if g.count == 1 else g.module,
                    "owner": t.owner if g.count == 1 else g.owner, "source": t.source})
    return out


def _modules(p, times) -> dict:
    """Module rows: [fqn, first op, parameter bytes, saved bytes, peak bytes, FLOPs, seconds], each
    value including the module's submodules (the page shows them as a tree). The first op that ran
    in a module gives the default order: execution order."""
    rows: dict[str, list] = {}

    def row(fqn):
        r = rows.get(fqn)
        if r is None:
            r = rows[fqn] = [fqn, None, 0, 0, None, 0, None if times is None else 0.0]
            if fqn:  # every ancestor gets a row, so the page can always hang a row on its parent
                row(fqn.rsplit(".", 1)[0] if "." in fqn else "")
        return r

    row("")
    for op in p.ops:
        if op.module is not None:
            for m in ancestors(op.module):
                r = row(m)
                if r[1] is not None:
                    break  # its ancestors ran earlier still
                r[1] = op.index
    for fqn, nbytes in _parameter_bytes(p).items():
        for m in ancestors(fqn):
            row(m)[2] += nbytes
    for mm in p.memory.modules:
        r = row(mm.module)
        r[3], r[4] = _num(mm.saved_bytes), _num(mm.peak_bytes)
    for fqn, flops in p.module_flops.items():
        row(fqn)[5] = _num(flops)
    if times is not None:
        for fqn, t in module_rollup(p.ops, lambda op: times[op.index]).items():
            row(fqn)[6] = t
    columns = ["module", "first_op", "parameters", "saved", "peak", "flops", "time_s"]
    return {"columns": columns, "has_time": times is not None,
            "rows": [[_num(v) if k else v for k, v in enumerate(r)] for r in rows.values()]}


def _parameter_bytes(p) -> dict:
    """Owning module fqn -> bytes of its own parameters (each storage once: tied weights count once)."""
    out: dict[str, int] = defaultdict(int)
    trace = getattr(p, "trace", None)
    if trace is None:
        return out
    for s in trace.storages:
        fqn = trace.storage_owner.get(s.id)
        if fqn is not None and PARAMETER in s.roles:
            out[param_module(fqn)] += s.nbytes
    return out


def _fwd_map(p) -> dict:
    """For each forward op that created an autograd node: [op, node id, [backward ops]]; and the
    backward ops that no forward op explains."""
    nodes = _Interner()
    bwd: dict[int, list] = defaultdict(list)
    for op in p.ops:
        if op.phase == BACKWARD and op.forward_op is not None:
            bwd[op.forward_op].append(op.index)
    rows = [[op.index, nodes(op.autograd_node), bwd.get(op.index, [])]
            for op in p.ops if op.phase == FORWARD and op.autograd_node is not None]
    return {"rows": rows, "nodes": nodes.table, "unmapped": _unmapped_backward(p)}


def _unmapped_backward(p) -> list:
    """Backward ops that no forward op explains (gradient accumulation, ...): [name, count]."""
    counts: dict[str, int] = defaultdict(int)
    for op in p.ops:
        if op.phase == BACKWARD and op.forward_op is None:
            counts[op.name] += 1
    return sorted(([k, v] for k, v in counts.items()), key=lambda r: (-r[1], r[0]))
