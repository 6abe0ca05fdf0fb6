"""torchvision's detection trainers, GPU-less with their targets, against the CPU allocator.

Each model's training forward reads values of the user's targets: `degenerate_boxes =
boxes[:, 2:] <= boxes[:, :2]; if degenerate_boxes.any():` in GeneralizedRCNN, the matching of
anchors to target boxes (box IoU, `Matcher`, the balanced sampler's `torch.where`) in the RPN and
in RetinaNet's and FCOS's losses. The targets are inputs the user passed as real tensors, so they
keep their values (capture/data_values.py), as do the anchors (made from the model's constants and
small factories). What depends on the network's predictions (RPN proposals after NMS, the ROI
heads' sampled proposals, FCOS's GIoU overlap mask) has no value on fake tensors: those sizes come
from the mask assumption (sizes={'mask': F}), and the report names each line.

Truth: the same step run for real under torch.profiler (validate.real), its allocator peaks.
"""

from math import prod

import pytest
import torch
from torchvision.models.detection import FCOS, FasterRCNN, RetinaNet
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import mobilenet_backbone, resnet_fpn_backbone
from torchvision.ops.feature_pyramid_network import LastLevelP6P7

import tapescope
from tapescope.validate.real import run_real_steps

_SIZE = dict(min_size=64, max_size=64)


def _resnet18_fpn(extra=None):
    return resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5,
                               returned_layers=[2, 3, 4], extra_blocks=extra)


def _faster_rcnn():
    backbone = mobilenet_backbone(backbone_name="mobilenet_v3_small", fpn=True, weights=None,
                                  trainable_layers=6)
    anchors = AnchorGenerator(((32, 64, 128, 256, 512),) * 3, ((0.5, 1.0, 2.0),) * 3)
    return FasterRCNN(backbone, num_classes=3, rpn_anchor_generator=anchors,
                      rpn_pre_nms_top_n_train=200,
                      rpn_post_nms_top_n_train=50, box_batch_size_per_image=64, **_SIZE)


def _retinanet():
    return RetinaNet(_resnet18_fpn(LastLevelP6P7(256, 256)), num_classes=3, **_SIZE)


def _fcos():
    return FCOS(_resnet18_fpn(LastLevelP6P7(256, 256)), num_classes=3, **_SIZE)


DETECTORS = {  # name -> (build, the sizes option: what the predictions decide)
    "faster r-cnn": (_faster_rcnn, {"mask": 0.5}),
    "retinanet": (_retinanet, None),
    "fcos": (_fcos, {"mask": 0.5}),
}


def _batch():
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 64, 64, generator=g) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[10., 12., 50., 60.], [30., 20., 60., 50.]]),
                "labels": torch.tensor([1, 2])},
               {"boxes": torch.tensor([[5., 5., 40., 45.]]), "labels": torch.tensor([2])}]
    return images, targets


@pytest.fixture(scope="module")
def real_steps():
    """name -> the real SGD steps of that detector on _batch() (run once, shared by tests)."""
    done = {}

    def run(name):
        if name not in done:
            torch.manual_seed(0)
            done[name] = run_real_steps(DETECTORS[name][0], _batch(), optimizer="sgd")
        return done[name]
    return run


@pytest.mark.parametrize("name", DETECTORS)
def test_detection_trains_with_its_targets(name, real_steps):
    build, sizes = DETECTORS[name]
    images, targets = _batch()
    p = tapescope.profile(build, images, targets, optimizer="sgd", sizes=sizes)
    real = real_steps(name)
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])
    decided = {(a.kind, a.where) for a in p.trace.assumptions if a.decided}
    # the targets decided the degenerate-box check and the anchors' matching, not an assumption
    assert ("input", "input2") in decided and ("input", "input4") in decided
    assert not any(kind == "routing" for kind, _ in decided)
    if sizes is None:  # RetinaNet: nothing its losses read depends on the predictions
        assert {kind for kind, _ in decided} <= {"input", "random"}
    if name == "faster r-cnn":  # nms(boxes (N, 4), scores (N,)) keeps at most N boxes: the mask
        # fraction is of N, not of the 4N coordinates (which gave more proposals than boxes)
        nms = [a.detail for a in p.trace.assumptions if a.where == "boxes.py:54"]
        assert nms and all(d.startswith("nms keeps 50% of its ") and d.endswith(" boxes")
                           for d in nms)
        for d in p.trace.data_sizes:
            if d.op == "torchvision.nms.default":
                boxes = int(p.trace.assumptions[d.assumptions[0]].detail.split()[-2])
                assert d.value == round(boxes / 2)


