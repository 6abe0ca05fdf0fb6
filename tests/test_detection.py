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


@pytest.mark.parametrize("name", DETECTORS)
def test_detection_trains_with_its_targets(name):
    build, sizes = DETECTORS[name]
    images, targets = _batch()
    p = tapescope.profile(build, images, targets, optimizer="sgd", sizes=sizes)
    torch.manual_seed(0)
    real = run_real_steps(build, (images, targets), optimizer="sgd")
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])
    decided = {(a.kind, a.where) for a in p.trace.assumptions if a.decided}
    # the targets decided the degenerate-box check and the anchors' matching, not an assumption
    assert ("input", "input2") in decided and ("input", "input4") in decided
    assert not any(kind == "routing" for kind, _ in decided)
    if sizes is None:  # RetinaNet: nothing its losses read depends on the predictions
        assert {kind for kind, _ in decided} <= {"input", "random"}


def test_detection_without_an_assumption_names_the_line():
    """Faster R-CNN's proposals after NMS depend on the network's outputs: with no mask
    assumption the step stops at the first such size, naming it and the fix."""
    images, targets = _batch()
    with pytest.raises(tapescope.TapescopeError) as e:
        tapescope.profile(_faster_rcnn, images, targets, optimizer="sgd")
    assert "boxes.py" in str(e.value) and "sizes={'mask': F}" in str(e.value)


# ---- every data-decided size as the real step's: the trace alone is compared ---------------------

def _real_with_sizes(build, inputs):
    """The real step's peaks and, from a second identical real run (the same seed), the size
    each data-dependent op had, per source line (validate/data_sizes.py)."""
    from tapescope.validate.data_sizes import RecordedSizes

    with RecordedSizes() as recorded:
        run_real_steps(build, inputs, optimizer="sgd")
    return run_real_steps(build, inputs, optimizer="sgd"), recorded.counts


def test_detection_with_the_real_steps_sizes_is_exact():
    """Faster R-CNN with every size its data decides (proposals left by each NMS, the sampler's
    positives, the pooler's ROIs per level, both steps) given as the real step's: no size comes
    from the mask assumption, and the peaks are the allocator's."""
    images, targets = _batch()
    real, counts = _real_with_sizes(_faster_rcnn, (images, targets))
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


def test_nms_under_the_mask_assumption_keeps_a_fraction_of_its_boxes():
    """torchvision's nms(boxes (N, 4), scores (N,)) keeps at most N boxes: the mask fraction is
    of N, not of the 4N coordinates (which gave more proposals than boxes)."""
    images, targets = _batch()
    p = tapescope.profile(_faster_rcnn, images, targets, optimizer="sgd", sizes={"mask": 0.5})
    nms = [a.detail for a in p.trace.assumptions if a.where == "boxes.py:54"]
    assert nms and all(d.startswith("nms keeps 50% of its ") and d.endswith(" boxes") for d in nms)
    for d in p.trace.data_sizes:
        if d.op == "torchvision.nms.default":
            boxes = int(p.trace.assumptions[d.assumptions[0]].detail.split()[-2])
            assert d.value == round(boxes / 2)


@pytest.mark.parametrize("bad", [{"counts": {"boxes.py": 3}}, {"counts": {"boxes.py:54": -1}},
                                 {"counts": {"boxes.py:54": [1.5]}}, {"counts": 3}])
def test_bad_counts_are_refused(bad):
    with pytest.raises(tapescope.TapescopeError, match="counts must map source lines"):
        tapescope.profile(_faster_rcnn, *_batch(), optimizer="sgd", sizes=bad)
