"""Memory a real CPU kernel allocates inside itself (capture/fidelity WORKSPACE and OUTPUT rules),
against the real allocator.

Truth: the same step run for real under torch.profiler (validate.real), compared op by op
(validate.per_op): for each op, the highest live bytes while it ran minus the live bytes before
it, as the allocator counted them, must equal the trace's.
"""

from math import prod

import pytest
import torch
import torch.nn.functional as F

import tapescope
from tapescope.validate.per_op import compare_ops
from tapescope.validate.real import run_real_steps


def _measure(build, inputs, optimizer=None, step=1, **options):
    p = tapescope.profile(build, *inputs, optimizer=optimizer, **options)
    real = run_real_steps(build, inputs, optimizer=optimizer)
    return p, real, compare_ops(p, real, step)


def _excess(ops, name, phase=None):
    """(measured, predicted) excess of each op called `name`."""
    return [(o.measured_excess, o.predicted_excess) for o in ops
            if o.name == name and (phase is None or o.phase == phase)]


class _TwoLosses(torch.nn.Module):
    """The loss twice: the first result's storage is alive while the second is computed."""

    def __init__(self, loss):
        super().__init__()
        self.lin, self.loss = torch.nn.Linear(64, 64), loss

    def forward(self, x, t):
        y = self.lin(x)
        return self.loss(y, t) + self.loss(y.neg(), t)


LOSSES = {
    "mse_loss": lambda y, t: F.mse_loss(y, t),
    "mse_loss sum": lambda y, t: F.mse_loss(y, t, reduction="sum"),
    "smooth_l1_loss": lambda y, t: F.smooth_l1_loss(y, t),
    "huber_loss": lambda y, t: F.huber_loss(y, t),
    "binary_cross_entropy": lambda y, t: F.binary_cross_entropy(y.sigmoid(), t.sigmoid()),
    "soft_margin_loss": lambda y, t: F.soft_margin_loss(y, t.sign()),
    "binary_cross_entropy_with_logits": lambda y, t: F.binary_cross_entropy_with_logits(
        y, t.sigmoid()),
    "mse_loss bf16": lambda y, t: F.mse_loss(y.bfloat16(), t.bfloat16()).float(),
    "mean bf16": lambda y, t: y.bfloat16().mean().float(),
}


@pytest.mark.parametrize("name", LOSSES)
def test_loss_kernels_match_the_allocator(name):
    """Reduced losses keep an input-sized storage under their 0-d result (mse_loss,
    smooth_l1_loss, binary_cross_entropy, soft_margin_loss) and make unreduced buffers and
    float copies inside (Loss.cpp, ReduceOps.cpp)."""
    inputs = (tapescope.spec((32, 64)), tapescope.spec((32, 64)))
    p, real, ops = _measure(lambda: _TwoLosses(LOSSES[name]), inputs)
    assert p.first_step_peak_bytes == real.peaks[1]
    op = name.split()[0] if name.split()[0] != "mean" else "mean"
    checked = _excess(ops, f"aten.{op}", "forward") + _excess(ops, f"aten.{op}_backward")
    assert checked and all(m == p for m, p in checked), checked


def test_reduction_copies_its_input():
    """A CPU sum into int64 copies a bool mask; a bf16 mean sums a float copy (ReduceOps.cpp)."""

    class Count(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            y = self.lin(x)
            kept = (y > 0).sum(dim=1, keepdim=True)  # a bool mask summed into int64
            return (y * kept).bfloat16().mean(dim=0).float().sum()

    p, real, ops = _measure(Count, (tapescope.spec((64, 64)),))
    assert p.first_step_peak_bytes == real.peaks[1]
    for name in ("aten.sum", "aten.mean"):
        checked = _excess(ops, name, "forward")
        assert checked and all(m == p for m, p in checked), (name, checked)



class _HalfSums(torch.nn.Module):
    """bf16 sums of a 4-D activation over `dims` (a bias gradient's (0, 2, 3), a channel sum)."""

    def __init__(self, dims):
        super().__init__()
        self.conv, self.dims = torch.nn.Conv2d(8, 16, 3, padding=1), dims

    def forward(self, x):
        y = self.conv(x).bfloat16()
        return y.sum(self.dims).float().pow(2).sum()


@pytest.mark.parametrize("dims", [(0, 2, 3), (0, 2), (1,), (2, 3), (0, 1, 2, 3)])
def test_half_sum_accumulates_in_float(dims):
    """ReduceOps.cpp `should_use_acc_buffer`: a bf16 sum whose reduced dimensions form two runs
    in memory sums a float copy into a float result (fidelity/reductions.py), op by op."""
    p, real, ops = _measure(lambda: _HalfSums(dims), (tapescope.spec((4, 8, 12, 12)),),
                            optimizer="sgd")
    checked = _excess(ops, "aten.sum", "forward")
    assert checked and all(m == p for m, p in checked), checked
    floats = 4 * 16 * 12 * 12 * 4
    runs = dims in ((0, 2, 3), (0, 2))
    assert (checked[0][0] > floats) == runs


class _PixelClassifier(torch.nn.Module):
    """A segmentation head: a 1x1 convolution's channels-last class scores, log-softmax over the
    classes (dim 1) and a per-pixel NLL; `softmax=True` uses softmax instead."""

    def __init__(self, softmax=False):
        super().__init__()
        self.head = torch.nn.Conv2d(16, 8, 1).to(memory_format=torch.channels_last)
        self.softmax = softmax

    def forward(self, x):
        logits = self.head(x.contiguous(memory_format=torch.channels_last))
        if self.softmax:
            return logits.softmax(1).pow(2).mean()
        return F.nll_loss(logits.log_softmax(1), torch.zeros(x.shape[0], *x.shape[2:],
                                                             dtype=torch.long))


@pytest.mark.parametrize("softmax", [False, True])
def test_softmax_copies_a_non_contiguous_input(softmax):
    """SoftMax.cpp's CPU kernels read `input.contiguous()`: channels-last logits are copied."""
    p, real, ops = _measure(lambda: _PixelClassifier(softmax), (tapescope.spec((4, 16, 32, 32)),),
                            optimizer="sgd")
    name = "aten._softmax" if softmax else "aten._log_softmax"
    checked = _excess(ops, name, "forward")
    assert checked and all(m == p for m, p in checked), checked
    assert checked[0][0] > 4 * 8 * 32 * 32 * 4      # the result and an input-sized copy
    assert p.first_step_peak_bytes == real.peaks[1]


class _CrossAttention(torch.nn.Module):
    """Queries of one sequence attending to another through F.scaled_dot_product_attention
    (CPU: the flash kernel); `loss_on_heads` reduces the (batch, heads, seq, head) output
    directly, so the backward's grad_out is not contiguous in the kernel's layout."""

    def __init__(self, heads, head, mode):
        super().__init__()
        self.heads, self.head, self.mode = heads, head, mode
        self.q = torch.nn.Linear(heads * head, heads * head)
        self.kv = torch.nn.Linear(heads * head, 2 * heads * head)

    def forward(self, x, y):
        (b, lq, _), s = x.shape, y.shape[1]
        q = self.q(x).view(b, lq, self.heads, self.head).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.kv(y).view(b, s, 2, self.heads,
                                                              self.head).unbind(2))
        mask = torch.ones(b, 1, lq, s, dtype=torch.bool) if self.mode == "mask" else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=self.mode == "causal")
        if self.mode == "loss_on_heads":
            return o.pow(2).mean()
        return o.transpose(1, 2).reshape(b, lq, -1).pow(2).mean()


FLASH = {  # name -> (heads, head size, queries, keys, mode, threads)
    "32-query blocks, one thread": (2, 16, 64, 64, "", 1),
    "64-query blocks": (2, 16, 256, 64, "", 2),
    "256-query blocks, short keys": (4, 8, 800, 100, "", 2),
    "boolean mask": (2, 16, 64, 64, "mask", 2),
    "causal, keys over a block": (2, 8, 70, 600, "causal", 2),
    "grad_out copied to the kernel's layout": (2, 16, 64, 64, "loss_on_heads", 2),
}


@pytest.mark.parametrize("name", FLASH)
def test_cpu_flash_attention_buffers(name):
    """FlashAttentionKernel.cpp's per-thread buffers, sized by its query/key blocks and the
    thread count (capture/fidelity/cpu_attention.py), against the allocator, op by op."""
    heads, head, lq, s, mode, threads = FLASH[name]
    build = lambda: _CrossAttention(heads, head, mode)  # noqa: E731
    inputs = (tapescope.spec((2, lq, heads * head)), tapescope.spec((2, s, heads * head)))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        p, real, ops = _measure(build, inputs, optimizer="sgd")
    finally:
        torch.set_num_threads(before)
    checked = (_excess(ops, "aten._scaled_dot_product_flash_attention_for_cpu")
               + _excess(ops, "aten._scaled_dot_product_flash_attention_for_cpu_backward"))
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


@pytest.mark.parametrize("layout", ["bhsd", "bshd viewed as bhsd", "size-1 heads", "size-1 seq",
                                    "empty", "permuted", "expanded", "sliced"])
def test_flash_backward_reads_grad_outs_contiguity_as_torch_does(layout):
    """The rule's `transpose(1, 2).is_contiguous()` from sizes and strides, against torch's."""
    from tapescope.capture.fidelity.cpu_attention import _transposed_is_contiguous

    t = {"bhsd": lambda: torch.empty(2, 3, 5, 4),
         "bshd viewed as bhsd": lambda: torch.empty(2, 5, 3, 4).transpose(1, 2),
         "size-1 heads": lambda: torch.empty(2, 1, 5, 4),
         "size-1 seq": lambda: torch.empty(2, 3, 1, 4).transpose(1, 2).transpose(1, 2),
         "empty": lambda: torch.empty(2, 3, 0, 4).transpose(0, 3),
         "permuted": lambda: torch.empty(4, 5, 2, 3).permute(2, 3, 1, 0),
         "expanded": lambda: torch.empty(2, 1, 5, 4).expand(2, 3, 5, 4),
         "sliced": lambda: torch.empty(2, 5, 3, 8).transpose(1, 2)[..., :4]}[layout]()
    assert _transposed_is_contiguous(t) == t.transpose(1, 2).is_contiguous()


