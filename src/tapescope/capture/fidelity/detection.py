"""torchvision's CPU NMS: the copies and buffers its kernel makes, and the storage its result keeps.

torchvision/csrc/ops/cpu/nms_kernel.cpp (`nms_kernel_impl`), as the profiler shows it run in
torchvision 0.29 (the allocations in order, tests/test_detection.py): each box coordinate
`dets.select(1, k).contiguous()` (4 x N values), `scores.sort(stable, descending)` of which the
indices are kept (its values dropped at once; the sort's own arange, sorting.py), `suppressed`
(N bytes), `keep` (N int64), the areas (N values); the result is `keep_t.narrow(0, 0,
num_to_keep)`: a view that keeps all N x 8 bytes of `keep` alive while any of it is (a
detector's `keep[:post_nms_top_n]` too). A fake nms allocates num_to_keep x 8 bytes only.
"""

from __future__ import annotations

import torch

from .registry import OUTPUT, RULES, WORKSPACE, Alloc, Free, LibraryOp, Output

__all__ = []

_NMS = LibraryOp("torchvision::nms")
_SOURCE = "torchvision/csrc/ops/cpu/nms_kernel.cpp (nms_kernel_impl: {})"
_TEST = "tests/test_detection.py::test_nms_allocates_as_its_cpu_kernel"


@RULES.register(OUTPUT, _NMS, devices={"cpu"}, test=_TEST,
                source=_SOURCE.format("return keep_t.narrow(0, 0, num_to_keep)"))
def nms_result_keeps_every_box(ctx, func, args, out):
    """The kept indices as a view of an N-long int64 buffer (N: the boxes)."""
    n = args[0].shape[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 1:
        return out
    torch._check(out.shape[0] <= n)  # what the kernel guarantees: it keeps at most every box
    return out.new_empty((n,)).as_strided(out.shape, (1,))


@RULES.register(WORKSPACE, _NMS, devices={"cpu"}, test=_TEST,
                source=_SOURCE.format("4 coordinate copies, the sort's indices, suppressed, keep, "
                                      "areas"))
def nms_copies_coordinates_and_sorts(ctx, func, args, kwargs, out):
    boxes = args[0]
    n, s = boxes.shape[0], boxes.dtype.itemsize
    if not boxes.numel():
        return None
    return [Alloc("x1", n * s), Alloc("y1", n * s), Alloc("x2", n * s), Alloc("y2", n * s),
            Alloc("sorted", n * s), Alloc("order", n * 8), Alloc("arange", n * 8),
            Free("arange"), Free("sorted"), Alloc("suppressed", n), Output(0),
            Alloc("areas", n * s)]
