"""`tapescope search`'s text: the ranked table, the candidates that do not fit and why, how many
the traces ruled out, and the winner as commands to run."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .text import fmt_bytes

__all__ = ["render_search", "progress_line"]


def _rate(o) -> str:
    text = f"{o.tokens_per_second:,.0f}"
    if o.step_band:  # the time model's band on the step: tokens/s the other way round
        lo, hi = o.step_band
        text += f" ({o.tokens_per_second * o.step_seconds / hi:,.0f}-" \
                f"{o.tokens_per_second * o.step_seconds / lo:,.0f})"
    return text


def render_search(r, console: Console, top: int = 10, commands: dict | None = None) -> None:
    """`r` a layout_search.SearchResult; `commands` the winner's (layout_search.winner_commands):
    tapescope, torchtitan_toml, torchtitan_command."""
    s = r.space
    console.print(Text.assemble((r.source.spec, "bold"),
                                f" on {s.gpus} x {r.source.gpu}, global batch {s.global_batch}"
                                + (f" x {r.source.seq} tokens" if r.source.seq else "")
                                + (f", {r.source.amp} mixed precision" if r.source.amp else "")))
    bounded = len(getattr(r, "bounds", {}) or {})
    console.print(f"  {len(r.outcomes)} candidates traced on every rank class, {len(r.pruned)} "
                  f"ruled out by those traces"
                  + (f" ({bounded} provably slower than the top {r.top})" if bounded else "")
                  + f", {len(r.skipped)} outside the limits; {r.seconds:.1f} s on {r.workers}",
                  highlight=False, markup=False)
    ranked = r.ranked
    t = Table(box=None, title=f"Fits on every rank, fastest first (top {min(top, len(ranked))} of "
              f"{len(ranked)})", title_justify="left")
    for h in ("#", "candidate", "tokens/s", "MFU", "step", "nvidia-smi/rank", "headroom",
              "exposed comm", "bubble"):
        t.add_column(h, no_wrap=h != "candidate")
    for i, o in enumerate(ranked[:top], 1):
        w = o.worst
        t.add_row(str(i), o.candidate.label(), _rate(o), f"{o.mfu:.0%}" if o.mfu else "-",
                  f"{o.step_seconds * 1e3:,.0f} ms", fmt_bytes(w.reserved_bytes),
                  fmt_bytes(w.headroom),
                  f"{o.exposed_comm_seconds * 1e3:,.0f} ms" if o.exposed_comm_seconds else "0",
                  f"{o.bubble:.0%}" if o.bubble is not None else "-")
    console.print(t)
    rejected = r.rejected
    if rejected:
        console.print(f"Do not fit ({len(rejected)} traced):", highlight=False, markup=False)
        for o in rejected[:top]:
            console.print(Text(f"  {o.candidate.label()}: {o.reason}"))
        if len(rejected) > top:
            console.print(f"  ... and {len(rejected) - top} more (--json lists them all)",
                          highlight=False, markup=False)
    w = r.winner
    if w is None:
        console.print("No candidate fits: try more GPUs, a smaller global batch or sequence, or "
                      "--checkpointing full", highlight=False, markup=False)
        return
    console.print(Text.assemble(("Best: ", "bold"), w.candidate.label(),
                                f", {w.tokens_per_second:,.0f} tokens/s"))
    if commands:
        console.print(Text("  " + commands["tapescope"]))
        console.print("torchtitan:", highlight=False, markup=False)
        console.print(Text(commands["torchtitan_toml"].rstrip()))
        console.print(Text(commands["torchtitan_command"]))


def progress_line(p) -> str:
    """One line per finished candidate (stderr when it is no terminal)."""
    parts = [f"{p.done} done, {p.pruned} pruned, {p.left} left"]
    o = p.last
    if o is not None:
        what = f"{o.tokens_per_second:,.0f} tokens/s" if o.fits and o.tokens_per_second \
            else o.status
        name = o.candidate.label()
        parts.append(f"{name}: {what} ({o.trace_seconds:.1f} s"
                     + (", cached" if o.cached else "") + ")")
    if p.best is not None:
        parts.append(f"best {p.best.candidate.label()} ({p.best.tokens_per_second:,.0f} tokens/s)")
    return "search: " + "; ".join(parts)