class _SumOfLinear(torch.nn.Module):
    """`out.sum()` as the loss: the Linear's backward gets the expanded 1 as its gradient."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(500, 64)
        self.head = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                        torch.nn.Linear(128, 500))

    def forward(self, tokens):
        return self.head(self.emb(tokens)).sum()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_mm_copies_an_expanded_gradient(optimizer):
    """addmm_impl_cpu_ clones a stride-0 operand contiguous inside mm (LinearAlgebra.cpp)."""
    inputs = (tapescope.spec((16, 64), dtype=torch.long, high=500),)
    p, real, ops = _measure(_SumOfLinear, inputs, optimizer=optimizer)
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    checked = _excess(ops, "aten.mm", "backward")
    assert checked and all(m == p for m, p in checked), checked
    assert max(m for m, _ in checked) >= 16 * 64 * 500 * 4  # the logits' gradient, copied


class _Head(torch.nn.Module):
    """A Linear viewed as `shape`, then the layer under test, and the sum of its output as the
    loss (no loss_fn: tapescope's default): the layer's backward gets the expanded 1."""

    def __init__(self, shape, last):
        super().__init__()
        self.shape, self.last = shape, last()
        self.lin = torch.nn.Linear(32, prod(shape[1:]))

    def forward(self, x):
        return self.last(self.lin(x).view(self.shape))


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 64)

    def forward(self, tokens):
        return self.emb(tokens)


_B = 8
# name -> (output shape before the layer, the layer, the ops whose inside is checked)
EXPANDED = {
    "gelu": ((_B, 256), torch.nn.GELU, ["aten.gelu_backward"]),
    "gelu tanh (no copy)": ((_B, 256), lambda: torch.nn.GELU("tanh"), ["aten.gelu_backward"]),
    "relu (no copy)": ((_B, 256), torch.nn.ReLU, ["aten.threshold_backward"]),
    "softmax": ((_B, 256), lambda: torch.nn.Softmax(-1), ["aten._softmax_backward_data"]),
    "softmax dim 0": ((_B, 256), lambda: torch.nn.Softmax(0), ["aten._softmax_backward_data"]),
    "log_softmax": ((_B, 256), lambda: torch.nn.LogSoftmax(-1),
                    ["aten._log_softmax_backward_data"]),
    "softmax of a transposed input": ((_B, 16, 16), lambda: _Transposed(torch.nn.Softmax(-1)),
                                      ["aten._softmax", "aten._softmax_backward_data"]),
    "group_norm": ((_B, 16, 8, 8), lambda: torch.nn.GroupNorm(4, 16),
                   ["aten.native_group_norm", "aten.native_group_norm_backward"]),
    "upsample nearest": ((_B, 16, 8, 8), lambda: torch.nn.Upsample(scale_factor=2),
                         ["aten.upsample_nearest2d", "aten.upsample_nearest2d_backward"]),
    # H + W > 128: the generic kernel, no channels-last copies (its index buffers, 1,920 B
    # here, are not modelled: the forward is not checked)
    "upsample nearest, large output": ((2, 4, 40, 40), lambda: torch.nn.Upsample(scale_factor=2),
                                       ["aten.upsample_nearest2d_backward"]),
    "upsample bilinear": ((_B, 16, 8, 8), lambda: torch.nn.Upsample(scale_factor=2,
                                                                    mode="bilinear"),
                          ["aten.upsample_bilinear2d", "aten.upsample_bilinear2d_backward"]),
    "upsample bicubic": ((_B, 16, 8, 8), lambda: torch.nn.Upsample(scale_factor=2, mode="bicubic"),
                         ["aten.upsample_bicubic2d_backward"]),
    "reflection pad": ((_B, 16, 8, 8), lambda: torch.nn.ReflectionPad2d(1),
                       ["aten.reflection_pad2d_backward"]),
    "replication pad": ((_B, 16, 8, 8), lambda: torch.nn.ReplicationPad2d(1),
                        ["aten.replication_pad2d_backward"]),
    "pixel shuffle": ((_B, 16, 8, 8), lambda: torch.nn.PixelShuffle(2),
                      ["aten.pixel_shuffle", "aten.pixel_unshuffle"]),
    "channel shuffle": ((_B, 16, 8, 8), lambda: torch.nn.ChannelShuffle(2),
                        ["aten.channel_shuffle"]),
    "fold": ((_B, 64, 16), lambda: torch.nn.Fold((8, 8), 2, stride=2),
             ["aten.col2im", "aten.im2col"]),
    "embedding": (None, _Embedded, ["aten.embedding_dense_backward"]),
}


class _Transposed(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x.transpose(1, 2))


@pytest.mark.parametrize("name", EXPANDED)
def test_kernels_copy_an_expanded_gradient(name):
    """With the sum of the output as the loss, the last layer's backward gets a stride-0
    gradient; CPU kernels that read through `.contiguous()` (SoftMax.cpp, group_norm.cpp,
    UpSampleKernel.cpp, PaddingKernel.cpp, PixelShuffle.cpp, Im2Col.cpp, Embedding.cpp) or
    oneDNN (the exact GELU's backward) copy it: one more output-sized buffer inside the op."""
    shape, last, names = EXPANDED[name]
    if shape is None:
        build, inputs = last, (tapescope.spec((_B, 16), dtype=torch.long, high=100),)
    else:
        build, inputs = (lambda: _Head(shape, last)), (tapescope.spec((shape[0], 32)),)
    p, real, ops = _measure(build, inputs, optimizer="sgd")
    checked = {n: _excess(ops, n) for n in names}
    assert all(checked.values()), checked  # each op ran (a shuffle runs in both phases)
    assert all(m == p for c in checked.values() for m, p in c), checked
    assert p.first_step_peak_bytes == real.peaks[1]


def test_sum_of_a_gelu_output_matches_the_allocator():
    """Issue 23's case: Linear(64, 4096) -> GELU, batch 512, SGD, the sum as the loss (was
    17,973,256 B against the allocator's 26,361,864: the expanded gradient's copy)."""
    build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.GELU())  # noqa: E731
    inputs = (tapescope.spec((512, 64)),)
    p = tapescope.profile(build, *inputs, optimizer="sgd")
    real = run_real_steps(build, inputs, optimizer="sgd")
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])


_REAL_STEP = """
import pickle, sys, torch
from tapescope.validate.real import run_real_steps
build = lambda: torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU())
real = run_real_steps(build, ({spec},), optimizer="sgd", dtype=torch.bfloat16, steps=1)
pickle.dump(real, open(sys.argv[1], "wb"))
"""


@pytest.mark.parametrize("isa", ["this machine", "avx2"])
def test_bf16_gelu_backward_copies_where_onednn_has_bf16(isa, tmp_path):
    """bf16 GELU's backward runs in oneDNN only where oneDNN has bf16 (mkldnn_bf16_device_check:
    AVX-512), and copies the expanded gradient there; on AVX2 ATen's kernel copies nothing. The
    real step of the other ISA runs in a process capped to it (ONEDNN_MAX_CPU_ISA,
    ATEN_CPU_CAPABILITY), tapescope's with cpu_isa=."""
    import os
    import pickle
    import subprocess
    import sys

    from tapescope.devices.cpu import cpu_target

    target = None if isa == "this machine" else isa
    if target is None and cpu_target().isa not in ("avx2", "avx512"):
        pytest.skip(f"this machine's ISA is {cpu_target().isa}")
    spec = "tapescope.spec((8, 32))"
    env = dict(os.environ)
    if target == "avx2":
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    out = tmp_path / "real.pickle"
    subprocess.run([sys.executable, "-c", "import tapescope\n" + _REAL_STEP.format(spec=spec),
                    str(out)], env=env, check=True, capture_output=True)
    real = pickle.loads(out.read_bytes())
    build = lambda: torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU())  # noqa: E731
    p = tapescope.profile(build, tapescope.spec((8, 32)), optimizer="sgd", dtype=torch.bfloat16,
                          steps=1, cpu_isa=target)
    ops = compare_ops(p, real, 1)
    (measured, predicted), = _excess(ops, "aten.gelu_backward")
    assert measured == predicted
    onednn = (target or cpu_target().isa) == "avx512"
    assert measured == 8 * 256 * 2 * (2 if onednn else 1)  # the output, and the copy on oneDNN


class _Pools(torch.nn.Module):
    """Pooling of a channels-last-strided (or contiguous) activation, with an expanded gradient
    (the sum of each pooled output) or a dense one (the sum of its square)."""

    def __init__(self, channels_last, dense):
        super().__init__()
        self.lin, self.channels_last, self.dense = torch.nn.Linear(16, 16), channels_last, dense

    def forward(self, x):
        y = self.lin(x.movedim(1, -1)).movedim(-1, 1)  # NHWC strides
        if not self.channels_last:
            y = y.contiguous()
        outs = [F.max_pool2d(y, 3, 2, 1), F.avg_pool2d(y, 2), F.adaptive_max_pool2d(y, 3),
                F.adaptive_avg_pool2d(y, 5),
                F.max_pool3d(y.unsqueeze(2).expand(-1, -1, 2, -1, -1), (1, 2, 2))]
        if self.dense:
            outs = [o.contiguous() * o.contiguous() for o in outs]
        total = outs[0].sum()
        for o in outs[1:]:
            total = total + o.sum()
        return total


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dense", [False, True])
def test_pooling_copies_operands_into_one_format(channels_last, dense):
    """CPU pooling kernels copy what is not contiguous in the format they switch on."""
    p, real, ops = _measure(lambda: _Pools(channels_last, dense), (tapescope.spec((2, 16, 16, 16)),))
    pools = [o for o in ops if "pool" in o.name]
    assert len(pools) >= 10
    assert all(o.measured_excess == o.predicted_excess for o in pools), \
        [(o.name, o.measured_excess, o.predicted_excess) for o in pools]
    assert p.first_step_peak_bytes == real.peaks[1]


class _Lstm(torch.nn.Module):
    def __init__(self, input_size, hidden, layers, bidirectional):
        super().__init__()
        self.rnn = torch.nn.LSTM(input_size, hidden, num_layers=layers, batch_first=True,
                                 bidirectional=bidirectional)

    def forward(self, x):
        return self.rnn(x)[0].pow(2).sum()


