"""Plain-text views of a Profile (the CLI renders richer ones)."""
from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_flops", "fmt_count", "short_op", "summary_text", "ops_table_text",
           "assumption_lines"]


def fmt_bytes(n) -> str:
    if not isinstance(n, int):
        return str(n)
    for unit, size in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30),
                       ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt_flops(n) -> str:
    if n is None:
        return "-"
    if not isinstance(n, int):
        return str(n)
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} FLOP"


def fmt_count(n) -> str:
    """20480 -> '20.5k', 124_439_808 -> '124.4M', 6.7e9 -> '6.7B' (three significant digits)."""
    if not isinstance(n, int):
        return str(n)
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def short_op(name: str | None) -> str:
    """'aten._log_softmax.default' -> '_log_softmax': the op, without namespace and overload
    (kept when it tells two overloads apart: 'add.Tensor')."""
    if not name:
        return ""
    ns, _, rest = name.partition(".")
    if ns != "aten" or not rest:
        return name
    base, _, overload = rest.rpartition(".")
    return base if overload == "default" else rest


def summary_text(p) -> str:
    lines = [f"{p.model} on {p.device}: peak {fmt_bytes(p.peak_bytes)} (first step {fmt_bytes(p.first_step_peak_bytes)})"]
    peak = p.ops[p.memory.peak_op] if p.ops else None
    if peak:
        lines.append(f"  peak at op {peak.index} {peak.name} ({peak.phase}, {peak.module})")
    for c, b in p.memory.at_peak.items():
        if b:
            lines.append(f"  {c:>18}: {fmt_bytes(b)}")
    lines += ["  " + line for line in assumption_lines(p)]
    lines.append("  FLOPs: " + ", ".join(f"{k} {fmt_flops(v)}" for k, v in p.flops.items()))
    if p.uncounted_ops:
        lines.append("  uncounted ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(p.uncounted_ops.items())))
    if p.compiled is not None:
        c = p.compiled
        lines.append(f"  compiled ({c.regions} graph{'s' if c.regions != 1 else ''}, "
                     f"{len(c.graph_breaks)} graph breaks) vs eager: peak "
                     f"{fmt_bytes(p.peak_bytes)} vs {fmt_bytes(p.eager.peak_bytes)}; saves "
                     f"{fmt_bytes(c.saved_bytes)}, recomputes {len(c.recomputed)} ops "
                     f"({fmt_flops(c.recompute_flops)})")
    return "\n".join(lines)


def ops_table_text(p) -> str:
    rows = ["SeqNr|OrigAten|SrcFn"]
    for op in p.ops:
        if op.phase == "optimizer":
            continue
        rows.append(f"{'' if op.seq_nr is None else op.seq_nr}|{op.name}|{op.module or ''}")
    return "\n".join(rows)


def assumption_lines(p) -> list[str]:
    """What the profile assumed about sizes that depend on tensor values, and the peak as their
    formula (analysis.data_sizes); nothing when it assumed nothing."""
    lines = [f"Not used: {u}" for u in p.run.sizes_unused or ()]
    ds = p.data_sizes
    if ds is None:
        return lines
    for a in ds.assumptions:
        tail = "" if a.decided else "; no size of this step depends on it"
        lines.append(f"Assumed at {a.where}: {a.detail}{tail}")
    for s in ds.sizes:
        how = ("pinned: the code loops or branches on it" if s.pinned else
               "a symbol of the formulas")
        lines.append(f"Size decided by data: {s.name} = {s.value} ({s.op} at {s.where}; {how})")
    if ds.peak is not None and ds.peak.free_symbols:
        names = ", ".join(sorted(str(x) for x in ds.peak.free_symbols))
        lines.append(f"Peak near these values = {ds.peak} bytes (p.at({names}=...) evaluates it)")
    elif ds.sizes:
        lines.append("Peak near these values does not depend on them")
    return lines
