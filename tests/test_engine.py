"""tapescope's Python autograd engine runs the same ops, in the same order, as torch's C++ engine.

Truth: the real step under torch.profiler, whose dispatched aten ops (outermost, below the
CompositeImplicitAutograd decompositions) are what a dispatch mode sees.
"""

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.validate.real import run_real_steps

from .conftest import TINY_GPT2, TINY_LLAMA, profile_spec, tiny


def _normalise_fake(ops):
    """Known naming differences between what a dispatch mode sees and the profiler's outer ops:
    an in-place op whose backward needs its input clones it from inside its autograd kernel (the
    profiler nests that clone in the op), and reshape takes `view` for tensor subclasses where it
    takes `_reshape_alias` for plain tensors (both are views)."""
    out = []
    for i, op in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if op.name == "aten.clone.default" and nxt is not None \
                and nxt.name.split(".")[1].endswith("_") \
                and nxt.inputs and nxt.inputs[0].value == op.inputs[0].value:
            continue
        out.append((op.phase, op.name.rsplit(".", 1)[0]))
    return out


def _real(real, step):
    return [(p, n.replace("::", ".").replace("aten._reshape_alias", "aten.view"))
            for s, p, n in real.ops if s == step and p in ("forward", "backward", "optimizer")]


def _same_ops(m, steps=2, optimizer="adamw"):
    p = profile_spec(m, optimizer=optimizer, steps=steps)
    real = run_real_steps(m.build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, optimizer=optimizer,
                          steps=steps)
    return _normalise_fake(p.ops), _real(real, steps)


@pytest.mark.parametrize("spec", [TINY_GPT2, TINY_LLAMA])
def test_transformer_op_sequence(spec):
    fake, real = _same_ops(tiny(spec))
    assert fake == real


def test_convnet_op_sequence():
    fake, real = _same_ops(tiny("torchvision:resnet18", batch=2, seq=32), steps=1, optimizer="sgd")
    assert fake == real


class Scale2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 2 + x * 0


class Hooked(nn.Module):
    """Hooks of every kind the engine must call, a custom Function, broadcasting, a dtype cast."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(8))
        self.b.register_full_backward_hook(lambda mod, gin, gout: None)

    def forward(self, x):
        h = self.a(x)
        h.register_hook(lambda g: g * 3)        # tensor hook on a non-leaf
        h.retain_grad()
        h = Scale2.apply(h)
        y = self.b(h) + self.bias                # bias broadcast over the batch
        y = y.double().sum(dim=0).float()        # gradient dtype casts
        return y.sum()


def test_hooks_functions_and_casts():
    def build():
        m = Hooked()
        m.bias.register_hook(lambda g: g + 1)   # leaf hook, run by AccumulateGrad
        return m

    from tapescope.zoo import ModelSpec
    from tapescope.capture.model import spec as input_spec
    m = ModelSpec("hooked", build, (input_spec((4, 8)),))
    fake, real = _same_ops(m, steps=1, optimizer=None)
    assert fake == real


def test_gradient_accumulation_steals_or_copies_like_the_engine():
    """Two consumers of one tensor (x used twice) and a parameter used twice (tied)."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 8))

        def forward(self, x):
            y = x @ self.w
            return (y @ self.w + y).relu().sum()

    from tapescope.zoo import ModelSpec
    from tapescope.capture.model import spec as input_spec
    m = ModelSpec("tied", Tied, (input_spec((4, 8)),))
    fake, real = _same_ops(m, steps=1, optimizer="sgd")
    assert fake == real
    p = profile_spec(m, optimizer="sgd", steps=1)
    r = run_real_steps(m.build, m.inputs, loss_fn=None, optimizer="sgd", steps=1)
    assert p.first_step_peak_bytes == r.peaks[1]


class _Linear(nn.Module):
    """A linear layer applied to its input after a permutation (as nn.MultiheadAttention does)."""

    def __init__(self, dims, shape):
        super().__init__()
        self.proj = nn.Linear(shape[-1], 8)
        self.dims = dims

    def forward(self, x):
        return self.proj(x.permute(*self.dims) if self.dims else x)


@pytest.mark.parametrize("shape,dims", [
    ((4, 6), None),                # addmm
    ((2, 4, 6), None),             # contiguous 3-d: one addmm on the flattened input
    ((4, 2, 6), (1, 0, 2)),        # transposed 3-d: matmul, then add_ for a plain tensor
    ((2, 3, 4, 6), None),          # contiguous 4-d: flattened
    ((3, 2, 4, 6), (1, 0, 2, 3)),  # non-contiguous 4-d: matmul + add_
    ((6,), None),                  # 1-d input
])
def test_linear_takes_the_plain_tensor_branch(shape, dims):
    """aten::linear adds the bias out of place for tensor subclasses (FakeTensor) and in place for
    plain tensors; the trace must run what the real step runs."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec("linear", lambda: _Linear(dims, shape), (input_spec(shape, requires_grad=True),))
    fake, real = _same_ops(m, steps=1, optimizer=None)
    assert fake == real


@pytest.mark.parametrize("batch_first,batch", [(True, 2), (True, 1), (False, 2)])
def test_multihead_attention_takes_the_plain_tensor_branch(batch_first, batch):
    """nn.MultiheadAttention calls linear from inside F.multi_head_attention_forward (a Python
    function a TorchFunctionMode does not see into); batch_first transposes the in-projection's
    input, so a plain tensor ends in add_. The whole step, against the real one."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    shape = (batch, 5, 8) if batch_first else (5, batch, 8)

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    m = ModelSpec("mha", SelfAttention, (input_spec(shape),))
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert fake == real