@pytest.mark.parametrize("batch,seq,input_size,hidden,layers,bidirectional", [
    (4, 10, 32, 64, 2, True),      # ldgoi already good: no backward weight reorder
    (130, 3, 20, 100, 1, False),   # batch >= 128: the forward does not merge the layer GEMM
    (2, 5, 48, 256, 1, False),     # 256 is a 4K-aliasing leading dimension: padded to 272
])
def test_lstm_matches_the_allocator(batch, seq, input_size, hidden, layers, bidirectional):
    """mkldnn_rnn_layer's workspace output and the scratch of the LSTM forward and backward
    (mkldnn/RNN.cpp, oneDNN's reference RNN)."""
    p, real, ops = _measure(lambda: _Lstm(input_size, hidden, layers, bidirectional),
                            (tapescope.spec((batch, seq, input_size)),), optimizer="sgd")
    assert p.first_step_peak_bytes == real.peaks[1]
    assert p.peak_bytes == real.peaks[2]
    checked = _excess(ops, "aten.mkldnn_rnn_layer") + _excess(ops, "aten.mkldnn_rnn_layer_backward")
    assert len(checked) == 2 * layers * (2 if bidirectional else 1)
    assert all(m == p for m, p in checked), checked


class _Conv(torch.nn.Module):
    """One convolution whose input needs a gradient (a parameter scales it), so that its
    backward computes grad_input too; `first=True` keeps the input leaf (a first layer);
    `dims=3` makes it a Conv3d."""

    def __init__(self, c, o, k, stride=1, padding=0, dilation=1, groups=1, channels_last=False,
                 first=False, dims=2):
        super().__init__()
        conv = torch.nn.Conv3d if dims == 3 else torch.nn.Conv2d
        self.conv = conv(c, o, k, stride, padding, dilation, groups)
        self.scale = torch.nn.Parameter(torch.ones(c, *(1,) * dims))
        self.channels_last, self.first = channels_last, first
        self.format = torch.channels_last_3d if dims == 3 else torch.channels_last

    def forward(self, x):
        if not self.first:
            x = x * self.scale
        if self.channels_last:
            x = x.contiguous(memory_format=self.format)
        return self.conv(x).pow(2).sum()


CONVS = {  # name -> (_Conv arguments, input shape); the kernels named are AVX2's / AVX-512's
    "3x3 NCHW (blocked direct kernels)": ((64, 64, 3, 1, 1), (2, 64, 16, 16)),
    "channels not a multiple of the block (padded bias)": ((30, 60, 3, 1, 1), (2, 30, 16, 16)),
    "1x1 forward and backward-data": ((64, 256, 1), (2, 64, 16, 16)),
    "1x1 on a small map (AVX-512: batch-split weight reduction)": ((32, 128, 1), (4, 32, 4, 4)),
    "1x1, channels not filling a block": ((17, 40, 1), (2, 17, 6, 6)),
    "dilated (GEMM / direct weight gradient)": ((64, 64, 3, 1, 2, 2), (2, 64, 16, 16)),
    "kernel taller than the map (GEMM / direct weight gradient)":
        ((128, 128, 3, 1, 1), (2, 128, 2, 2)),
    "depthwise 3x3": ((32, 32, 3, 1, 1, 1, 32), (2, 32, 16, 16)),
    "depthwise 7x7 (GEMM weight gradient)": ((96, 96, 7, 1, 3, 1, 96), (2, 96, 8, 8)),
    "depthwise 7x7 channels-last (per-group padded blocks)":
        ((96, 96, 7, 1, 3, 1, 96, True), (2, 96, 8, 8)),
    "depthwise 7x7 channels-last on a 2x2 map (GEMM / padded direct weight gradient)":
        ((192, 192, 7, 1, 3, 1, 192, True), (2, 192, 2, 2)),
    "depthwise 9x9 channels-last on a 2x2 map": ((96, 96, 9, 1, 4, 1, 96, True), (2, 96, 2, 2)),
    "patch embedding 16x16/16 of a first layer": ((3, 192, 16, 16, 0, 1, 1, False, True),
                                                   (2, 3, 64, 64)),
    "patch embedding 14x14/14 of a first layer (GEMM / direct weight gradient)":
        ((3, 192, 14, 14, 0, 1, 1, False, True), (2, 3, 56, 56)),
    "7x7/2 stem of a first layer": ((3, 64, 7, 2, 3, 1, 1, False, True), (2, 3, 64, 64)),
    "3x3/2 NCHW": ((64, 128, 3, 2, 1), (2, 64, 16, 16)),
    "grouped NCHW": ((64, 64, 3, 1, 1, 1, 4), (2, 64, 16, 16)),
    "few input channels (AVX-512 pads them to a block)": ((8, 64, 3, 1, 1), (2, 8, 16, 16)),
    "3-D, few channels (GEMM weight gradient, columns per depth slice)":
        ((8, 8, 3, 1, 1, 1, 1, False, False, 3), (2, 8, 16, 16, 16)),
    "3-D (direct weight gradient, batch-split reduction)":
        ((16, 16, 3, 1, 1, 1, 1, False, False, 3), (2, 16, 8, 8, 8)),
    # nn.Conv2d's string paddings reach aten::convolution as one-element lists ([0] for "valid")
    "3x3 padding='valid'": ((64, 64, 3, 1, "valid"), (2, 64, 16, 16)),
    "first layer 3x3 padding='valid'": ((3, 8, 3, 1, "valid", 1, 1, False, True), (2, 3, 16, 16)),
    "3x3 padding='same'": ((64, 64, 3, 1, "same"), (2, 64, 16, 16)),
}


def _padding(conv) -> tuple:
    """The per-dimension padding aten::convolution runs with (Convolution.cpp
    `_convolution_mode`; "same" with an odd kernel is symmetric)."""
    if conv.padding == "valid":
        return (0,) * len(conv.kernel_size)
    if conv.padding == "same":
        return tuple(d * (k - 1) // 2 for k, d in zip(conv.kernel_size, conv.dilation))
    return conv.padding


def _exact_here(args, shape) -> str | None:
    """None if every oneDNN kernel this convolution runs is modelled exactly on this machine,
    else why not (the test is then skipped: the rule is a heuristic here and says so)."""
    from tapescope.capture.fidelity.convolution import conv_problem
    from tapescope.devices import onednn
    from tapescope.devices.cpu import cpu_target

    m = _Conv(*args)
    conv = m.conv
    c = conv_problem(shape, conv.weight.shape, True, conv.stride, _padding(conv), conv.dilation,
                     conv.groups, m.channels_last)
    cpu = cpu_target()
    prims = [onednn.forward(c, cpu), onednn.backward_weights(c, cpu)]
    if not m.first:
        prims.append(onednn.backward_data(c, cpu))
    inexact = [p.impl for p in prims if not p.exact]
    return f"heuristic on {cpu.describe()}: {inexact}" if inexact else None


@pytest.mark.parametrize("name", CONVS)
def test_convolution_matches_the_allocator(name):
    """oneDNN's reorders, kernel destinations and scratchpads inside `convolution` and
    `convolution_backward`, in Conv.cpp's order (devices/onednn.py, fidelity/convolution.py)."""
    args, shape = CONVS[name]
    why = _exact_here(args, shape)
    if why:
        pytest.skip(why)
    p, real, ops = _measure(lambda: _Conv(*args), (tapescope.spec(shape),), optimizer="sgd")
    checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]



def _convolutions_checked(names) -> dict:
    """name -> (measured, predicted) excesses of the convolution ops and the two first-step
    peaks, for each convolution this process models exactly (others: the reason)."""
    out = {}
    for name in names:
        args, shape = CONVS[name]
        why = _exact_here(args, shape)
        if why:
            out[name] = why
            continue
        p, real, ops = _measure(lambda: _Conv(*args), (tapescope.spec(shape),),
                                optimizer="sgd")
        checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
        out[name] = [checked, [real.peaks[1], p.first_step_peak_bytes]]
    return out