def test_detection_without_an_assumption_names_the_line():
    """Faster R-CNN's proposals after NMS depend on the network's outputs: with no mask
    assumption the step stops at the first such size, naming it and the fix."""
    images, targets = _batch()
    with pytest.raises(tapescope.TapescopeError) as e:
        tapescope.profile(_faster_rcnn, images, targets, optimizer="sgd")
    assert "boxes.py" in str(e.value) and "sizes={'mask': F}" in str(e.value)


# ---- every data-decided size as the real step's: the trace alone is compared ---------------------

def test_detection_with_the_real_steps_sizes_is_exact(real_steps):
    """Faster R-CNN with every size its data decides (proposals left by each NMS, the sampler's
    positives, the pooler's ROIs per level, both steps) given as the real step's, recorded from
    an identical real run (the same seed; validate/data_sizes.py): no size comes from the mask
    assumption, and the peaks are the allocator's."""
    from tapescope.validate.data_sizes import RecordedSizes

    images, targets = _batch()
    torch.manual_seed(0)
    with RecordedSizes() as recorded:
        run_real_steps(_faster_rcnn, (images, targets), optimizer="sgd")
    real, counts = real_steps("faster r-cnn"), recorded.counts
    p = tapescope.profile(_faster_rcnn, images, targets, optimizer="sgd",
                          sizes={"counts": counts})
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])
    kinds = {a.kind for a in p.trace.assumptions if a.decided}
    assert "counts" in kinds and "mask" not in kinds
    assert p.trace.step2 == "traced"  # step 2's own sizes (its NMS kept other boxes)
    nms = [d.value for d in p.trace.data_sizes if d.op == "torchvision.nms.default"]
    assert sorted(set(nms)) == sorted(set(counts["boxes.py:54"]))


def test_counts_that_contradict_the_targets_are_refused():
    """The RPN's matcher finds each target's best anchors from the targets' values (10 here, as
    the real step): a count given for that line must agree, else the counts follow another
    step's calls."""
    images, targets = _batch()
    with pytest.raises(tapescope.TapescopeError, match=r"_utils.py:408 give 11 at call 1"):
        tapescope.profile(_faster_rcnn, images, targets, optimizer="sgd",
                          sizes={"mask": 0.5, "counts": {"_utils.py:408": [11]}})


@pytest.mark.parametrize("bad", [{"counts": {"boxes.py": 3}}, {"counts": {"boxes.py:54": -1}},
                                 {"counts": {"boxes.py:54": [1.5]}}, {"counts": 3}])
def test_bad_counts_are_refused(bad):
    with pytest.raises(tapescope.TapescopeError, match="counts must map source lines"):
        tapescope.profile(_faster_rcnn, *_batch(), optimizer="sgd", sizes=bad)



class _Resized(torch.nn.Module):
    """An input resized (a detector's transform: a 3-channel image, bilinear), then scaled by a
    parameter."""

    def __init__(self, **interpolate):
        super().__init__()
        self.w, self.interpolate = torch.nn.Parameter(torch.ones(())), interpolate

    def forward(self, x):
        return (torch.nn.functional.interpolate(x, **self.interpolate) * self.w).sum()


def _bytes(out_lengths, interp, itemsize):
    """By hand, from UpSampleKernel.cpp's compute_indices_weights: interp_size x (int64 index,
    weight) of each interpolated output length."""
    return sum(interp * n * (8 + itemsize) for n in out_lengths)