class _Gather(nn.Module):
    """Advanced indexing: the backward is IndexBackward0 (a relative-position-bias table)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))
        self.register_buffer("index", torch.tensor([[0, 3, 5], [7, 7, 1]]))

    def forward(self, x):
        return x + self.table[self.index].sum(-1)


def test_index_backward_accumulates_in_place_as_for_plain_tensors():
    """index_backward runs `_index_put_impl_` into its zeros for plain tensors, `index_put` (one
    more self-sized tensor) for subclasses; the trace runs the plain-tensor branch."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec("gather", _Gather, (input_spec((2, 3), requires_grad=True),))
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert ("backward", "aten._index_put_impl_") in real
    assert fake == real


_SELECTIONS = {
    "topk": lambda h: h.topk(3, dim=-1)[0],
    "max(dim)": lambda h: h.max(dim=1)[0],
    "min(dim)": lambda h: h.min(dim=1)[0],
    "median(dim)": lambda h: h.median(dim=1)[0],
    "sort": lambda h: h.sort(dim=1)[0],
}


class _ValueSelecting(nn.Module):
    """A reduction that selects values (a router's top-k, max over a dim): its backward scatters
    the gradient into a zeros buffer."""

    def __init__(self, which):
        super().__init__()
        self.which, self.lin = which, nn.Linear(8, 16)

    def forward(self, x):
        return _SELECTIONS[self.which](self.lin(x)).pow(2).sum()


@pytest.mark.parametrize("which", list(_SELECTIONS))
def test_value_selecting_backward_scatters_in_place(which):
    """value_selecting_reduction_backward makes `zeros` and scatters into it in place for plain
    tensors (`new_zeros` + out-of-place `scatter` for subclasses: one more input-sized tensor)."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec(which, lambda: _ValueSelecting(which), (input_spec((64, 8)),))
    fake, real = _same_ops(m, steps=1, optimizer=None)
    assert ("backward", "aten.scatter_") in real
    assert fake == real
    p = profile_spec(m, optimizer=None, steps=1)
    peak = run_real_steps(m.build, m.inputs, optimizer=None, steps=1).peaks[1]
    assert abs(p.first_step_peak_bytes - peak) / peak < 1e-3


class _RouterWeights(nn.Module):
    """A router's weights of the chosen experts: gather, then normalised in place (DeepSeek-V3)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, x):
        scores = self.lin(x).sigmoid()
        weights = scores.gather(1, scores.topk(2, dim=-1)[1])
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights.pow(2).sum()