def test_convolution_matches_the_allocator_with_the_isa_capped_at_avx2():
    """On an AVX-512 host, the real kernels capped at AVX2 (ONEDNN_MAX_CPU_ISA, and
    ATEN_CPU_CAPABILITY for PyTorch's own kernels) pick AVX2's kernels, and tapescope, which
    reads the same variables, models those: both ISAs are checked on one machine. The capped
    step runs in a child process (oneDNN reads its cap once per process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this host is not AVX-512: test_convolution_matches_the_allocator "
                    "already checks its kernels")
    names = [n for n in CONVS if "GEMM" in n or "first layer" in n or "3x3 NCHW" in n
             or "1x1" in n or "padding=" in n]
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = ("import json, sys; from tests.test_kernel_workspace import _convolutions_checked; "
            f"print(json.dumps(_convolutions_checked({names!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    checked = {n: r for n, r in results.items() if not isinstance(r, str)}
    assert len(checked) >= len(names) - 1, results   # the AVX2 kernels are modelled exactly
    for name, (excesses, (real_peak, predicted_peak)) in checked.items():
        assert len(excesses) == 2 and all(m == p for m, p in excesses), (name, excesses)
        assert predicted_peak == real_peak, name

# name -> (_Conv arguments, input shape, dtype[, "transposed": _SlowDeconv's arguments]):
# convolutions ATen's slow kernels run
SLOW = {
    "fp64 3x3": ((16, 32, 3, 1, 1), (2, 16, 16, 16), "float64"),
    "fp64 3x3/2 of a first layer": ((16, 32, 3, 2, 1, 1, 1, False, True), (2, 16, 16, 16),
                                    "float64"),
    "fp64 1x1 (columns are a view)": ((16, 32, 1), (2, 16, 8, 8), "float64"),
    "bf16 3x3 (no oneDNN bf16 kernel)": ((16, 32, 3, 1, 1), (2, 16, 16, 16), "bfloat16"),
    "bf16 5x5/2": ((8, 16, 5, 2, 2), (2, 8, 16, 16), "bfloat16"),
    # fp16 without oneDNN's fp16 path, bf16 below AVX-512, fp64 anywhere: ATen's other slow
    # kernels (slow_convolution.py). Groups: Convolution.cpp copies each group's slices, runs
    # the kernel per group and cats the results
    "fp16 3x3, 4 groups (per-group copies, columns, cat)": ((16, 32, 3, 1, 1, 1, 4),
                                                            (2, 16, 8, 8), "float16"),
    "fp16 dilated 3x3/2, 2 groups (one sample's columns)": ((16, 32, 3, 2, 2, 2, 2),
                                                            (3, 16, 9, 9), "float16"),
    "fp16 3-D 3x3x3/2, 2 groups (the whole batch's vol2col columns; groups inside the kernel)":
        ((8, 16, 3, 2, 1, 1, 2, False, False, 3), (2, 8, 7, 7, 7), "float16"),
    "fp16 3-D dilated, 2 groups": ((8, 16, 3, 1, 2, 2, 2, False, False, 3), (2, 8, 6, 6, 6),
                                   "float16"),
    "fp64 dilated 3x3 channels-last": ((16, 32, 3, 1, 2, 2, 1, True), (2, 16, 8, 8), "float64"),
    "bf16 3x3, 4 groups": ((16, 32, 3, 1, 1, 1, 4), (2, 16, 8, 8), "bfloat16"),
    "bf16 dilated 3x3": ((16, 32, 3, 1, 2, 2), (2, 16, 8, 8), "bfloat16"),
    "bf16 3-D 3x3x3, 2 groups": ((8, 16, 3, 1, 1, 1, 2, False, False, 3), (2, 8, 6, 6, 6),
                                 "bfloat16"),
    # transposed (NaiveConvolutionTranspose2d.cpp): the whole batch's columns in the forward,
    # one sample's in each backward part
    "fp16 transposed 4x4/2 (DCGAN)": ((16, 8, 4, 2, 1), (2, 16, 8, 8), "float16", "transposed"),
    "fp16 transposed 3x3/2, 2 groups, channels-last":
        ((16, 8, 3, 2, 1, 1, 2, True), (2, 16, 8, 8), "float16", "transposed"),
}

_SLOW_KERNELS = ("Slow2d", "SlowDilated2d", "SlowDilated3d", "Slow3d", "SlowTranspose2d")


class _SlowDeconv(torch.nn.Module):
    """One ConvTranspose2d whose input needs a gradient, channels-last if asked."""

    def __init__(self, c, o, k, stride=1, padding=0, output_padding=0, groups=1,
                 channels_last=False):
        super().__init__()
        self.conv = torch.nn.ConvTranspose2d(c, o, k, stride, padding, output_padding, groups)
        self.scale = torch.nn.Parameter(torch.ones(c, 1, 1))
        self.channels_last = channels_last

    def forward(self, x):
        x = x * self.scale
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.conv(x).pow(2).sum()


def _slow_convolutions_checked(names, bf16_table: bool = False,
                               kernels: tuple = _SLOW_KERNELS) -> dict:
    """name -> [(measured, predicted) excesses of the convolution ops, [real peak, predicted
    peak]] for the SLOW (or, bf16_table, the BF16_CONVS) convolutions this process runs on
    ATen's slow `kernels` (others: the backend)."""
    from tapescope.torch_compat import select_conv_backend

    out = {}
    for name in names:
        args, shape, dtype, *kind = (*BF16_CONVS[name], "bfloat16") if bf16_table \
            else SLOW[name]
        dtype, module = getattr(torch, dtype), _SlowDeconv if kind else _Conv
        m = module(*args)
        transposed = isinstance(m.conv, torch.nn.ConvTranspose2d)
        backend = select_conv_backend(torch.empty(shape, dtype=dtype),
                                      m.conv.weight.detach().to(dtype), m.conv.stride,
                                      _padding(m.conv), m.conv.dilation, transposed,
                                      m.conv.output_padding if transposed
                                      else (0,) * (len(shape) - 2), m.conv.groups)
        if backend not in kernels:
            out[name] = backend
            continue
        p = tapescope.profile(lambda: module(*args), tapescope.spec(shape), optimizer="sgd",
                              dtype=dtype)
        real = run_real_steps(lambda: module(*args), (tapescope.spec(shape),), optimizer="sgd",
                              dtype=dtype)
        ops = compare_ops(p, real, 1)
        checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
        out[name] = [checked, [real.peaks[1], p.first_step_peak_bytes]]
    return out


def test_slow_convolutions_match_the_allocator():
    """ATen's Slow2d (ConvolutionMM2d.cpp) makes the whole batch's im2col columns before its
    output, and again for the weight gradient after grad_input and grad_bias; a 1x1 kernel views
    its input. The dilated kernels make one sample's columns; Slow3d the whole batch's vol2col
    columns, and its backward's fgrad_input; groups are split by Convolution.cpp into per-group
    copies and results, then cat (slow_convolution.py; main before: grouped -17%, dilated -31%,
    3-D -77% at a one-convolution peak, noted as estimates). fp64 runs them on every ISA, fp16
    without oneDNN's fp16 path (this AVX-512 host), bf16 where oneDNN has no bf16 kernel
    (AVX2: the test below)."""
    results = _slow_convolutions_checked(list(SLOW))
    checked = {n: r for n, r in results.items() if not isinstance(r, str)}
    assert all(n in checked for n in SLOW if n.startswith("fp64")), results
    for name, (excesses, (real_peak, predicted_peak)) in checked.items():
        assert len(excesses) == 2 and all(m == p for m, p in excesses), (name, excesses)
        assert predicted_peak == real_peak, name


def test_half_broadcast_layouts_follow_tensor_iterator():
    """A half / bfloat16 pointwise op whose fake kernel is a Python reference, given an expanded
    operand (the gradient of `out.sum()`) and a channels-last one: the traced output takes the
    layout the CPU kernel gives (fidelity/layouts.py), checked against real CPU tensors for every
    op of the rule that takes such operands (meta before the rule: contiguous for 34 of them)."""
    from tapescope.capture.fidelity.registry import RULES
    from tapescope.torch_compat import pointwise_meta_decompositions

    rule = next(r for r in RULES.all if r.name == "half_elementwise_broadcast_layout")
    aten = torch.ops.aten
    for dtype in (torch.float16,):   # bf16 takes the same reference path
        y = (torch.rand(2, 4, 3, 3) + 0.5).to(dtype).contiguous(memory_format=torch.channels_last)
        g = torch.full((), 0.5, dtype=dtype).expand(y.shape)
        mask = (y > 1).contiguous(memory_format=torch.channels_last)
        # ops of two tensors (ldexp left out: its CPU kernel's first call takes seconds here)
        cases = [(op, (g, y)) for op in pointwise_meta_decompositions()
                 if op is not aten.ldexp.Tensor
                 and [str(a.type) for a in op._schema.arguments[:2]] == ["Tensor", "Tensor"]]
        cases += [(aten.masked_fill.Scalar, (g, mask, 0.0)), (aten.where.self, (mask, g, y)),
                  (aten.addcmul.default, (g, y, y))]
        checked = changed = 0
        for op, args in cases:
            try:
                real = op(*args)
            except Exception:  # an op that takes other operands: not this pattern
                continue
            meta_args = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                         if isinstance(a, torch.Tensor) else a for a in args]
            meta = op(*meta_args)
            traced = rule.handler(None, op, meta_args, meta) if op in rule.targets else meta
            assert traced.stride() == real.stride(), (op, dtype, meta.stride(), real.stride())
            checked += 1
            changed += traced.stride() != meta.stride()
        assert checked > 30 and changed > 20, (checked, changed)


class _Conv1d(torch.nn.Module):
    """One Conv1d whose input needs a gradient; `channels_last_input=True` feeds it the
    transpose of an (N, L, C) tensor (a speech or sequence model's layout), non-contiguous."""

    def __init__(self, c, o, k, stride=1, padding=0, dilation=1, groups=1,
                 channels_last_input=False):
        super().__init__()
        self.conv = torch.nn.Conv1d(c, o, k, stride, padding, dilation, groups)
        self.scale = torch.nn.Parameter(torch.ones(c, 1))
        self.channels_last_input = channels_last_input

    def forward(self, x):
        if self.channels_last_input:
            x = x.transpose(1, 2)
        return self.conv(x * self.scale).pow(2).sum()


SLOW_1D = {  # name -> (_Conv1d arguments, input shape): fp16 1-D convolutions on slow kernels
    "grouped 5-tap, 4 groups (wav2vec2's positional convolution has 16)":
        ((32, 32, 5, 1, 2, 1, 4), (2, 32, 40)),
    "dilated, on a transposed (N, L, C) input": ((16, 32, 3, 1, 2, 2, 1, True), (2, 50, 16)),
}


@pytest.mark.parametrize("name", SLOW_1D)
def test_slow_one_dimensional_convolutions_match_the_allocator(name):
    """A 1-D convolution runs as a 2-D one of height 1 (Convolution.cpp view1d_as_2d, its input
    made contiguous first): per-group copies and the dilated kernel's columns, fp16."""
    from tapescope.torch_compat import select_conv_backend

    args, shape = SLOW_1D[name]
    m = _Conv1d(*args).half()
    x = torch.empty(shape, dtype=torch.half)
    x = x.transpose(1, 2) if m.channels_last_input else x
    if select_conv_backend(x, m.conv.weight, m.conv.stride, m.conv.padding, m.conv.dilation,
                           False, (0,), m.conv.groups) == "Mkldnn":
        pytest.skip("fp16 convolutions run on oneDNN here")
    build = lambda: _Conv1d(*args)  # noqa: E731
    p = tapescope.profile(build, tapescope.spec(shape), optimizer="sgd", dtype=torch.half)
    real = run_real_steps(build, (tapescope.spec(shape),), optimizer="sgd", dtype=torch.half)
    ops = compare_ops(p, real, 1)
    checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


