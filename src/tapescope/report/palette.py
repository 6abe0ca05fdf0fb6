"""Colours of the memory categories and phases, shared by the HTML page and the PNG figure.

Fills are opaque so that the page can paint a stacked chart as overlapping areas (each category's
cumulative sum painted over the one above it) without colours blending into false categories.
"""

from __future__ import annotations

from ..capture.records import ALL_CATEGORIES, BACKWARD, FORWARD, OPTIMIZER

__all__ = ["CATEGORY_COLORS", "PHASE_COLORS", "category_color"]

CATEGORY_COLORS = {
    "parameters": "#4e79a7",
    "buffers": "#9c9ede",
    "gradients": "#f28e2b",
    "optimizer state": "#b07aa1",
    "inputs": "#9c755f",
    "saved activations": "#59a14f",
    "temporaries": "#e15759",
    "kernel workspace": "#edc948",
    "sharded parameters": "#3b5f8a",
    "unsharded parameters": "#a0cbe8",
    "all-gather buffers": "#8cd17d",
    "reduce-scatter buffers": "#ffbe7d",
    "communication staging": "#d4a6c8",
}

PHASE_COLORS = {FORWARD: "#4e79a7", BACKWARD: "#e15759", OPTIMIZER: "#76b7b2"}

assert set(CATEGORY_COLORS) == set(ALL_CATEGORIES), "every memory category needs a colour"


def category_color(category: str) -> str:
    return CATEGORY_COLORS.get(category, "#bab0ac")