def test_gather_backward_scatters_in_place():
    """gather_backward adds into its new_zeros with scatter_add_ for plain tensors (scatter_add, one
    more input-sized tensor, for subclasses); the in-place division's clone of its input is nested
    inside div_ in the profiler, as for any in-place op."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec("router weights", _RouterWeights, (input_spec((16, 8)),))
    fake, real = _same_ops(m, steps=1, optimizer=None)
    assert ("backward", "aten.scatter_add_") in real
    assert fake == real
    p = profile_spec(m, optimizer=None, steps=1)
    peak = run_real_steps(m.build, m.inputs, optimizer=None, steps=1).peaks[1]
    assert abs(p.first_step_peak_bytes - peak) <= 12   # the 8-12 byte Python-number scalar


class _NormThenPermute(nn.Module):
    """A norm whose output is consumed transposed (Swin's tail: norm, then channels first), and
    whose input came through a view, so the backward reshapes the norm's grad_input."""

    def __init__(self, norm):
        super().__init__()
        self.kind = norm
        self.proj = nn.Linear(24, 24)
        self.norm = nn.LayerNorm(8) if norm == "layer" else nn.GroupNorm(2, 8)
        self.head = nn.Linear(3, 4) if norm == "layer" else nn.Linear(8, 4)

    def forward(self, x):
        if self.kind == "layer":
            x = self.norm(self.proj(x).view(-1, 3, 8))   # (B, 3, 8), normalised over 8
            return self.head(x.transpose(1, 2))         # consumed as (B, 8, 3)
        x = self.norm(self.proj(x).view(-1, 8, 3))       # (B, C=8, L=3)
        return self.head(x.transpose(1, 2))             # consumed as (B, 3, 8)


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_norm_backward_gives_grad_input_the_real_kernels_layout(norm):
    """The norm backward's decomposition lays grad_input out like grad_out (transposed here); the
    real kernels make it contiguous, so the view's backward reshapes it without a copy."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec("norm", lambda: _NormThenPermute(norm), (input_spec((2, 24)),))
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert fake == real


class _BatchNormOverTime(nn.Module):
    """BatchNorm1d over the channels of a (batch, time, channels) input: it normalises a
    transposed, non-contiguous tensor, and a reshape of its (transposed back) output follows."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2).reshape(-1, 8)


def test_batch_norm_output_takes_the_real_kernels_layout():
    """The CPU kernel allocates its output (and grad_input) contiguous whatever the input's
    strides; the meta kernel keeps the input's. Then the reshape copies in the real step only."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.validate.real import run_real_steps
    from tapescope.zoo import ModelSpec

    m = ModelSpec("bn", _BatchNormOverTime, (input_spec((5, 4, 8)),),
                  loss_fn=lambda out, x: out.mean())
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert fake == real
    p = profile_spec(m, optimizer="adamw")
    peaks = run_real_steps(m.build, m.inputs, loss_fn=m.loss_fn, optimizer="adamw").peaks
    assert 0 <= peaks[1] - p.first_step_peak_bytes <= 12  # the scalar operands' 0-d tensors
    assert 0 <= peaks[2] - p.peak_bytes <= 12


class _MaskedAttention(nn.Module):
    """Attention with a learnt additive mask (T5's relative position bias): SDPA's math path."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.bias = nn.Parameter(torch.zeros(1, 2, 5, 5))

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


class _Literals(nn.Module):
    """Tensor literals made three ways: torch.tensor, torch.as_tensor, a scalar assigned in."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.ones(4, device=x.device)
        scale[0] = 3  # into a tensor autograd does not track (no view regeneration)
        return self.proj(x) * scale * torch.as_tensor(2.0) + torch.tensor(0.5)


@pytest.mark.parametrize("model", [_MaskedAttention, _Literals])
def test_composite_branches_and_literals_run_as_for_plain_tensors(model):
    """SDPA's math path adds the mask in place for plain tensors (`add` for subclasses); tensor
    literals dispatch different ops by how they are made. The whole step against the real one."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    shape = (2, 5, 8) if model is _MaskedAttention else (2, 4)
    m = ModelSpec("m", model, (input_spec(shape),))
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert fake == real


class _InPlaceOnViews(nn.Module):
    """In-place ops on views of activations: relu_ on a reshaped output (it saves its output), a
    scalar assigned into a slice, and Dropout(inplace) after flatten (efficientnet's classifier)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 8)
        self.drop = nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        v = self.a(x).view(2, 2, 4)
        v.relu_()
        u = self.b(x)
        u[:, 0] = 3
        w = self.drop((self.c(x).unsqueeze(-1) + 0).flatten(1))
        return v.sum() + u.sum() + w.sum()


def test_in_place_ops_on_views_regenerate_views_as_for_plain_tensors():
    """For a plain tensor autograd regenerates the view as AsStridedBackward0 (no forward op; a
    base-sized new_zeros, as_strided, copy_, as_strided in the backward) and CopySlices takes its
    view with as_strided; for a subclass it would replay the view ops."""
    from tapescope.capture.model import spec as input_spec
    from tapescope.zoo import ModelSpec

    m = ModelSpec("views", _InPlaceOnViews, (input_spec((2, 4)),))
    fake, real = _same_ops(m, steps=2, optimizer="adamw")
    assert ("backward", "aten.new_zeros") in real
    assert fake == real


class _Float64IntoFloat32Norm(nn.Module):
    """A float64 input into a float32 RMSNorm (the weight broadcast over a float64 product), then
    back to float32: the weight's gradient is a float64 product reduced to (64,) and cast."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.RMSNorm(64), nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(self.norm(x).float())


def test_reduced_gradient_is_released_before_its_cast():
    """validate_outputs assigns the reduced gradient over the broadcast one (`grad =
    maybe_reduce(i, std::move(grad))`), so the 65,536-byte float64 product is freed before
    `.to(float32)` runs. Truth: the allocator's peaks of the real step (it peaks in the weight's
    reduction, 256 B below where keeping the product alive through the cast would put it)."""
    from tapescope.capture.model import spec as input_spec

    inputs = (input_spec((8, 16, 64), dtype=torch.float64),)
    with pytest.warns(UserWarning, match="Mismatch dtype"):
        p = tapescope.profile(_Float64IntoFloat32Norm, *inputs)
    real = run_real_steps(_Float64IntoFloat32Norm, inputs)
    assert (p.first_step_peak_bytes, p.peak_bytes) == (real.peaks[1], real.peaks[2])