def test_bf16_convolution_on_slow2d_with_the_isa_capped_at_avx2():
    """On an AVX-512 host oneDNN runs bf16 convolutions; capped at AVX2 (a child process: oneDNN
    reads its cap once) ATen's Slow2d does, and its columns are counted exactly."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this host is not AVX-512: the test above runs bf16 on Slow2d already")
    names = [n for n in SLOW if n.startswith("bf16")]
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = ("import json; from tests.test_kernel_workspace import _slow_convolutions_checked; "
            f"print(json.dumps(_slow_convolutions_checked({names!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(not isinstance(r, str) for r in results.values()), results
    for name, (excesses, (real_peak, predicted_peak)) in results.items():
        assert len(excesses) == 2 and all(m == p for m, p in excesses), (name, excesses)
        assert predicted_peak == real_peak, name


def test_bf16_convolutions_with_the_isa_capped_at_avx2():
    """BF16_CONVS (exact on oneDNN's AVX512-BF16 kernels above) capped at AVX2, where oneDNN has
    no bf16 kernel: those that run on ATen's Slow2d are exact there too. The grouped, dilated
    and 3-D ones (all 19 measured exact on 2026-11-28, 50 s) are left to SLOW's bf16 cases
    (test_bf16_convolution_on_slow2d_with_the_isa_capped_at_avx2), for time."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this host is not AVX-512")
    one_group = [n for n, (args, _) in BF16_CONVS.items() if len(args) < 7 or args[6] == 1]
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = ("import json; from tests.test_kernel_workspace import _slow_convolutions_checked; "
            f"print(json.dumps(_slow_convolutions_checked({one_group!r}, True, ('Slow2d',))))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    checked = {n: r for n, r in results.items() if not isinstance(r, str)}
    assert len(checked) >= 7, results
    for name, (excesses, (real_peak, predicted_peak)) in checked.items():
        assert len(excesses) == 2 and all(m == p for m, p in excesses), (name, excesses)
        assert predicted_peak == real_peak, name


BF16_CONVS = {  # name -> (_Conv arguments, input shape): bf16 convolutions, oneDNN's jit_bf16
    "3x3": ((16, 32, 3, 1, 1), (2, 16, 16, 16)),
    "3x3, 64 channels": ((64, 64, 3, 1, 1), (2, 64, 16, 16)),
    "channels not a multiple of 16 (padded bias)": ((30, 60, 3, 1, 1), (2, 30, 16, 16)),
    "few input channels (first-layer kernel, padded backward-data)": ((8, 64, 3, 1, 1),
                                                                      (2, 8, 16, 16)),
    "grouped": ((64, 64, 3, 1, 1, 1, 4), (2, 64, 16, 16)),
    "dilated": ((64, 64, 3, 1, 2, 2), (2, 64, 16, 16)),
    "5x5, batch 4 (thread split by the cost search)": ((64, 32, 5, 1, 2), (4, 64, 12, 12)),
    "kernel taller than the map": ((128, 128, 3, 1, 1), (2, 128, 4, 4)),
    "7x7/2 stem of a first layer": ((3, 64, 7, 2, 3, 1, 1, False, True), (2, 3, 64, 64)),
    "patch embedding 16x16/16 of a first layer": ((3, 192, 16, 16, 0, 1, 1, False, True),
                                                   (2, 3, 64, 64)),
    "3-D": ((16, 16, 3, 1, 1, 1, 1, False, False, 3), (2, 16, 8, 8, 8)),
    "depthwise 3x3 (jit_dw)": ((32, 32, 3, 1, 1, 1, 32), (2, 32, 16, 16)),
    "depthwise 3x3, channels not filling a block": ((40, 40, 3, 1, 1, 1, 40), (2, 40, 12, 12)),
    "depthwise 3x3, batch 4": ((96, 96, 3, 1, 1, 1, 96), (4, 96, 8, 8)),
    # jit_bf16_1x1: the f32 store buffer, the weight gradient's accumulators and transposes
    "1x1 64->256 on 16x16 (permw weight gradient)": ((64, 256, 1), (2, 64, 16, 16)),
    "1x1 256->64 on 8x8 (transposed operands)": ((256, 64, 1), (2, 256, 8, 8)),
    "1x1, channels not filling a block (padded bias)": ((30, 60, 1), (2, 30, 10, 10)),
    "1x1, batch 1 (the load-group cost search)": ((64, 128, 1), (1, 64, 14, 14)),
    "1x1 on 7x7, batch 4": ((128, 512, 1), (4, 128, 7, 7)),
}


def _onednn_runs_bf16_convolutions() -> bool:
    from tapescope.torch_compat import select_conv_backend

    x = torch.empty(2, 16, 16, 16, dtype=torch.bfloat16)
    w = torch.empty(32, 16, 3, 3, dtype=torch.bfloat16)
    return select_conv_backend(x, w, (1, 1), (1, 1), (1, 1), False, (0, 0), 1) == "Mkldnn"


def _bf16_exact_here(args, shape) -> str | None:
    """As _exact_here, for the bf16 kernels (devices/onednn_bf16.py)."""
    from tapescope.capture.fidelity.convolution import conv_problem
    from tapescope.devices import onednn_bf16
    from tapescope.devices.cpu import cpu_target

    m = _Conv(*args)
    conv = m.conv
    c = conv_problem(shape, conv.weight.shape, True, conv.stride, _padding(conv), conv.dilation,
                     conv.groups, m.channels_last, 2)
    cpu = cpu_target()
    prims = [onednn_bf16.forward(c, cpu), onednn_bf16.backward_weights(c, cpu)]
    if not m.first:
        prims.append(onednn_bf16.backward_data(c, cpu))
    inexact = [p.impl for p in prims if not p.exact]
    return f"an estimate on {cpu.describe()}: {inexact}" if inexact else None


@pytest.mark.parametrize("name", BF16_CONVS)
def test_bf16_convolution_matches_the_allocator(name):
    """oneDNN's bf16 kernels on AVX512-BF16 (devices/onednn_bf16.py): 16-channel blocked
    reorders, a first layer's plain source, narrower blocks for groups, the bf16 padded bias,
    and the weight gradient's transposed operands and f32 accumulators per batch thread, in
    Conv.cpp's order. Where oneDNN has no bf16 kernel, Slow2d runs (tested below)."""
    if not _onednn_runs_bf16_convolutions():
        pytest.skip("oneDNN has no bf16 convolution here (Slow2d: the tests below)")
    args, shape = BF16_CONVS[name]
    why = _bf16_exact_here(args, shape)
    assert why is None, why
    p = tapescope.profile(lambda: _Conv(*args), tapescope.spec(shape), optimizer="sgd",
                          dtype=torch.bfloat16)
    real = run_real_steps(lambda: _Conv(*args), (tapescope.spec(shape),), optimizer="sgd",
                          dtype=torch.bfloat16)
    ops = compare_ops(p, real, 1)
    checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


class _SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def test_cnn_under_cpu_autocast_matches_the_allocator():
    """A small CNN under CPU autocast bf16 (a first layer and 3x3 convolutions on oneDNN's bf16
    kernels, AdamW): both steps' peaks equal the allocator's (main before this rule: -15.9% /
    -13.7%), every convolution exact op by op."""
    if not _onednn_runs_bf16_convolutions():
        pytest.skip("oneDNN has no bf16 convolution here")
    x = tapescope.spec((4, 3, 32, 32))
    p = tapescope.profile(_SmallCnn, x, optimizer="adamw", amp="bf16")
    real = run_real_steps(_SmallCnn, (x,), optimizer="adamw", amp="bf16")
    ops = compare_ops(p, real, 1)
    checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
    assert len(checked) == 6 and all(m == p for m, p in checked), checked
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])


_REAL_CONV_STEP = """
import pickle, sys, torch
from tests.test_kernel_workspace import _Conv
from tapescope.validate.real import run_real_steps
real = run_real_steps(lambda: _Conv(*{args}), ({spec},), optimizer="sgd", dtype=torch.bfloat16,
                      steps=1)
pickle.dump(real, open(sys.argv[1], "wb"))
"""


def test_bf16_convolution_profiled_for_an_avx2_target(tmp_path):
    """`cpu_isa="avx2"` on an AVX-512 host: the target has no oneDNN bf16 kernel, so ATen's
    Slow2d runs there and its columns are counted; against the real step in a process capped at
    AVX2."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    if not _onednn_runs_bf16_convolutions():
        pytest.skip("this host runs Slow2d for bf16 already (tested above)")
    args, shape = BF16_CONVS["3x3"]
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    out = tmp_path / "real.pickle"
    code = "import tapescope\n" + _REAL_CONV_STEP.format(args=args,
                                                          spec=f"tapescope.spec({shape})")
    subprocess.run([sys.executable, "-c", code, str(out)], env=env, check=True,
                   capture_output=True, cwd=Path(__file__).resolve().parents[1])
    real = pickle.loads(out.read_bytes())
    p = tapescope.profile(lambda: _Conv(*args), tapescope.spec(shape), optimizer="sgd",
                          dtype=torch.bfloat16, steps=1, cpu_isa="avx2")
    ops = compare_ops(p, real, 1)
    checked = _excess(ops, "aten.convolution") + _excess(ops, "aten.convolution_backward")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


def test_bf16_convolution_estimates_say_so():
    """Where a bf16 convolution runs a oneDNN kernel not modelled exactly (a strided backward-
    data on brgconv_strided), the profile says so instead of calling the figure exact."""
    if not _onednn_runs_bf16_convolutions():
        pytest.skip("oneDNN has no bf16 convolution here")
    p = tapescope.profile(lambda: _Conv(64, 128, 3, 2, 1), tapescope.spec((2, 64, 16, 16)),
                          optimizer="sgd", dtype=torch.bfloat16)
    notes = p.facts["heuristics"].get("oneDNN convolution scratch", [])
    assert any("brgconv_strided" in n for n in notes), p.facts["heuristics"]


def test_convolution_scratch_follows_the_thread_count():
    """The GEMM weight gradient keeps per-thread columns and accumulators: one thread needs less
    than two, the real allocator agrees, and threads= profiles a target's count."""
    args, shape = CONVS["depthwise 7x7 (GEMM weight gradient)"]  # GEMM on AVX2 and AVX-512
    build = lambda: _Conv(*args)  # noqa: E731
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _measure(build, (tapescope.spec(shape),), optimizer="sgd")
    finally:
        torch.set_num_threads(before)
    p1, real1, ops1 = one
    assert p1.facts["cpu"]["threads"] == 1
    assert [m for m, _ in _excess(ops1, "aten.convolution_backward")] == \
        [p for _, p in _excess(ops1, "aten.convolution_backward")]
    # the same target profiled from this process without changing its threads
    p_target = tapescope.profile(build, tapescope.spec(shape), optimizer="sgd", threads=1)
    assert p_target.first_step_peak_bytes == p1.first_step_peak_bytes == real1.peaks[1]
    assert p_target.facts["cpu"] == {"isa": p1.facts["cpu"]["isa"], "threads": 1,
                                     "detected": False}
    if before > 1:
        p2 = tapescope.profile(build, tapescope.spec(shape), optimizer="sgd")
        assert p2.first_step_peak_bytes > p1.first_step_peak_bytes