RESIZES = {  # name -> (input shape, interpolate's arguments, threads, bytes inside beyond out)
    "bilinear image, 1 thread": ((2, 3, 40, 40), dict(size=(100, 100), mode="bilinear"), 1,
                                 2 * 3 * 40 * 40 * 4 + 2 * 3 * 100 * 100 * 4),  # channels-last
    "bilinear image, 2 threads": ((2, 3, 40, 40), dict(size=(100, 100), mode="bilinear"), 2,
                                  _bytes((100, 100), 2, 4)),
    "bilinear mask, 1 thread": ((2, 1, 40, 40), dict(size=(70, 90), mode="bilinear"), 1,
                                _bytes((70, 90), 2, 4)),
    "nearest 2-D": ((2, 3, 40, 40), dict(size=(70, 90), mode="nearest"), 2, _bytes((70, 90), 1, 4)),
    "bicubic": ((2, 3, 20, 20), dict(size=(30, 40), mode="bicubic"), 2, _bytes((30, 40), 4, 4)),
    "linear 1-D": ((2, 3, 50), dict(size=70, mode="linear"), 2, _bytes((70,), 2, 4)),
    "trilinear": ((2, 3, 5, 6, 7), dict(size=(20, 30, 10), mode="trilinear"), 2,
                  _bytes((20, 30, 10), 2, 4)),
    "nearest 3-D, float64": ((2, 3, 5, 6, 7), dict(size=(20, 30, 10), mode="nearest"), 2,
                             _bytes((20, 30, 10), 1, 8)),
}


@pytest.mark.parametrize("name", RESIZES)
def test_generic_upsampling_allocates_its_indices_and_weights(name):
    """UpSampleKernel.cpp: the generic kernel makes an int64 index and a weight per tap along
    each output dimension; the channels-last kernel (small 2-D outputs, and a bilinear 3-channel
    image on one thread: upsample_bilinear2d_kernel_impl_float) copies the input and the output
    instead. The op's excess inside it against the allocator's."""
    shape, interpolate, threads, extra = RESIZES[name]
    dtype = torch.float64 if "float64" in name else torch.float32
    build = lambda: _Resized(**interpolate).to(dtype)  # noqa: E731
    inputs = (tapescope.spec(shape, dtype=dtype),)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p = tapescope.profile(build, *inputs, optimizer="sgd", threads=threads)
        real = run_real_steps(build, inputs, optimizer="sgd")
    finally:
        torch.set_num_threads(before)
    from tapescope.validate.per_op import compare_ops

    op = {"bilinear": "upsample_bilinear2d", "nearest": "upsample_nearest", "bicubic":
          "upsample_bicubic2d", "linear": "upsample_linear1d",
          "trilinear": "upsample_trilinear3d"}[interpolate["mode"]]
    ops = [o for o in compare_ops(p, real, 1) if o.phase == "forward" and op in o.name]
    out = prod(shape[:2]) * prod(interpolate["size"] if isinstance(interpolate["size"], tuple)
                                 else (interpolate["size"],)) * dtype.itemsize
    assert [(o.measured_excess, o.predicted_excess) for o in ops] == [(out + extra,) * 2]


class _Sorted(torch.nn.Module):
    """torch.sort / torch.unique on an input (batched_nms's `torch.unique(idxs)` on the CPU)."""

    def __init__(self, how):
        super().__init__()
        self.w, self.how = torch.nn.Parameter(torch.ones(())), how

    def forward(self, x):
        if self.how == "sort rows":
            return (self.w * x.sort(dim=1)[0]).sum()
        if self.how == "sort columns, stable":
            return (self.w * torch.sort(x, dim=0, stable=True)[0]).sum()
        if self.how == "unique":
            return self.w * torch.unique(x).shape[0]
        if self.how == "unique of a transpose, inverse and counts":
            u, inverse, counts = torch.unique(x.t(), return_inverse=True, return_counts=True)
            return self.w * (u.shape[0] + inverse.shape[0] + counts.shape[0])


SORTS = {  # name -> (input, bytes inside the op by hand from Sorting/Unique.cpp)
    # values 4 B + indices 8 B each, then at::arange(256) int64 (the row length)
    "sort rows": (torch.rand(6, 256), 6 * 256 * 12 + 256 * 8),
    "sort columns, stable": (torch.rand(6, 256), 6 * 256 * 12 + 6 * 8),
    # int64: the sort of the flattened input (values, indices, arange: 3 x 8 B; the arange
    # freed before the 5 values are written)
    "unique": (torch.arange(1023) % 5, 1023 * 16 + max(1023 * 8, 5 * 8)),
    # int32 (4, 300) transposed: its contiguous copy and the sort's values and indices (4 + 4
    # + 8 B), then the larger of the sort's arange (8 B, freed) and the outputs: 5 values, the
    # inverse (1200 x 8), 5 counts, unique_index (6 x 8)
    "unique of a transpose, inverse and counts": (
        (torch.arange(1200, dtype=torch.int32) % 5).view(4, 300),
        1200 * 16 + max(1200 * 8, 5 * 4 + 1200 * 8 + 5 * 8 + 6 * 8)),
}


