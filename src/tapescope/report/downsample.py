"""Pick at most `max_points` samples of a long series without losing its spikes.

A step can have 100k ops; a chart of 100k points is slow to ship and to draw, and averaging would
shave off exactly the peaks a memory chart exists to show. So the series is cut into buckets and
each bucket keeps its lowest and its highest sample (the shape of a spike survives at any zoom-out),
plus the first and last sample and any index the caller must keep exactly (the peak).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["downsample"]


def downsample(values: Sequence, max_points: int, keep: Iterable[int] = ()) -> list[int]:
    """Sorted indices into `values`, at most `max_points` of them (all of them if that is fewer)."""
    n = len(values)
    must = {i for i in keep if 0 <= i < n}
    if n:
        must.update((0, n - 1))
    if n <= max_points:
        return list(range(n))
    if max_points < len(must):
        raise ValueError(f"max_points={max_points} cannot hold the {len(must)} samples that must stay")
    buckets = (max_points - len(must)) // 2
    chosen = set(must)
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo == hi:
            continue
        i_min = i_max = lo
        v_min = v_max = values[lo]
        for i in range(lo + 1, hi):
            v = values[i]
            if v < v_min:
                i_min, v_min = i, v
            elif v > v_max:
                i_max, v_max = i, v
        chosen.add(i_min)
        chosen.add(i_max)
    return sorted(chosen)