def test_heuristic_kernel_choices_are_reported():
    """A channels-last 3x3 convolution runs oneDNN's brgemm kernels, whose scratchpad is an
    estimate: the profile says so."""
    p = tapescope.profile(lambda: _Conv(64, 64, 3, 1, 1, channels_last=True),
                          tapescope.spec((2, 64, 16, 16)), optimizer="sgd")
    notes = p.facts["heuristics"]["oneDNN convolution scratch"]
    assert any("brg_conv" in n and "estimate" in n for n in notes)


class _PermutedNorm(torch.nn.Module):
    """ConvNeXt's pattern: a LayerNorm over the channels of a permuted (non-contiguous)
    activation; `contiguous=True` normalises a contiguous one."""

    def __init__(self, contiguous, affine):
        super().__init__()
        self.lin, self.contiguous = torch.nn.Linear(16, 96), contiguous
        self.norm = torch.nn.LayerNorm(96, elementwise_affine=affine)

    def forward(self, x):
        y = self.lin(x).transpose(1, 2)        # (b, 96, s) -> normalise over 96 after permuting
        y = y.transpose(1, 2)
        if self.contiguous:
            y = y.contiguous()
        else:
            y = y.permute(1, 0, 2).permute(1, 0, 2)[:, ::2]  # a strided view
        return self.norm(y).pow(2).sum()


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_the_allocator(contiguous, affine):
    """layer_norm_cpu copies a non-contiguous input; its backward keeps 2 x threads x N
    accumulators for dgamma/dbeta (layer_norm.cpp, layer_norm_kernel.cpp)."""
    p, real, ops = _measure(lambda: _PermutedNorm(contiguous, affine),
                            (tapescope.spec((8, 64, 16)),), optimizer="sgd")
    checked = (_excess(ops, "aten.native_layer_norm")
               + _excess(ops, "aten.native_layer_norm_backward"))
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


class _Normed(torch.nn.Module):
    """A Linear viewed as `shape` (channels-last strides if asked), then a norm layer."""

    def __init__(self, norm, shape, channels_last=False):
        super().__init__()
        self.norm, self.shape, self.channels_last = norm, shape, channels_last
        self.lin = torch.nn.Linear(8, prod(shape[1:]))

    def forward(self, x):
        y = self.lin(x)
        if self.channels_last:  # NHWC memory, NCHW shape
            n, c, h, w = self.shape
            return self.norm(y.view(n, h, w, c).permute(0, 3, 1, 2))
        return self.norm(y.view(self.shape))


NORMS = {
    "BatchNorm1d, N x C": (lambda: torch.nn.BatchNorm1d(16), (4, 16), False),
    "BatchNorm1d, N x C, N <= 2": (lambda: torch.nn.BatchNorm1d(16), (2, 16), False),
    "BatchNorm1d, N x C x L": (lambda: torch.nn.BatchNorm1d(4), (4, 4, 4), False),
    "BatchNorm2d": (lambda: torch.nn.BatchNorm2d(4), (4, 4, 2, 2), False),
    "BatchNorm2d, channels-last": (lambda: torch.nn.BatchNorm2d(8), (4, 8, 3, 3), True),
    "LayerNorm": (lambda: torch.nn.LayerNorm(16), (4, 16), False),
}
_CE = lambda out, x: F.cross_entropy(out.flatten(1), torch.zeros(out.shape[0],  # noqa: E731
                                                                 dtype=torch.long))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("loss", ["sum", "cross-entropy"])
@pytest.mark.parametrize("name", NORMS)
def test_batch_norm_matches_the_allocator(name, loss, threads):
    """BatchNorm's CPU kernels (Normalization.cpp, batch_norm_kernel.cpp): the training
    statistics' temporaries and, in the channels-last kernel (an N x C input too), partial sums
    per thread (at::get_num_threads()); the backward's grad_input allocated twice on the
    vectorised path, or the gradient's per-channel sum on the other (an expanded gradient)."""
    norm, shape, channels_last = NORMS[name]
    build = lambda: _Normed(norm(), shape, channels_last)  # noqa: E731
    inputs = (tapescope.spec((shape[0], 8)),)
    loss_fn = None if loss == "sum" else _CE
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        p = tapescope.profile(build, *inputs, loss_fn=loss_fn, optimizer="sgd", steps=1)
        real = run_real_steps(build, inputs, loss_fn=loss_fn, optimizer="sgd", steps=1)
    finally:
        torch.set_num_threads(before)
    assert p.facts["cpu"]["threads"] == threads
    ops = compare_ops(p, real, 1)
    checked = [(o.name, o.measured_excess, o.predicted_excess) for o in ops if "norm" in o.name]
    assert len(checked) == 2 and all(m == p for _, m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


def test_cpu_target_is_checked_and_reported():
    from tapescope.errors import TapescopeError

    with pytest.raises(TapescopeError, match="unknown CPU ISA"):
        tapescope.profile(lambda: _Conv(8, 8, 3), tapescope.spec((1, 8, 8, 8)), cpu_isa="neon")
    with pytest.raises(TapescopeError, match="threads must be a positive integer"):
        tapescope.profile(lambda: _Conv(8, 8, 3), tapescope.spec((1, 8, 8, 8)), threads=0)
    p = tapescope.profile(lambda: _Conv(8, 8, 3), tapescope.spec((2, 8, 8, 8)),
                          cpu_isa="avx512", threads=4)
    assert p.facts["cpu"] == {"isa": "avx512", "threads": 4, "detected": False}
    # AVX-512's direct kernels are measured (test_convolution_matches_the_allocator on such a
    # host): no estimate; SSE4.1's are modelled from the sources only: the report says so
    assert "oneDNN convolution scratch" not in p.facts["heuristics"]
    p = tapescope.profile(lambda: _Conv(8, 8, 3), tapescope.spec((2, 8, 8, 8)),
                          cpu_isa="sse41", threads=4)
    assert "oneDNN convolution scratch" in p.facts["heuristics"]


class _Attention(torch.nn.Module):
    """Causal SDPA with 4 query heads of 16 and `kv_heads` key/value heads."""

    def __init__(self, kv_heads=4):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(64, 64), torch.nn.Linear(64, 2 * 16 * kv_heads)
        self.kv_heads = kv_heads

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 16).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, 16).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=self.kv_heads != 4)
        return y.float().pow(2).sum()


def _workspaces(p, op):
    return sorted(s.nbytes for s in p.trace.storages
                  if "kernel workspace" in s.roles and p.trace.ops[s.created_by].name == op)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")
def test_cuda_kernel_scratch_follows_the_sources():
    """From the sources, not yet measured on a GPU (tests/test_real_gpu.py will): flash
    attention's backward keeps softmax_d (b x h x round128(s) floats) and an fp32 dQ accumulator
    (b x round128(s) x h x round32(d) floats), and for grouped-query attention dK and dV
    expanded to every query head (flash_api.cpp, mha_bwd); LayerNorm's backward over more than
    64Ki rows of few columns keeps per-block partial dgamma/dbeta (layer_norm_kernel.cu)."""
    b, s, h, d = 2, 100, 4, 16
    flash = "aten._scaled_dot_product_flash_attention_backward.default"
    p = tapescope.profile(_Attention, tapescope.spec((b, s, 64)), device="cuda", gpu="a100",
                          amp="bf16")
    assert p.facts["sdpa_backends"] == {"flash": 1}
    assert _workspaces(p, flash) == sorted([b * h * 128 * 4, b * 128 * h * 32 * 4])
    gqa = tapescope.profile(lambda: _Attention(kv_heads=2), tapescope.spec((b, s, 64)),
                            device="cuda", gpu="a100", amp="bf16")
    expanded = b * s * h * d * 2  # bf16, all 4 query heads
    assert _workspaces(gqa, flash) == sorted([b * h * 128 * 4, b * 128 * h * 32 * 4,
                                              expanded, expanded])
    # cuDNN attention (H100) picks its workspace at run time: reported as not counted
    h100 = tapescope.profile(_Attention, tapescope.spec((b, s, 64)), device="cuda", gpu="h100",
                             amp="bf16")
    assert "cuDNN attention" in " ".join(h100.facts["heuristics"]["CUDA kernel scratch"])

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(8, 64), torch.nn.LayerNorm(64)

        def forward(self, x):
            return self.norm(self.lin(x)).float().pow(2).sum()

    rows = 2 * 40000  # M > 64Ki rows of N = 64: N / 32 = 2 < 108 SMs / 2 on an A100
    p = tapescope.profile(Norm, tapescope.spec((2, 40000, 8)), device="cuda", gpu="a100",
                          dtype="bf16")
    blocks_y = min(32768 // 2, -(-rows // 32))
    assert _workspaces(p, "aten.native_layer_norm_backward.default") == [blocks_y * 64 * 2] * 2


def test_channels_last_decision_follows_suggest_memory_format():
    """Conv.cpp takes the channels-last path when either operand's suggest_memory_format is
    channels-last, which c10 decides from the strides (size-1 dimensions included): a 1-D
    convolution over one position of a transposed activation runs channels-last, one over a
    longer transposed activation does not (Convolution.cpp first makes the 3-D input
    contiguous). tapescope's decision equals torch's own Python port of suggest_memory_format
    on the tensor the oneDNN path sees (view4d: unsqueeze(2) of the contiguous input)."""
    from torch._prims_common import suggest_memory_format

    from tapescope.capture.fidelity.convolution import _as_seen, _strides_like_channels_last

    cases = [torch.randn(6, 1, 8).transpose(1, 2), torch.randn(6, 4, 8).transpose(1, 2),
             torch.randn(6, 8, 5), torch.randn(2, 8, 4, 4).contiguous(
                 memory_format=torch.channels_last), torch.randn(2, 8, 1, 1),
             torch.randn(2, 8, 4, 4).permute(0, 1, 3, 2), torch.randn(1, 8, 1, 6),
             torch.randn(2, 3, 4, 4, 4).contiguous(memory_format=torch.channels_last_3d),
             torch.randn(2, 1, 5).expand(2, 8, 5)]
    for t in cases:
        # a 1-D convolution's input is made contiguous (its 3-D suggested format), then viewed
        seen = t.contiguous().unsqueeze(2) if t.dim() == 3 else t
        assert _as_seen(t) == (tuple(seen.shape), tuple(seen.stride()))
        expected = suggest_memory_format(seen) in (torch.channels_last, torch.channels_last_3d)
        assert _strides_like_channels_last(*_as_seen(t)) == expected, (t.shape, t.stride())


class _Deconv(torch.nn.Module):
    """One transposed convolution whose input needs a gradient (2-D; 1-D or 3-D by `dims`)."""

    def __init__(self, c, o, k, stride, padding, dims=2):
        super().__init__()
        deconv = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d,
                  3: torch.nn.ConvTranspose3d}[dims]
        self.deconv = deconv(c, o, k, stride, padding)
        self.scale = torch.nn.Parameter(torch.ones(c, *(1,) * dims))

    def forward(self, x):
        return self.deconv(x * self.scale).pow(2).sum()