@pytest.mark.parametrize("name", SORTS)
def test_sort_and_unique_allocate_as_their_cpu_kernels(name):
    """The op's excess inside it, the allocator's against the trace's and against the bytes
    derived by hand."""
    x, inside = SORTS[name]
    build = lambda: _Sorted(name)  # noqa: E731
    p = tapescope.profile(build, x, optimizer="sgd")
    real = run_real_steps(build, (x,), optimizer="sgd")
    from tapescope.validate.per_op import compare_ops

    ops = [o for o in compare_ops(p, real, 1) if o.name in ("aten.sort", "aten._unique2")]
    assert [(o.measured_excess, o.predicted_excess) for o in ops] == [(inside, inside)]


class _FocalHead(torch.nn.Module):
    """torchvision's sigmoid_focal_loss on a linear head's logits (RetinaNet's classification
    loss): binary_cross_entropy_with_logits(reduction="none") times a modulating factor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 512)

    def forward(self, x, target):
        from torchvision.ops import sigmoid_focal_loss

        return sigmoid_focal_loss(self.lin(x), target, reduction="sum")


def test_bce_with_logits_backward_works_in_place():
    """FunctionsManual.cpp: for plain tensors with grad mode off (the engine's backward) the
    gradient is `input.sigmoid().sub_(target).mul_(grad)`: the same ops as the real step, and its
    peaks, where the out-of-place version made one more logits-sized tensor at each."""
    inputs = (tapescope.spec((256, 32)), (torch.arange(256 * 512) % 3 == 0).float().view(256, 512))
    p = tapescope.profile(_FocalHead, *inputs, optimizer="sgd")
    real = run_real_steps(_FocalHead, inputs, optimizer="sgd")
    from tapescope.validate.harness import same_ops

    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops
                            if s == 1 and ph])
    assert ok, diff
    from tapescope.validate.per_op import compare_ops

    # each in-place op allocates nothing inside, as for real (out of place: 524,288 B each)
    ops = [o for o in compare_ops(p, real, 1) if o.phase == "backward"]
    inplace = [o for o in ops if o.name in ("aten.sub_", "aten.mul_")]
    assert len(inplace) == 2 and all(o.measured_excess == o.predicted_excess == 0 for o in inplace)
    # the peaks: within the 8-12 B Python-number temporaries of the focal loss's `1 - p`
    # (docs/validation.md, "where the last 8-16 bytes come from")
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 16


class _Nms(torch.nn.Module):
    """Scores from a linear layer, NMS over the given boxes, the kept scores as the loss (a
    detector's post-processing, where the kept count is what the data decides)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 1)

    def forward(self, feats, boxes):
        from torchvision.ops import nms

        scores = self.lin(feats).squeeze(1)
        keep = nms(boxes, scores.detach(), 0.5)
        return scores[keep].sum()


def test_nms_allocates_as_its_cpu_kernel():
    """torchvision's CPU nms (nms_kernel.cpp): its coordinate copies, the sort, suppressed and
    areas inside it, and a result that keeps all N x 8 bytes of its buffer; with the kept count
    given as the real step's, the peaks are the allocator's."""
    from tapescope.validate.data_sizes import RecordedSizes

    g = torch.Generator().manual_seed(0)
    n = 3000
    xy = torch.rand(n, 2, generator=g) * 400
    boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 40 + 1], 1)
    inputs = (tapescope.spec((n, 16)), boxes)
    with RecordedSizes() as recorded:
        run_real_steps(_Nms, inputs, optimizer="sgd")
    real = run_real_steps(_Nms, inputs, optimizer="sgd")
    p = tapescope.profile(_Nms, *inputs, optimizer="sgd", sizes={"counts": recorded.counts})
    kept = [d.value for d in p.trace.data_sizes if d.op == "torchvision.nms.default"]
    assert kept and 0 < kept[0] < n
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])
