"""Small programs whose peak falls inside a kernel's own scratch, on CPU: tapescope's peaks against
the allocator (first and steady step). Each exercises one class of kernel workspace
(capture/fidelity): the contiguous copy of an expanded gradient inside mm, an LSTM's oneDNN
workspace, loss kernels' buffers, pooling copies, oneDNN convolution reorders and GEMM scratch.

    python benchmarks/validate_workspace.py [NAME-SUBSTRING ...]

Prints a Markdown table (docs/validation.md keeps the last one) with this machine's ISA and
threads.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope
from tapescope.devices.cpu import cpu_target
from tapescope.validate.real import run_real_steps


class SumLM(nn.Module):
    """A 3-layer LM whose loss is `out.sum()`: the head's backward gets the expanded 1."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(2000, 128)
        self.body = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(),
                                  nn.Linear(128, 2000))

    def forward(self, tokens):
        return self.body(self.emb(tokens)).sum()


class LstmTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 64)
        self.rnn = nn.LSTM(64, 128, num_layers=2, batch_first=True, bidirectional=True)
        self.out = nn.Linear(256, 10)

    def forward(self, tokens):
        return F.cross_entropy(self.out(self.rnn(self.emb(tokens))[0]).flatten(0, 1),
                               torch.zeros(tokens.numel(), dtype=torch.long))


class Regressor(nn.Module):
    """Three regression losses on one MLP."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512))

    def forward(self, x):
        y = self.mlp(x)
        target = torch.zeros_like(y)
        return (F.mse_loss(y, target) + F.smooth_l1_loss(y, target)
                + F.binary_cross_entropy_with_logits(y, target))


class SmallUNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        conv = lambda i, o: nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.ReLU())  # noqa: E731
        self.d1, self.d2, self.mid = conv(3, c), conv(c, 2 * c), conv(2 * c, 2 * c)
        self.u2, self.u1 = conv(4 * c, c), conv(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        a = self.d1(x)
        b = self.d2(F.max_pool2d(a, 2))
        m = self.mid(F.max_pool2d(b, 2))
        u = self.u2(torch.cat([F.interpolate(m, scale_factor=2.0), b], 1))
        u = self.u1(torch.cat([F.interpolate(u, scale_factor=2.0), a], 1))
        return F.cross_entropy(self.head(u), torch.zeros(x.shape[0], *x.shape[2:],
                                                         dtype=torch.long))


class DilatedHead(nn.Module):
    """An ASPP-like segmentation head: dilated 3x3 convolutions on a small feature map."""

    def __init__(self, c=128):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.branches = nn.ModuleList(nn.Conv2d(c, c, 3, padding=r, dilation=r) for r in (1, 2, 4))
        self.out = nn.Conv2d(3 * c, 8, 1)

    def forward(self, x):
        f = self.stem(x).relu()
        return self.out(torch.cat([b(f) for b in self.branches], 1)).pow(2).mean()


MODELS = [  # name, build, input specs, optimizer
    ("3-layer LM, loss out.sum()", SumLM, (tapescope.spec((8, 64), dtype=torch.long, high=2000),),
     "adamw"),
    ("3-layer LM, loss out.sum()", SumLM, (tapescope.spec((8, 64), dtype=torch.long, high=2000),),
     "sgd"),
    ("2-layer bidirectional LSTM", LstmTagger,
     (tapescope.spec((8, 32), dtype=torch.long, high=1000),), "adamw"),
    ("MLP with mse / smooth_l1 / bce-with-logits", Regressor, (tapescope.spec((256, 64)),),
     "adamw"),
    ("small UNet (max-pool, 3x3 convolutions)", SmallUNet, (tapescope.spec((2, 3, 64, 64)),),
     "adamw"),
    ("dilated segmentation head", DilatedHead, (tapescope.spec((2, 3, 64, 64)),), "adamw"),
]


def main():
    only = sys.argv[1:]
    cpu = cpu_target()
    print(f"CPU: {cpu.describe()}, torch {torch.__version__}\n")
    print("| program | optimizer | first-step peak error | steady peak error |")
    print("|---|---|---|---|")
    for name, build, inputs, optimizer in MODELS:
        if only and not any(o in name for o in only):
            continue
        p = tapescope.profile(build, *inputs, optimizer=optimizer)
        real = run_real_steps(build, inputs, optimizer=optimizer)
        e1 = (p.first_step_peak_bytes - real.peaks[1]) / real.peaks[1]
        e2 = (p.peak_bytes - real.peaks[2]) / real.peaks[2]
        print(f"| {name} | {optimizer} | {e1:+.3%} | {e2:+.3%} |", flush=True)


if __name__ == "__main__":
    main()