DECONVS = {  # name -> (_Deconv arguments, input shape)
    "4x4/2 upsampling (DCGAN)": ((16, 8, 4, 2, 1), (8, 16, 8, 8)),
    "3x3/1": ((16, 8, 3, 1, 1), (8, 16, 8, 8)),
    "more output channels than input": ((16, 32, 4, 2, 1), (2, 16, 8, 8)),
    "1-D, 16/8 (HiFi-GAN's upsampler)": ((32, 16, 16, 8, 4, 1), (2, 32, 32)),
    "3-D, 2/2 (a U-Net decoder; AVX2's direct weight gradient in 3-D)":
        ((16, 8, 2, 2, 0, 3), (2, 16, 8, 8, 8)),
}


@pytest.mark.parametrize("name", DECONVS)
def test_transposed_convolution(name):
    """mkldnn_convolution_transpose(_backward) runs oneDNN's deconvolution: the convolution
    with the roles swapped. Its backward (grad_input is that convolution's forward, the weight
    gradient its weight gradient with grad_output as the source, each nested in the
    deconvolution's scratchpad) is checked op by op against the allocator, and so is the
    forward at unit strides (the swapped backward-data kernel and the f32 output a bias needs)
    and at other strides (that convolution's brgconv_strided, nested, on NHWC copies: main
    before noted it as an estimate, 5-6% low)."""
    args, shape = DECONVS[name]
    p, real, ops = _measure(lambda: _Deconv(*args), (tapescope.spec(shape),), optimizer="sgd")
    checked = _excess(ops, "aten.convolution_backward") + _excess(ops, "aten.convolution")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked


class _CausalConv1d(torch.nn.Module):
    """Mamba's causal depthwise convolution: a Linear's (batch, seq, channels) output transposed
    to (batch, channels, seq), a depthwise Conv1d padded by kernel - 1, cut to the sequence."""

    def __init__(self, channels, kernel):
        super().__init__()
        self.lin = torch.nn.Linear(channels, channels)
        self.conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels,
                                    padding=kernel - 1)

    def forward(self, x):
        return self.conv(self.lin(x).transpose(1, 2))[..., :x.shape[1]].pow(2).mean()


@pytest.mark.parametrize("seq", [1, 16])
def test_one_dimensional_convolution_of_a_transposed_activation(seq):
    """Convolution.cpp makes a 1-D convolution's 3-D input contiguous (a copy of the transposed
    activation) before viewing it as 2-D: the oneDNN kernels then run NCHW, exact op by op. Over
    one position the transposed tensor is already contiguous and its 2-D view has channels-last
    strides: oneDNN runs channels-last, whose brgemm kernels are estimates, and the report
    says so."""
    p, real, ops = _measure(lambda: _CausalConv1d(32, 4), (tapescope.spec((2, seq, 32)),),
                            optimizer="sgd")
    if seq == 1:  # channels-last: the brgemm kernels and the backward's copies are estimates
        assert any("1-D convolution over one position" in n
                   for n in p.facts["heuristics"]["oneDNN convolution scratch"])
        return
    checked = _excess(ops, "aten.convolution_backward") + _excess(ops, "aten.convolution")
    assert len(checked) == 2 and all(m == p for m, p in checked), checked
    assert p.first_step_peak_bytes == real.peaks[1]


class _LinearAlgebra(torch.nn.Module):
    """A parameter's SPD matrix (or a batch of them) through one linalg op, as a second-order
    optimizer's preconditioner or a Gaussian head uses it."""

    def __init__(self, which, n, batch):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(*batch, n, n) / n ** 0.5)
        self.which, self.n = which, n

    def forward(self, x):
        spd = self.w @ self.w.transpose(-1, -2) + torch.eye(self.n)
        out = {"cholesky": lambda: torch.linalg.cholesky(spd),
               "inv": lambda: torch.linalg.inv(spd),
               "solve": lambda: torch.linalg.solve(spd, x.T.expand(*spd.shape[:-1], -1)),
               "eigh": lambda: torch.linalg.eigh(spd)[1]}[self.which]()
        return (out ** 2).sum() + x.sum()


@pytest.mark.parametrize("which", ["cholesky", "inv", "solve", "eigh"])
@pytest.mark.parametrize("n,batch", [(48, ()), (20, (3,))])
def test_linear_algebra_matches_the_allocator(which, n, batch):
    """The LAPACK-backed ops' in-kernel buffers (fidelity/linalg.py): lu_solve's pivot checks,
    inverse's LU copy and pivots, syevd's work arrays, the info checks; op by op. The peak may
    differ by the Python-scalar temporaries of the backward's `mul` (12 B, docs/validation.md)."""
    torch.manual_seed(0)
    build = lambda: _LinearAlgebra(which, n, batch)  # noqa: E731
    p, real, ops = _measure(build, (tapescope.spec((8, n)),), optimizer="sgd")
    names = {"cholesky": ["aten.linalg_cholesky_ex", "aten._linalg_check_errors"],
             "inv": ["aten.linalg_inv_ex", "aten._linalg_check_errors"],
             "solve": ["aten._linalg_solve_ex", "aten.linalg_lu_solve"],
             "eigh": ["aten._linalg_eigh"]}[which]
    checked = [e for name in names for e in _excess(ops, name)]
    assert checked and all(m == p for m, p in checked), checked
    assert 0 <= real.peaks[1] - p.first_step_peak_bytes <= 12


class _MixedDtypes(torch.nn.Module):
    """Binary ops whose tensor operands differ in dtype: a float activation times a bool mask
    (a message-passing layer's `mul(float, bool)`), plus an int64 tensor, and an in-place bf16
    update by a float32 tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        mask = x > 0
        counts = x.floor().long()
        y = h * mask + h.mul(counts) - h.div(counts + 1)
        low = h.detach().bfloat16()
        low.add_(h.detach())
        return y.pow(2).mean() + low.float().mean()


def test_mixed_dtype_operands_are_copied():
    """TensorIterator's common-dtype temporaries on CPU (fidelity/promotion.py), op by op."""
    p, real, ops = _measure(_MixedDtypes, (tapescope.spec((256, 64)),), optimizer="sgd")
    checked = {name: _excess(ops, name, "forward")
               for name in ("aten.mul", "aten.add_", "aten.div", "aten.add")}
    assert all(checked.values()), checked
    assert all(m == p for c in checked.values() for m, p in c), checked


class _Bf16Mlp(torch.nn.Module):
    """Products that take each branch of oneDNN's bf16 matmul blocking: a reduction longer than
    its 1024-wide K block (accumulators per N chunk), weight gradients read column-major (the
    copied A buffer and up to 16 N chunks), a one-column result (oneDNN's src is the weight),
    and a batch smaller than the threads' share."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(1536, 96), torch.nn.GELU(), torch.nn.Linear(96, 200),
            torch.nn.GELU(), torch.nn.Linear(200, 1))

    def forward(self, x):
        return self.net(x)


def _onednn_runs_bf16_matmul() -> bool:
    """brg_matmul:avx512_core_bf16 is what runs: AVX512-BF16 without AMX (Linux's cpu flags)."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return (torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_bf16" in flags
            and "amx_bf16" not in flags)


def _bf16_matmul_checked(amp: bool) -> tuple[list, tuple, tuple]:
    """(the mm/addmm excesses of step 1, measured and predicted), the real peaks of steps 1 and
    2, the predicted ones) for _Bf16Mlp in bf16 (or under CPU autocast bf16)."""
    x = tapescope.spec((48, 1536))
    options = dict(amp="bf16") if amp else dict(dtype=torch.bfloat16)
    p = tapescope.profile(_Bf16Mlp, x, optimizer="sgd", **options)
    real = run_real_steps(_Bf16Mlp, (x,), optimizer="sgd", **options)
    ops = compare_ops(p, real, 1)
    return (_excess(ops, "aten.mm") + _excess(ops, "aten.addmm"), (real.peaks[1], real.peaks[2]),
            (p.first_step_peak_bytes, p.peak_bytes))


@pytest.mark.parametrize("amp", [False, True], ids=["bf16 weights", "autocast"])
def test_bf16_matmul_scratchpad_matches_the_allocator(amp):
    """oneDNN's brg_matmul:avx512_core_bf16 inside a bf16 mm/addmm (devices/onednn_matmul.py):
    its batch, repacked-B, copied-A and f32 accumulator buffers per thread, every product exact
    op by op, and both steps' peaks (main before: every product short by its scratchpad, which
    is larger than most of these results)."""
    if not _onednn_runs_bf16_matmul():
        pytest.skip("oneDNN has no brgemm bf16 matmul here (avx512_core_bf16 without AMX)")
    products, real_peaks, predicted_peaks = _bf16_matmul_checked(amp)
    assert len(products) == 8 and all(m == p for m, p in products), products
    assert predicted_peaks == real_peaks


class _Bf16Batches(torch.nn.Module):
    """bf16 batched products of several shapes: baddbmm into the input, then bmm (their
    backwards read the expanded gradient of the sum and transposed operands)."""
    SHAPES = [(4, 64, 32, 64), (3, 100, 40, 70), (16, 17, 64, 17), (2, 2, 16, 16)]  # B, M, K, N

    def __init__(self):
        super().__init__()
        self.a = torch.nn.ParameterList(torch.randn(b, m, k) for b, m, k, _ in self.SHAPES)
        self.w = torch.nn.ParameterList(torch.randn(b, k, n) for b, _, k, n in self.SHAPES)

    def forward(self, x):
        outs = [torch.baddbmm(x[:, :m, :n], a, w) if i == 0 else torch.bmm(a, w)
                for i, ((_, m, _, n), a, w) in enumerate(zip(self.SHAPES, self.a, self.w))]
        return sum(o.float().sum() for o in outs)


