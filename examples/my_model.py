"""A small image classifier, as your own model file would hold one.

    tapescope profile examples/my_model.py:build --input 8,3,224,224 --input 8:int64 --loss cross-entropy

`build` is called with no arguments (on the meta device: nothing is allocated). The two inputs are
the images and their labels; the model takes both, as a training step passes them, and
`--loss cross-entropy` scores its logits against the integer input of the logits' leading shape
(the labels).
"""

import torch.nn as nn


def _stage(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(_stage(3, width), _stage(width, 2 * width),
                                      _stage(2 * width, 4 * width), _stage(4 * width, 8 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8 * width, classes)

    def forward(self, images, labels=None):  # labels are the loss's, not the model's
        return self.head(self.pool(self.features(images)).flatten(1))


def build() -> nn.Module:
    return SmallCNN()
