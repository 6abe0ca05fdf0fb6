"""The report's optional tables as plain rows of text, written once for the console and the HTML page.

A profile that is distributed (every rank's memory, the collectives), checkpointed (what the
backward recomputes, the policies applied) or compiled (eager against torch.compile, what the
partitioner saved) has tables a plain step has not. Each is a `Section`: a title, lines of prose,
column names and rows of already formatted cells. The console prints them with rich
(console.py), the HTML page draws them from the page's data (page_data.py, report.js): the same
figures in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .text import fmt_bytes, fmt_flops

__all__ = ["Section", "checkpointing_sections", "compiled_sections", "distributed_sections",
           "optional_sections"]


@dataclass(frozen=True)
class Section:
    title: str
    lines: tuple = ()      # prose before the table
    columns: tuple = ()    # column names; none: prose only
    rows: tuple = ()       # tuples of cells (strings), one per column
    after: tuple = ()      # prose after the table

    def to_dict(self) -> dict:
        return {"title": self.title, "lines": list(self.lines), "columns": list(self.columns),
                "rows": [list(r) for r in self.rows], "after": list(self.after)}


def ranks_text(ranks) -> str:
    """(0, 1, 2, 5) -> '0-2, 5'"""
    out, start, prev = [], None, None
    for r in list(ranks) + [None]:
        if start is None:
            start = prev = r
        elif r is not None and r == prev + 1:
            prev = r
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = r
    return ", ".join(out)


def distributed_sections(p, top: int = 8) -> list[Section]:
    """Every rank's memory and step time, and rank 0's collectives (a distributed profile)."""
    d = p.distributed
    if d is None or p.ranks is None:  # one rank's profile inside a job: the job's says this
        return []
    classes = d.classes
    how = "ranks whose shards have the same shapes run the same step: one trace each" \
        if classes.provable else "which ranks run the same step could not be proven: every rank traced"
    by = d.parallelize
    by = "its pipeline stages alone" if by in (None, "None") else by
    mesh = (f"Mesh {d.mesh} = {d.mesh.world_size} ranks, parallelised by "
            f"{by}; {len(classes.members)} traced ({how})")
    by_rank = {r.rank: r for r in p.ranks}
    timed = any(r.step_seconds is not None for r in p.ranks)
    rows = []
    for members in classes.members:
        r = by_rank[members[0]]
        cats = sorted(r.at_peak.items(), key=lambda kv: -kv[1])[:4]
        times = (f"{r.step_seconds * 1e3:.1f} ms", f"{r.mfu:.0%}") if timed else ()
        rows.append((ranks_text(members), fmt_bytes(r.peak_bytes),
                     fmt_bytes(r.first_step_peak_bytes), *times,
                     ", ".join(f"{c} {fmt_bytes(b)}" for c, b in cats)))
    out = [Section("Per rank", (mesh,),
                   ("ranks", "peak (steady)", "first step") + (("step", "MFU") if timed else ())
                   + ("largest categories at the peak",), tuple(rows))]
    coll = p.collective_table
    if coll:
        rows = [(r.kind, r.group, str(r.group_size), fmt_bytes(r.nbytes), str(r.count), r.link,
                 f"{r.seconds * 1e3:.2f} ms" if p.gpu is not None else "-") for r in coll[:top]]
        if len(coll) > top:
            rows.append((f"... {len(coll) - top} more", "", "", "", "", "", ""))
        tm = p.time
        after = (f"collectives {tm.comm * 1e3:.1f} ms on the interconnect, "
                 f"{tm.exposed_comm * 1e3:.1f} ms exposed ({tm.comm_overlap:.0%} overlapped "
                 f"with compute); per-rank step {tm.seconds * 1e3:.1f} ms, MFU {tm.mfu:.0%}"
                 + (f" (step time error: {tm.band.text()})" if tm.band is not None else ""),) \
            if tm is not None and tm.comm else ()
        out.append(Section(f"Collectives of rank {d.rank} per step", (),
                           ("kind", "mesh dim", "ranks", "bytes per rank", "count", "link", "time"),
                           tuple(rows), after))
    if d.pipeline is not None:
        out.append(pipeline_section(d.pipeline))
    return out


def pipeline_section(pl) -> Section:
    """Each pipeline stage's peak, what it holds, its in-flight micro-batches and its bubble;
    why the highest is highest; the step's time when the stages run together."""
    plan, timed = pl.plan, pl.time is not None
    rows = []
    for r in pl.ranks:
        rows.append((str(r.pp_rank), ", ".join(map(str, r.stages)), fmt_bytes(r.peak_bytes),
                     "-" if r.in_flight is None else
                     f"{r.in_flight} micro-batch{'es' if r.in_flight != 1 else ''}"
                     # several stages a rank (interleaved, V): a micro-batch counts once a stage
                     + (f" in {len(r.stages)} stages" if len(r.stages) > 1 else ""),
                     fmt_bytes(r.at_peak.get("saved activations", 0)),
                     fmt_bytes(r.at_peak.get("parameters", 0)
                               + r.at_peak.get("sharded parameters", 0)),
                     *((f"{pl.time.bubble.get(r.pp_rank, 0):.0%}",) if timed else ())))
    after = []
    top, why, _ = pl.highest()
    low = min(pl.ranks, key=lambda r: r.peak_bytes)
    if why is not None and top is not low:
        held = ""
        if top.in_flight is not None and low.in_flight is not None \
                and top.in_flight > low.in_flight:
            held = (f": it holds {top.in_flight} micro-batches' activations in flight where pp "
                    f"rank {low.pp_rank} holds {low.in_flight}")
        diffs = sorted(((v - low.at_peak.get(k, 0), k) for k, v in top.at_peak.items()),
                       reverse=True)[:2]
        parts = ", ".join(f"{k} +{fmt_bytes(d)}" for d, k in diffs if d > 0)
        after.append(f"pp rank {top.pp_rank} is highest ({fmt_bytes(top.peak_bytes)}, pp rank "
                     f"{low.pp_rank} {fmt_bytes(low.peak_bytes)}){held}; at the peaks: {parts}")
    if timed:
        after.append(f"step {pl.time.seconds * 1e3:.1f} ms with the stages running together "
                     "(each stage's traced forward and backward, and the schedule's waits)")
    return Section(f"Pipeline {plan.spec.schedule}, {plan.num_stages} stages on {plan.pp} ranks, "
                   f"{plan.microbatches} micro-batches", (),
                   ("pp rank", "stages", "peak", "in flight", "saved activations", "parameters")
                   + (("bubble",) if timed else ()), tuple(rows), tuple(after))