def _bf16_batches_checked(threads: int) -> tuple[list, tuple, tuple, list]:
    """(the bmm/baddbmm excesses of step 1, measured and predicted), the real peaks of steps 1
    and 2, the predicted ones, the profile's matmul notes) for _Bf16Batches at `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = tapescope.spec((4, 64, 64))
        p = tapescope.profile(_Bf16Batches, x, optimizer="sgd", dtype=torch.bfloat16)
        real = run_real_steps(_Bf16Batches, (x,), optimizer="sgd", dtype=torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    ops = compare_ops(p, real, 1)
    return (_excess(ops, "aten.bmm") + _excess(ops, "aten.baddbmm"),
            (real.peaks[1], real.peaks[2]), (p.first_step_peak_bytes, p.peak_bytes),
            p.run.heuristics.get("oneDNN matmul scratch", []))


@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_bmm_scratchpad_matches_the_allocator(threads):
    """A bf16 bmm/baddbmm on AVX512-BF16 runs oneDNN's brg_matmul with the batch as its outer
    dimension (capture/fidelity/batched_matmul.py): the batch enters the blocking search, so the
    per-thread accumulators differ from one 2-D product's (4 x 64x32 @ 32x64 on 2 threads: 42,624
    bytes, against 26,240 for one); mkldnn_matmul copies the expanded gradient of the sum first.
    The last shape (16^3 multiply-adds in all) stays in ATen's split path. Every product exact
    op by op at 1 and 3 threads, and both steps' peaks (main before: noted, each short by its
    scratchpad). Capped at AVX2: tested with the mm products below."""
    if not _onednn_runs_bf16_matmul():
        pytest.skip("oneDNN has no brgemm bf16 matmul here (avx512_core_bf16 without AMX)")
    products, real_peaks, predicted_peaks, notes = _bf16_batches_checked(threads)
    assert len(products) == 12 and all(m == p for m, p in products), products
    assert predicted_peaks == real_peaks
    assert not notes


class _EagerAttention(torch.nn.Module):
    """Self-attention spelt out (scores, softmax, weighted values), as models without SDPA do."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


def test_eager_attention_bmm_under_autocast_matches_the_allocator():
    """Eager attention under CPU autocast bf16: the scores and weighted-value products and their
    four backward products run oneDNN's batched matmul (a transposed key read as is, the
    permuted gradient copied): each exact op by op (main before: 50,816 to 116,480 bytes short
    each), both steps' peaks exact."""
    if not _onednn_runs_bf16_matmul():
        pytest.skip("oneDNN has no brgemm bf16 matmul here (avx512_core_bf16 without AMX)")
    x = tapescope.spec((2, 128, 64))
    p = tapescope.profile(_EagerAttention, x, optimizer="sgd", amp="bf16")
    real = run_real_steps(_EagerAttention, (x,), optimizer="sgd", amp="bf16")
    products = _excess(compare_ops(p, real, 1), "aten.bmm")
    assert len(products) == 6 and all(m == p for m, p in products), products
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])


STRIDED_BACKWARD = {  # name -> (_Conv arguments, input shape): brgconv_strided backward-data
    "3x3/2, a map the stride divides": ((16, 32, 3, 2, 1), (2, 16, 32, 32)),
    "4x4/2 of few channels (padded to a block on AVX-512)": ((8, 16, 4, 2, 1), (2, 8, 20, 20)),
    "3x3/2 on an odd map (exec_trans: a row buffer)": ((30, 60, 3, 2, 1), (2, 30, 17, 17)),
}


def _strided_backward_checked(names, dtype: str) -> dict:
    """name -> [(measured, predicted) excess of convolution_backward, [real peak, predicted
    peak], the kernel's exact flag] for STRIDED_BACKWARD in `dtype`, on this process's ISA."""
    from tapescope.capture.fidelity.convolution import conv_problem
    from tapescope.devices import onednn_brgemm_bwd
    from tapescope.devices.cpu import cpu_target

    dt = getattr(torch, dtype)
    out = {}
    for name in names:
        args, shape = STRIDED_BACKWARD[name]
        conv = _Conv(*args).conv
        c = conv_problem(shape, conv.weight.shape, True, conv.stride, _padding(conv),
                         conv.dilation, conv.groups, False, dt.itemsize)
        exact = onednn_brgemm_bwd.strided_backward_data(c, cpu_target()).exact
        p = tapescope.profile(lambda: _Conv(*args), tapescope.spec(shape), optimizer="sgd",
                              dtype=dt, steps=1)
        real = run_real_steps(lambda: _Conv(*args), (tapescope.spec(shape),), optimizer="sgd",
                              dtype=dt, steps=1)
        out[name] = [_excess(compare_ops(p, real, 1), "aten.convolution_backward"),
                     [real.peaks[1], p.first_step_peak_bytes], exact]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_strided_backward_data_matches_the_allocator(dtype):
    """oneDNN runs a strided backward-data as brgconv_strided on NHWC copies (devices/
    onednn_brgemm_bwd.py: diff_dst and weights reordered, the NHWC diff_src copied back through
    one more buffer, the page-aligned batch, input, mask, row and bf16 accumulator buffers), on
    AVX-512 and AVX2 alike (main before: the blocked direct kernel, 11% to 31% short inside the op
    on this host's fp32 rows). fp32 sizes that do not depend on the cache-driven blocking say
    exact; bf16's accumulators do, so bf16 says estimate while the sizes agree here."""
    if dtype == "bfloat16" and not _onednn_runs_bf16_convolutions():
        pytest.skip("oneDNN has no bf16 convolution here (Slow2d)")
    results = _strided_backward_checked(list(STRIDED_BACKWARD), dtype)
    for name, (excesses, (real_peak, predicted_peak), exact) in results.items():
        assert len(excesses) == 1 and excesses[0][0] == excesses[0][1], (name, excesses)
        assert predicted_peak == real_peak, name
        # bf16's accumulator block is the cache-driven search's choice: always an estimate; fp32
        # is exact where the candidate ic blocks pad alike (all of these on AVX-512; on AVX2 a
        # 24-channel block is a candidate too, and the rule says estimate for 30 channels)
        if dtype == "bfloat16" or torch.backends.cpu.get_cpu_capability() == "AVX512":
            assert exact == (dtype == "float32"), name


def test_matmul_and_strided_backward_with_the_isa_capped_at_avx2():
    """Capped at AVX2 (one child process: oneDNN reads its cap once): oneDNN has no bf16 matmul
    (mkldnn_bf16_device_check), so ATen's gemm runs _Bf16Mlp's products and allocates nothing
    inside them, and _Bf16Batches' bmm/baddbmm split into one addmm per matrix (one matrix's copy
    of the expanded gradient at a time; main before: not counted for bf16); the fp32
    STRIDED_BACKWARD problems run brgconv_strided:avx2 with 8-channel vectors (main before: +4%
    to +8% over on such models). Op by op and at the peaks."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this host is not AVX-512: the tests above cover its ISA")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    code = ("import json; from tests.test_kernel_workspace import _bf16_matmul_checked, "
            "_strided_backward_checked, STRIDED_BACKWARD, _bf16_batches_checked; print(json.dumps("
            "[_bf16_matmul_checked(False), _strided_backward_checked(list(STRIDED_BACKWARD), "
            "'float32'), _bf16_batches_checked(2)]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    matmul, strided, batches = json.loads(done.stdout.strip().splitlines()[-1])
    products, real_peaks, predicted_peaks = matmul
    assert len(products) == 8 and all(m == p for m, p in products), products
    assert predicted_peaks == real_peaks
    # bf16 batches without oneDNN bf16: ATen's split path, one matrix's operand copies at a time
    products, real_peaks, predicted_peaks, notes = batches
    assert len(products) == 12 and all(m == p for m, p in products), products
    assert predicted_peaks == real_peaks and not notes
    for name, (excesses, (real_peak, predicted_peak), _) in strided.items():
        assert len(excesses) == 1 and excesses[0][0] == excesses[0][1], (name, excesses)
        assert predicted_peak == real_peak, name


def test_fp16_channels_last_slow2d_matches_the_allocator():
    """fp16 without oneDNN's fp16 path runs ATen's Slow2d; on channels-last tensors it first
    makes the weight contiguous in that format, then the im2col columns (main before: not
    counted, -30% at this single convolution's peak). Its backward reads a grad_output that is
    channels-last on the CPU: `expanded_grad * y` of pow's backward, which the fake kernel (a
    reference that converts the expanded operand to float first) made contiguous, so a copy the
    real step does not make was counted (+8.5% at the peak) until fidelity/layouts.py gave
    half-precision elementwise outputs TensorIterator's layout. Both ops exact, no estimate
    noted."""
    from tapescope.torch_compat import select_conv_backend

    x16 = torch.empty(2, 16, 16, 16, dtype=torch.half)
    if select_conv_backend(x16, torch.empty(32, 16, 3, 3, dtype=torch.half), (1, 1), (1, 1),
                           (1, 1), False, (0, 0), 1) != "Slow2d":
        pytest.skip("fp16 convolutions do not run on Slow2d here")
    args, shape = (16, 32, 3, 1, 1, 1, 1, True), (2, 16, 16, 16)
    p = tapescope.profile(lambda: _Conv(*args), tapescope.spec(shape), optimizer="sgd",
                          amp="fp16", steps=1)
    real = run_real_steps(lambda: _Conv(*args), (tapescope.spec(shape),), optimizer="sgd",
                          amp="fp16", steps=1)
    ops = compare_ops(p, real, 1)
    (measured, predicted), = _excess(ops, "aten.convolution")
    assert measured == predicted == 9216 + 147456 + 32768   # weight copy, columns, output
    # weight copy, grad_input, grad_bias, grad_weight, columns; grad_output is not copied
    (measured, predicted), = _excess(ops, "aten.convolution_backward")
    assert measured == predicted == 9216 + 16384 + 64 + 9216 + 147456
    assert p.first_step_peak_bytes == real.peaks[1]
    assert "oneDNN convolution scratch" not in p.run.heuristics
