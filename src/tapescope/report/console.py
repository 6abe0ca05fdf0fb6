"""Terminal views of a Profile, rendered with rich."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..capture.records import CATEGORIES
from .text import fmt_bytes, fmt_flops

__all__ = ["render_summary", "render_ops"]


def _mod(m) -> str:
    return "(root)" if m == "" else ("-" if m is None else m)


def _pattern(m: str) -> str:
    """'h.3.mlp.c_fc' -> 'h.*.mlp.c_fc': repeated blocks add up in the FLOPs table."""
    return ".".join("*" if part.isdigit() else part for part in m.split("."))


def _header(p) -> Text:
    f = p.facts
    opt = f.get("optimizer")
    precision = p.dtype or "model dtype"
    if f.get("amp"):
        precision += f" + autocast {f['amp']}"
    bits = [p.model, p.device, precision,
            " × ".join("x".join(str(s) for s in i["shape"]) for i in p.inputs if isinstance(i, dict)) or "-",
            f"{opt['name']} ({opt['implementation']})" if opt else "no optimizer",
            f"{f.get('parameters', 0) / 1e6:.1f}M parameters"]
    return Text(" · ".join(bits), style="bold")


def render_summary(p, console: Console, top: int = 8) -> None:
    mem = p.memory
    console.print(_header(p))
    which = "steady state (step 2, optimizer state alive)" if p.steps == 2 else "first step"
    console.print(f"[bold]Peak memory[/] [bold cyan]{fmt_bytes(mem.peak_bytes)}[/] — {which}; "
                  f"first step {fmt_bytes(p.first_step_peak_bytes)}")
    if p.ops:
        op = p.ops[mem.peak_op]
        where = f" at {op.source.filename.rsplit('/', 1)[-1]}:{op.source.lineno}" if op.source else ""
        console.print(f"  reached at op {op.index} [bold]{op.name}[/] ({op.phase}) in module "
                      f"{_mod(op.module)}{where}")
    cats = Table(box=None, show_header=False, pad_edge=False)
    for c in CATEGORIES:
        b = mem.at_peak.get(c, 0)
        if b:
            share = b / mem.peak_bytes if mem.peak_bytes else 0
            cats.add_row(f"  {c}", fmt_bytes(b), f"{share:6.1%}")
    console.print(cats)

    live = Table(title="Largest tensors alive at the peak", title_justify="left", box=None)
    for col in ("bytes", "category", "made by", "module", "source"):
        live.add_column(col, overflow="fold")
    for t in mem.live_at_peak[:top]:
        src = t.source.rsplit("/", 1)[-1] if t.source else (t.owner or "")
        live.add_row(fmt_bytes(t.nbytes), t.category,
                     f"#{t.op} {t.op_name}" if t.op is not None else "before the step",
                     _mod(t.module) if t.op is not None else (t.owner or "-"), src)
    console.print(live)

    fl = p.flops
    console.print("[bold]FLOPs[/] " + " | ".join(f"{k} {fmt_flops(fl[k])}" for k in
                                                  ("forward", "backward", "optimizer", "total")))
    if p.gpu is not None:
        cm, t = p.cuda_memory, p.time
        verdict = "[red]does not fit[/]" if cm.oom else "fits"
        console.print(f"[bold]On {p.gpu.name}[/]: max_memory_allocated {fmt_bytes(cm.max_allocated)}, "
                      f"max_memory_reserved {fmt_bytes(cm.max_reserved)}, nvidia-smi about "
                      f"{fmt_bytes(cm.nvidia_smi)} of {fmt_bytes(cm.capacity)}: {verdict}")
        phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.by_phase.items())
        console.print(f"  step time {t.seconds * 1e3:.1f} ms ({phases}; {t.bound}-bound), MFU "
                      f"{t.mfu:.0%}" + ("" if t.calibrated else
                                        " [dim](timing constants not yet calibrated on a GPU)[/]"))

    mods = Table(title="Top modules by memory", title_justify="left", box=None)
    for col in ("module", "peak while running", "saved for backward"):
        mods.add_column(col)
    shown = [m for m in mem.modules if m.module not in ("",)][:top]
    for m in shown:
        mods.add_row(_mod(m.module), fmt_bytes(m.peak_bytes), fmt_bytes(m.saved_bytes))
    by_flops = Table(title="Top modules by FLOPs (their own ops; repeated blocks summed)",
                     title_justify="left", box=None)
    for col in ("module", "instances", "FLOPs (fwd+bwd+opt)", "share"):
        by_flops.add_column(col)
    total = fl["total"] or 1
    own: dict = {}
    for op in p.ops:
        if op.flops and op.module is not None:
            own.setdefault(_pattern(op.module), {}).setdefault(op.module, 0)
            own[_pattern(op.module)][op.module] += op.flops
    ranked = sorted(own.items(), key=lambda kv: -sum(kv[1].values()))
    for pattern, per in ranked[:top]:
        v = sum(per.values())
        by_flops.add_row(_mod(pattern), str(len(per)), fmt_flops(v), f"{v / total:.1%}")
    console.print(Group(mods, by_flops))

    if p.uncounted_ops:
        console.print("[yellow]Ops without a FLOP formula[/] (not in the totals): " + ", ".join(
            f"{k} ×{v}" for k, v in sorted(p.uncounted_ops.items())))
    else:
        console.print("Every op has a FLOP formula.")


def render_ops(p, console: Console, phases=("forward", "backward")) -> None:
    """The forward<->backward table of the AOTAutograd seq_nr commit: SeqNr|OrigAten|SrcFn, forward
    rows then backward rows, plus the autograd node, FLOPs and whether autograd saved the output."""
    console.print("SeqNr|OrigAten|SrcFn|Node|FLOPs|Saved", highlight=False, soft_wrap=True)
    for op in p.ops:
        if op.phase not in phases:
            continue
        seq = "" if op.seq_nr is None else str(op.seq_nr)
        module = "" if op.module is None else _mod(op.module)
        console.print(f"{seq}|{op.name}|{module}|{op.autograd_node or ''}|"
                      f"{op.flops if op.flops is not None else '?'}|{'saved' if op.saved else ''}",
                      highlight=False, soft_wrap=True, markup=False)
