"""`write_png`: the stacked memory timeline as a static figure, for slides and papers.

Drawn with matplotlib's object API on an Agg canvas (no pyplot: no global figure state, no display
needed). The same downsampling as the HTML chart keeps long steps light while keeping the peak.
"""

from __future__ import annotations

from ..capture.records import ALL_CATEGORIES
from .downsample import downsample
from .palette import PHASE_COLORS, category_color
from .phases import phase_runs
from .text import fmt_bytes

__all__ = ["write_png", "require_matplotlib"]

_UNITS = (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
          ("KiB", 2**10), ("B", 1))


def require_matplotlib() -> None:
    """Raise a TapescopeError that says how to install matplotlib, if it is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from ..errors import TapescopeError

        raise TapescopeError("--png needs matplotlib: pip install 'tapescope[report]' "
                             "(or pip install matplotlib)")


def write_png(profile, path, *, max_points: int = 4000, width: float = 10.0, height: float = 4.2,
              dpi: int = 150) -> None:
    """Write the memory timeline of `profile` (bytes by category over the step's ops) as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import StrMethodFormatter
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("write_png needs matplotlib: pip install 'tapescope[report]'") from e

    mem = profile.memory
    idx = downsample(mem.timeline, max_points, [mem.peak_op] if mem.timeline else [])
    unit, scale = next((u, s) for u, s in _UNITS if s <= max(mem.peak_bytes, 1))
    cats = [c for c in ALL_CATEGORIES if any(mem.timeline_by_category.get(c) or ())]

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if idx:
        ys = [[mem.timeline_by_category[c][i] / scale for i in idx] for c in cats]
        ax.stackplot(idx, ys, labels=cats, colors=[category_color(c) for c in cats], step="post",
                     linewidth=0)
        # the top as a line too: a one-op spike is thinner than a pixel as an area
        ax.step(idx, [mem.timeline[i] / scale for i in idx], where="post", color="#333333",
                lw=0.6, alpha=0.7)
        top = mem.peak_bytes / scale
        for phase, start, end in phase_runs(profile.ops):
            color = PHASE_COLORS.get(phase, "#888888")
            ax.axvspan(start - 0.5, end - 0.5, ymin=0.94, ymax=1.0, color=color, alpha=0.85, lw=0)
            ax.axvline(start - 0.5, color="black", alpha=0.3, lw=0.6, ls="--")
            # a narrow band gets the short name, or none (~0.6 em per character)
            band_pt = (end - start) / len(mem.timeline) * width * 72 * 0.8
            label = next((t for t in (phase, phase[:3]) if 0.6 * 7 * len(t) + 6 < band_pt), None)
            if label:
                ax.text(max(start, 0) + 0.005 * len(mem.timeline), top * 1.17, label,
                        color="white", fontsize=7, va="center", ha="left", fontweight="bold")
        ax.plot([mem.peak_op], [top], "o", ms=6, mfc="white", mec="#cf222e", mew=1.5, zorder=5)
        ax.axvline(mem.peak_op, color="#cf222e", lw=1, ls=":", zorder=4)
        op = profile.ops[mem.peak_op]
        ax.annotate(f"peak {fmt_bytes(mem.peak_bytes)}\n#{op.index} {op.name}",
                    (mem.peak_op, top), xytext=(8, -4), textcoords="offset points", fontsize=8,
                    color="#cf222e", va="top", zorder=6,
                    bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "none", "alpha": 0.85},
                    ha="left" if mem.peak_op < 0.6 * len(mem.timeline) else "right")
        ax.set_xlim(0, len(mem.timeline) - 1 if len(mem.timeline) > 1 else 1)
        ax.set_ylim(0, top * 1.22)
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.set_xlabel("op")
    ax.set_ylabel(f"live memory ({unit})")
    which = "steady state" if profile.steps == 2 else "first step"
    ax.set_title(f"{profile.model}: peak {fmt_bytes(profile.peak_bytes)} ({which})", fontsize=11,
                 loc="left")
    ax.grid(axis="y", alpha=0.3)
    ax.margins(x=0)
    if cats:
        handles, labels = ax.get_legend_handles_labels()
        # legend top-down like the stack
        fig.legend(handles[::-1], labels[::-1], loc="outside right upper", fontsize=8, frameon=False)
    from .files import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")