def checkpointing_sections(p) -> list[Section]:
    """What activation checkpointing recomputes in the backward, and the policies applied."""
    recomputed = [op for op in p.ops if op.recompute]
    n_recomputed = sum(op.runs for op in recomputed)
    policies = p.run.checkpointing or ()
    if not recomputed and not policies:
        return []
    lines = (f"activation checkpointing recomputes {n_recomputed} ops in the backward: "
             f"{fmt_flops(p.recompute_flops)} (in the backward's FLOPs)"
             + (f", {p.time.recompute * 1e3:.1f} ms" if p.time is not None else ""),)
    by_module: dict = {}
    for op in recomputed:
        m = op.module or "-"
        n, f = by_module.get(m, (0, 0))
        by_module[m] = (n + op.runs, f + (op.total_flops or 0))
    rows = tuple((m or "(root)", str(n), fmt_flops(f))
                 for m, (n, f) in sorted(by_module.items(), key=lambda kv: -kv[1][1]))
    after = tuple(f"policy: {q['module'] or '(root)'} {q['mode']}"
                  + (f" (keeps {', '.join(q['save_ops'])})" if q.get("save_ops") else "")
                  for q in policies)
    return [Section("Activation checkpointing", lines, ("module", "ops recomputed", "FLOPs"),
                    rows, after)]


def compiled_sections(p, top: int = 8) -> list[Section]:
    """A compiled step beside the eager one; what the partitioner saved and recomputed; graph
    breaks."""
    c = p.compiled
    if c is None:
        return []
    from ..analysis.compiled import side_by_side

    opts = ", ".join(f"{k}={v}" for k, v in c.options.items() if v not in (None, False))
    title = (f"Eager vs torch.compile ({opts or 'defaults'}; {c.regions} compiled "
             f"graph{'s' if c.regions != 1 else ''}, {len(c.graph_breaks)} graph "
             f"break{'s' if len(c.graph_breaks) != 1 else ''})")
    rows = []
    for name, (e, v) in side_by_side(p.eager, p).items():
        if e is None or v is None:
            continue
        fmt = (lambda x: f"{x * 1e3:.2f} ms") if name.startswith("time") else (
            fmt_flops if name.startswith("flops") else fmt_bytes)
        change = f"{(v - e) / e:+.1%}" if isinstance(e, (int, float)) and e else ""
        rows.append((name.replace("_", " "), fmt(e), fmt(v), change))
    acts = [s for s in c.saved if s.is_activation]
    from ..analysis.compiled import speedup

    x = speedup(p.eager, p)
    launched = len(p.compiled_schedule.kernels()) if p.compiled_schedule is not None else 0
    time_line = (f"speed-up on {p.gpu.name}: {x:.2f}x (the compiled step's {launched} generated "
                 "kernels by inductor's bytes and FLOPs, its extern kernels as eager ops)",
                 ) if x is not None else ()
    saved_line = (f"the partitioner saves {len(c.saved)} tensors for the backward "
                  f"({len(acts)} made by the forward, {fmt_bytes(c.saved_bytes)}; the rest are "
                  f"parameters and inputs) and recomputes {len(c.recomputed)} ops "
                  f"({fmt_flops(c.recompute_flops)})")
    saved_rows = tuple(
        (str(s.region), s.name, "x".join(str(x) for x in s.shape), s.dtype,
         fmt_bytes(s.nbytes) if not s.view_of else f"view of {s.view_of}", s.op or "input")
        for s in sorted(acts, key=lambda s: -s.nbytes)[:top])
    real = [r for r in c.recomputed if r.flops]
    after = ((("recomputed in the backward: " + ", ".join(
        f"{r.name} ({r.op}, {fmt_flops(r.flops)})" for r in real[:top])),) if real else ()) + tuple(
        f"graph break at {b.where or '?'}: {b.reason}" for b in c.graph_breaks)
    return [Section(title, (), ("", "eager", "compiled", "change"), tuple(rows),
                    (*time_line, saved_line)),
            Section("Saved for backward (largest first)", (),
                    ("graph", "tensor", "shape", "dtype", "bytes", "made by"), saved_rows, after)]


def optional_sections(p, top: int = 8) -> list[Section]:
    """Every optional table the profile has, in the console's order."""
    return [*checkpointing_sections(p), *distributed_sections(p, top), *compiled_sections(p, top)]
