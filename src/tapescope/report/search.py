"""`tapescope search`'s text: the ranked table, the candidates that do not fit and why, how many
the traces ruled out, and the winner as commands to run. A stopped search (time limit, Ctrl-C,
SIGTERM) says so first, ranks only what it traced, and lists what it did not search with the
lower bound on each one's step, so that the reader sees whether the stop could hide a faster
layout."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .text import fmt_bytes

__all__ = ["render_search", "progress_line", "stop_summary", "fmt_duration"]


def fmt_duration(seconds: float) -> str:
    """A search's time: seconds under a minute, else minutes (its limit is given in minutes)."""
    return f"{seconds:.3g} s" if seconds < 60 else f"{seconds / 60:.3g} min"


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
    if not r.complete:
        console.print(Text.assemble(("  Partial: ", "bold yellow"), stop_summary(r)))
    console.print(f"  {len(r.outcomes)} candidates traced on every rank class, {len(r.pruned)} "
                  f"ruled out by those traces"
                  + (f" ({bounded} provably slower than the top {r.top})" if bounded else "")
                  + (f", {len(r.not_searched)} not searched" if not r.complete else "")
                  + f", {len(r.skipped)} outside the limits; {r.seconds:.1f} s on {r.workers}",
                  highlight=False, markup=False)
    ranked = r.ranked
    among = "" if r.complete else ", among the traced candidates only"
    t = Table(box=None, title=f"Fits on every rank, fastest first{among} (top "
              f"{min(top, len(ranked))} of {len(ranked)})", title_justify="left")
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
    if not r.complete:
        _render_not_searched(r, console, top)
    w = r.winner
    if w is None and not r.complete:
        console.print("No traced candidate fits yet: give the search more time (--time-limit), "
                      "or resume it from its --cache file", highlight=False, markup=False)
        return
    if w is None:
        console.print("No candidate fits: try more GPUs, a smaller global batch or sequence, or "
                      "--checkpointing full", highlight=False, markup=False)
        return
    console.print(Text.assemble(("Best: " if r.complete else "Best traced: ", "bold"),
                                w.candidate.label(), f", {w.tokens_per_second:,.0f} tokens/s"))
    if commands:
        console.print(Text("  " + commands["tapescope"]))
        console.print("torchtitan:", highlight=False, markup=False)
        console.print(Text(commands["torchtitan_toml"].rstrip()))
        console.print(Text(commands["torchtitan_command"]))


def stop_summary(r) -> str:
    """'stopped after N min by the time limit (M min): X traced, Y ruled out, Z not searched
    (W being traced)'; `r` a stopped layout_search.SearchResult."""
    running = sum(u.being_traced for u in r.not_searched)
    return (f"stopped after {fmt_duration(r.seconds)} by {r.stopped}: {len(r.outcomes)} traced, "
            f"{len(r.pruned)} ruled out, {len(r.not_searched)} not searched"
            + (f" ({running} being traced)" if running else ""))


def _render_not_searched(r, console: Console, top: int) -> None:
    """The candidates a stopped search did not reach, those that could still take a top row
    (or beat the best) first, each with the lower bound the traces give its step; then what the
    bounds prove about the rows shown."""
    untraced = r.not_searched
    rows = r.rows if r.rows is not None else len(r.ranked)
    could = [u for u in untraced if r.could_enter_top(u)]
    beat = [u for u in untraced if r.could_beat_best(u)]
    console.print(f"Not searched ({len(untraced)}), each with the lower bound the traces give "
                  f"its step:", highlight=False, markup=False)
    order = sorted(untraced, key=lambda u: (not r.could_beat_best(u), not r.could_enter_top(u),
                                            u.bound.seconds if u.bound else 0.0))
    for u in order[:top]:
        what = "no bound yet" if u.bound is None else \
            f"step at least {u.bound.seconds * 1e3:,.0f} ms ({u.bound.reason})"
        flag = "could beat the best" if r.winner is not None and r.could_beat_best(u) else \
            f"could enter the top {rows}" if r.could_enter_top(u) else "cannot enter the top"
        console.print(Text(f"  {u.candidate.label()}: {what}; {flag}"
                           + (" (was being traced)" if u.being_traced else "")))
    if len(untraced) > top:
        console.print(f"  ... and {len(untraced) - top} more (--json lists them all)",
                      highlight=False, markup=False)
    exact = r.exact_rows
    if r.winner is None:
        verdict = "any of them may fit and be the best"
    elif not could:
        verdict = f"none of them can enter the top {rows}: those rows are the space's"
    elif exact:
        verdict = (f"none of them can beat the first {exact} row{'s' if exact > 1 else ''}: "
                   f"{'those are' if exact > 1 else 'the best is'} the space's; {len(could)} "
                   f"could still enter the top {rows}")
    else:
        verdict = (f"{len(beat)} of them could beat the best: the rows shown may hide a faster "
                   "layout")
    console.print(Text(f"  So {verdict} (more time, or the same command with --cache FILE, "
                       "settles it)." if could else f"  So {verdict}."))


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
