"""ATen's own CPU convolutions (the "slow" kernels): the columns and operand copies they make
inside `convolution` and `convolution_backward`, in the order they make them.

PyTorch runs them where oneDNN does not (Convolution.cpp `_select_conv_backend`): a double
convolution, fp16 on a CPU without oneDNN's fp16 path, bf16 below AVX-512, a tiny one-sample
one. Four kernels, each followed from its source:
- `Slow2d` (ConvolutionMM2d.cpp): the whole batch's im2col columns (`compute_columns2d`, N x
  C kh kw x oh ow; a 1x1 kernel at unit stride views its input), before the output, and again
  for the weight gradient after grad_input and grad_bias; grad_input's per-thread columns are
  `new`ed, outside the allocator. Channels-last where input or weight suggests it
  (`thnn_conv_use_channels_last`): the weight made channels-last first.
- `SlowDilated2d`/`3d` (NaiveDilatedConvolution.cpp): one batch element's columns, reused for
  every element, after the outputs; the bias gradient sums each element's grad_output into a
  temporary.
- `Slow3d` (ConvolutionMM3d.cpp): the whole batch's vol2col columns, groups included (one
  batched GEMM per sample); its backward's grad_input columns (`fgrad_input`) are the
  allocator's, whatever the kernel.
- `SlowTranspose2d` (NaiveConvolutionTranspose2d.cpp): the output first, then the whole
  batch's columns (Cout kh kw x ih iw per sample); its backward one sample's columns for
  grad_input and again for grad_weight.
- groups: Slow3d takes them itself; for the others `_convolution` / `convolution_backward`
  (Convolution.cpp) make each group's input, weight and grad_output slice contiguous in the
  whole tensor's suggested format (`subtensor`), run the kernel per group into a tensor of
  its own, and `cat` the groups' results into the op's outputs.
`SlowTranspose3d` is not modelled and says so.

A rule sees fake tensors and must not run ops on them: everything here is sizes and strides
(`_Layout`), which is also what makes a group's slice, a 1-D convolution's 2-D view or a copy
describable without a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

from .convolution import _per_dim, _strides_like_channels_last, cpu_backend
from .reductions import half_sum_of_layout
from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = ["slow_convolution_scratch", "slow_convolution_backward_scratch"]

aten = torch.ops.aten
_SOURCE = ("aten/src/ATen/native/Convolution.cpp (_convolution, convolution_backward: "
           "subtensor, cat), ConvolutionMM2d.cpp, NaiveDilatedConvolution.cpp, ConvolutionMM3d.cpp, "
           "NaiveConvolutionTranspose2d.cpp")
_TEST = "tests/test_kernel_workspace.py::test_slow_convolutions_match_the_allocator"
_TOPIC = "oneDNN convolution scratch"   # the report's heading for every convolution's estimates


@dataclass(frozen=True)
class _Layout:
    """A tensor as a kernel sees it: sizes, strides and element size."""

    sizes: tuple
    strides: tuple
    itemsize: int

    @classmethod
    def of(cls, t) -> "_Layout":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return prod(self.sizes) * self.itemsize

    def suggests_channels_last(self) -> bool:
        """suggest_memory_format() is ChannelsLast / ChannelsLast3d (MemoryFormat.h)."""
        return _strides_like_channels_last(self.sizes, self.strides)

    def _order(self, channels_last: bool) -> tuple:
        n = len(self.sizes)
        if channels_last and n in (4, 5):
            return (1,) + tuple(range(n - 1, 1, -1)) + (0,)
        return tuple(range(n - 1, -1, -1))

    def is_contiguous(self, channels_last: bool = False) -> bool:
        expected = 1
        for d in self._order(channels_last):
            if self.sizes[d] == 1:
                continue
            if self.strides[d] != expected:
                return False
            expected *= self.sizes[d]
        return True

    def contiguous(self, channels_last: bool = False) -> "_Layout":
        strides, running = [0] * len(self.sizes), 1
        for d in self._order(channels_last):
            strides[d] = running
            running *= self.sizes[d]
        return _Layout(self.sizes, tuple(strides), self.itemsize)

    def narrow(self, dim: int, size: int) -> "_Layout":
        sizes = list(self.sizes)
        sizes[dim] = size
        return _Layout(tuple(sizes), self.strides, self.itemsize)

    def select0(self) -> "_Layout":
        """`t.select(0, i)`: one batch element."""
        return _Layout(self.sizes[1:], self.strides[1:], self.itemsize)

    def view4d(self) -> "_Layout":
        """Convolution.cpp `view4d`: `unsqueeze(2)` of a 1-D convolution's 3-D tensor."""
        s, st = self.sizes, self.strides
        return _Layout((*s[:2], 1, s[2]), (*st[:2], st[2] * s[2], st[2]), self.itemsize)


@dataclass(frozen=True)
class _Geometry:
    """The convolution's spatial parameters, per dimension (1-D convolutions as 2-D)."""

    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    out: tuple          # output spatial sizes

    def columns_per_sample(self, channels: int) -> int:
        """Elements of one sample's im2col / vol2col columns: C x prod(kernel) x prod(out)."""
        return channels * prod(self.kernel) * prod(self.out)

    def columns_view_input(self) -> bool:
        """compute_columns2d/3d: a 1x1(x1) kernel at unit stride without padding views its
        input instead of making columns."""
        return (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.stride)
                and not any(self.padding))


class _Steps:
    """The kernel's sequence of Alloc / Free / Output steps as it is built (one per rule call).
    Zero-byte buffers (a copy not needed) are left out, and so are their frees."""

    def __init__(self, prefix: str = ""):
        self.steps: list = []
        self._live: set = set()
        self.prefix = prefix

    def alloc(self, name: str, nbytes: int) -> str:
        name = self.prefix + name
        if nbytes:
            self.steps.append(Alloc(name, nbytes))
            self._live.add(name)
        return name

    def free(self, *names: str) -> None:
        for name in names:
            if name in self._live:
                self.steps.append(Free(name))
                self._live.remove(name)

    def live_names(self) -> set:
        return set(self._live)

    def output(self, index: int) -> None:
        self.steps.append(Output(index))

    def contiguous(self, name: str, t: _Layout, channels_last: bool = False):
        """`t.contiguous(format)`: (the copy's name, or None where `t` already is so, and the
        layout after it)."""
        if t.is_contiguous(channels_last):
            return None, t
        return self.alloc(name, t.nbytes), t.contiguous(channels_last)

    def extend(self, steps: list) -> None:
        """Steps named by another helper (reductions.py), allocated and freed in place."""
        for s in steps:
            self.steps.append(type(s)(self.prefix + s.name, *([s.nbytes] if type(s) is Alloc
                                                                else [])))


def _half_sum(b: _Steps, t: _Layout, dtype, dims, out_numel: int) -> None:
    """`sum` of a half / bfloat16 tensor into its own dtype: a float copy and result where the
    reduced dimensions form two runs (reductions.py)."""
    b.extend(half_sum_of_layout(t.sizes, t.strides, dtype, dims, out_numel))


def _channels_last_2d(backend: str, x: _Layout, w: _Layout) -> bool:
    """Convolution.cpp determine_backend_memory_format / ConvUtils.h thnn_conv_use_channels_last:
    the 2-D slow kernels run channels-last where the input or the weight suggests it (a 5-D
    tensor suggests ChannelsLast3d, which is not ChannelsLast; measured: the transposed one
    too)."""
    return (backend in ("Slow2d", "SlowDilated2d", "SlowTranspose2d") and len(x.sizes) == 4
            and (x.suggests_channels_last() or w.suggests_channels_last()))


def _in_backend_format(b, backend: str, x: _Layout, w: _Layout) -> tuple:
    """Where ATen splits the groups itself (`_convolution`, `convolution_backward`), input and
    weight are first made contiguous in the backend's memory format; backends that take the
    groups inside the kernel receive them as they are."""
    if backend in _GROUPS_INSIDE:
        return x, w
    cl = _channels_last_2d(backend, x, w)
    _, x = b.contiguous("input in the backend's format", x, cl)
    _, w = b.contiguous("weight in the backend's format", w, cl)
    return x, w


# ---- one group: the kernels ---------------------------------------------------------------------
# Each takes the operands as the kernel receives them and `out(i, nbytes)`, which places the
# kernel's i-th result: the op's Output where the kernel makes it, a group's own buffer otherwise.

def _slow2d_forward(b, g: _Geometry, x, w, out, dtype) -> None:
    """slow_conv2d_forward_out_cpu: view_weight_2d's copy, the input's, the whole batch's
    columns, then the output."""
    cl = _channels_last_2d("Slow2d", x, w)
    weight, _ = b.contiguous("weight 2d", w, cl)
    inp, x = b.contiguous("input", x, cl)
    cols = b.alloc("columns", 0 if g.columns_view_input()
                   else x.sizes[0] * g.columns_per_sample(x.sizes[1]) * x.itemsize)
    out(0, x.sizes[0] * w.sizes[0] * prod(g.out) * x.itemsize)
    b.free(cols, inp, weight)


def _slow2d_backward(b, g: _Geometry, go, x, w, mask, out, dtype) -> None:
    """slow_conv2d_backward_out_cpu: grad_input (its columns per thread are `new`ed), grad_bias
    (`sum_out` over N, H, W of grad_output), then grad_weight from the whole batch's columns;
    each part makes its own contiguous copies in the kernel's format."""
    cl = _channels_last_2d("Slow2d", x, w)
    if mask[0]:
        weight, _ = b.contiguous("weight 2d", w, cl)
        inp, _ = b.contiguous("input", x, cl)
        grad, _ = b.contiguous("grad_output", go, cl)
        out(0, x.nbytes)
        b.free(grad, inp, weight)
    if mask[2]:
        out(2, w.sizes[0] * x.itemsize)
        _half_sum(b, go, dtype, (0, 2, 3), w.sizes[0])
    if mask[1]:
        out(1, w.nbytes)
        grad, _ = b.contiguous("grad_output for the weights", go, cl)
        cols = b.alloc("columns", 0 if g.columns_view_input()
                       else x.sizes[0] * g.columns_per_sample(x.sizes[1]) * x.itemsize)
        b.free(cols, grad)


def _dilated_forward(b, g: _Geometry, x, w, out, dtype, backend="SlowDilated2d") -> None:
    """slow_conv_dilated{2,3}d_cpu: the operands contiguous in the kernel's format, the output,
    then one sample's columns (reused for each sample)."""
    cl = _channels_last_2d(backend, x, w)
    inp, x = b.contiguous("input", x, cl)
    weight, _ = b.contiguous("weight", w, cl)
    out(0, x.sizes[0] * w.sizes[0] * prod(g.out) * x.itemsize)
    cols = b.alloc("columns", g.columns_per_sample(x.sizes[1]) * x.itemsize)
    b.free(cols, weight, inp)


def _dilated_backward(b, g: _Geometry, go, x, w, mask, out, dtype,
                      backend="SlowDilated2d") -> None:
    """slow_conv_dilated{2,3}d_backward_cpu: the operands contiguous, grad_input, grad_weight,
    grad_bias, one sample's columns; each sample's bias gradient is summed into a temporary
    (`grad_bias += grad_output_n.sum(dims)`)."""
    cl = _channels_last_2d(backend, x, w)
    grad, go = b.contiguous("grad_output", go, cl)
    inp, x = b.contiguous("input", x, cl)
    weight, _ = b.contiguous("weight", w, cl)
    for i, nbytes in enumerate((x.nbytes, w.nbytes, w.sizes[0] * x.itemsize)):
        if mask[i]:
            out(i, nbytes)
    cols = b.alloc("columns", g.columns_per_sample(x.sizes[1]) * x.itemsize
                   if mask[0] or mask[1] else 0)
    if mask[2]:
        sample = go.select0()
        dims = tuple(range(1, len(sample.sizes)))
        for n in range(x.sizes[0]):
            part = b.alloc(f"bias sum {n}", w.sizes[0] * x.itemsize)
            _half_sum(b, sample, dtype, dims, w.sizes[0])
            b.free(part)
    b.free(cols, weight, inp, grad)


def _slow3d_forward(b, g: _Geometry, x, w, out, dtype) -> None:
    """slow_conv3d_forward_out_cpu: the weight's and the input's contiguous copies, the whole
    batch's vol2col columns (a view for a 1x1x1 unit-stride kernel of one group), the output."""
    groups = x.sizes[1] // w.sizes[1]
    weight, _ = b.contiguous("weight 2d", w)
    inp, x = b.contiguous("input", x)
    cols = b.alloc("columns", 0 if g.columns_view_input() and groups == 1
                   else x.sizes[0] * g.columns_per_sample(x.sizes[1]) * x.itemsize)
    out(0, x.sizes[0] * w.sizes[0] * prod(g.out) * x.itemsize)
    b.free(cols, inp, weight)


def _slow3d_backward(b, g: _Geometry, go, x, w, mask, out, dtype) -> None:
    """slow_conv3d_backward_out_cpu: grad_input through the whole batch's `fgrad_input`
    columns (always made), grad_bias (`sum_out` over N, D, H, W), grad_weight from the
    columns of a contiguous input."""
    groups = x.sizes[1] // w.sizes[1]
    columns = x.sizes[0] * g.columns_per_sample(x.sizes[1]) * x.itemsize
    if mask[0]:
        weight, _ = b.contiguous("weight 2d", w)
        grad, _ = b.contiguous("grad_output", go)
        out(0, x.nbytes)
        b.free(b.alloc("fgrad_input", columns), grad, weight)
    if mask[2]:
        out(2, w.sizes[0] * x.itemsize)
        _half_sum(b, go, dtype, (0, 2, 3, 4), w.sizes[0])
    if mask[1]:
        out(1, w.nbytes)
        grad, _ = b.contiguous("grad_output for the weights", go)
        inp, _ = b.contiguous("input", x)   # compute_columns3d's own copy
        if g.columns_view_input() and groups == 1:
            b.free(grad, inp)               # the columns view the copy: freed with them
        else:
            cols = b.alloc("columns", columns)
            b.free(inp, cols, grad)


def _transpose2d_columns(g: _Geometry, x: _Layout, w: _Layout) -> int:
    """One sample's columns of a transposed convolution: Cout kh kw x ih iw (weight: Cin x Cout
    x kh x kw)."""
    return w.sizes[1] * prod(g.kernel) * prod(x.sizes[2:]) * x.itemsize


def _transpose2d_forward(b, g: _Geometry, x, w, out, dtype) -> None:
    """slow_conv_transpose2d (NaiveConvolutionTranspose2d.cpp, a structured kernel: the output
    first), the operands contiguous, then the whole batch's columns, zeroed, col2im'd into the
    output."""
    out(0, x.sizes[0] * w.sizes[1] * prod(g.out) * x.itemsize)
    cl = _channels_last_2d("Slow2d", x, w)
    inp, x = b.contiguous("input", x, cl)
    weight, _ = b.contiguous("weight", w, cl)
    cols = b.alloc("columns", x.sizes[0] * _transpose2d_columns(g, x, w))
    b.free(cols, weight, inp)


def _transpose2d_backward(b, g: _Geometry, go, x, w, mask, out, dtype) -> None:
    """slow_conv_transpose2d_backward_cpu: grad_input, then grad_bias (`sum_out` over N, H, W),
    then grad_weight; grad_input and grad_weight each make their operands contiguous and one
    sample's columns (none for a 1x1 kernel at unit stride, no padding or dilation)."""
    cl = _channels_last_2d("Slow2d", x, w)
    columns = 0 if g.columns_view_input() and all(d == 1 for d in g.dilation) \
        else _transpose2d_columns(g, x, w)
    if mask[0]:
        inp, _ = b.contiguous("input", x, cl)
        grad, _ = b.contiguous("grad_output", go, cl)
        weight, _ = b.contiguous("weight", w, cl)
        out(0, x.nbytes)
        b.free(b.alloc("grad columns", columns), weight, grad, inp)
    if mask[2]:
        out(2, w.sizes[1] * x.itemsize)
        _half_sum(b, go, dtype, (0, 2, 3), w.sizes[1])
    if mask[1]:
        out(1, w.nbytes)
        inp, _ = b.contiguous("input for the weights", x, cl)
        grad, _ = b.contiguous("grad_output for the weights", go, cl)
        b.free(b.alloc("columns", columns), grad, inp)


_FORWARD = {"Slow2d": _slow2d_forward, "SlowDilated2d": _dilated_forward,
            "SlowDilated3d": lambda *a: _dilated_forward(*a, backend="SlowDilated3d"),
            "Slow3d": _slow3d_forward, "SlowTranspose2d": _transpose2d_forward}
_BACKWARD = {"Slow2d": _slow2d_backward, "SlowDilated2d": _dilated_backward,
             "SlowDilated3d": lambda *a: _dilated_backward(*a, backend="SlowDilated3d"),
             "Slow3d": _slow3d_backward, "SlowTranspose2d": _transpose2d_backward}
_GROUPS_INSIDE = {"Slow3d"}   # the kernel takes groups itself: no per-group split


# ---- the op: backend, 1-D view, format, groups --------------------------------------------------

def _backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding, groups):
    """The slow kernel this convolution runs on the profiled CPU, or None (oneDNN, or another
    backend); a transposed slow kernel is noted, not modelled."""
    if x.dim() not in (3, 4, 5) or not x.is_floating_point():
        return None
    backend = cpu_backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                          groups)
    if backend == "SlowTranspose3d":
        ctx.note(_TOPIC, f"ATen's {backend} kernel (a transposed convolution not on oneDNN) "
                 "makes columns inside the op: not counted (an estimate)")
    return backend if backend in _FORWARD else None


def _geometry(x, weight, stride, padding, dilation, transposed=False,
              output_padding=(0,)) -> _Geometry:
    dims = x.dim() - 2
    kernel = tuple(weight.shape[2:])
    stride, padding, dilation, output_padding = (
        _per_dim(p, dims) for p in (stride, padding, dilation, output_padding))
    if transposed:
        out = tuple((i - 1) * s - 2 * p + d * (k - 1) + 1 + op for i, k, s, p, d, op
                    in zip(x.shape[2:], kernel, stride, padding, dilation, output_padding))
    else:
        out = tuple((i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d
                    in zip(x.shape[2:], kernel, stride, padding, dilation))
    if dims == 1:   # view1d_as_2d
        return _Geometry((1, *kernel), (1, *stride), (0, *padding), (1, *dilation), (1, *out))
    return _Geometry(kernel, tuple(stride), tuple(padding), tuple(dilation), out)


def _operands(b: _Steps, tensors: dict, one_d: bool) -> dict:
    """The operands as the backend sees them: a 1-D convolution's input made contiguous
    (`input.contiguous()`: "avoid accidentally going through NHWC") and every operand viewed
    as 2-D."""
    layouts = {k: _Layout.of(t) for k, t in tensors.items()}
    if one_d:
        _, layouts["input"] = b.contiguous("1-D input", layouts["input"])
        layouts = {k: v.view4d() for k, v in layouts.items()}
    return layouts


def _subtensor(b: _Steps, name: str, t: _Layout, dim: int, groups: int) -> tuple:
    """Convolution.cpp `subtensor`: one group's slice, made contiguous in the whole tensor's
    suggested format (a copy unless the slice already is)."""
    cl = t.suggests_channels_last()
    return b.contiguous(name, t.narrow(dim, t.sizes[dim] // groups), cl)


def _run(b: _Steps, groups: int, backend: str, run_group, results: list) -> None:
    """Run the kernel once (its results the op's outputs), or per group into buffers of their
    own, `cat` into the op's outputs at the end (Convolution.cpp's group loop). `run_group(b,
    g, out)` makes group g's copies and runs the kernel; `results`: the op's output indices."""
    if groups == 1 or backend in _GROUPS_INSIDE:
        run_group(b, 0, lambda i, nbytes: b.output(i))
        return
    held = []
    for g in range(groups):
        group = _Steps(f"group {g} ")

        def place(i, nbytes, group=group):
            name = group.alloc(f"result {i}", nbytes)
            if name in group.live_names():
                held.append(name)
        run_group(group, g, place)
        b.steps += group.steps
    for i in results:
        b.output(i)
    # the per-group results die with the vectors holding them, after the cat
    b.steps += [Free(name) for name in held]


@RULES.register(WORKSPACE, aten.convolution.default, devices={"cpu"}, source=_SOURCE, test=_TEST)
def slow_convolution_scratch(ctx, func, args, kwargs, out):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    backend = _backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                       groups)
    if backend is None:
        return None
    geometry = _geometry(x, weight, stride, padding, dilation, transposed, output_padding)
    b = _Steps()
    ops = _operands(b, {"input": x, "weight": weight}, x.dim() == 3)
    xl, wl = ops["input"], ops["weight"]
    xl, wl = _in_backend_format(b, backend, xl, wl)  # _convolution
    kernel = _FORWARD[backend]

    def run_group(gb, g, place):
        if groups == 1 or backend in _GROUPS_INSIDE:
            kernel(gb, geometry, xl, wl, place, x.dtype)
            return
        xg_name, xg = _subtensor(gb, "input", xl, 1, groups)
        wg_name, wg = _subtensor(gb, "weight", wl, 0, groups)
        kernel(gb, geometry, xg, wg, place, x.dtype)
        gb.free(xg_name, wg_name)

    _run(b, groups, backend, run_group, [0])
    return b.steps


@RULES.register(WORKSPACE, aten.convolution_backward.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def slow_convolution_backward_scratch(ctx, func, args, kwargs, out):
    grad_output, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, \
        groups, mask = args[:11]
    backend = _backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                       groups)
    if backend is None:
        return None
    geometry = _geometry(x, weight, stride, padding, dilation, transposed, output_padding)
    b = _Steps()
    ops = _operands(b, {"grad_output": grad_output, "input": x, "weight": weight}, x.dim() == 3)
    gol, xl, wl = ops["grad_output"], ops["input"], ops["weight"]
    xl, wl = _in_backend_format(b, backend, xl, wl)  # convolution_backward: not grad_output
    kernel = _BACKWARD[backend]

    def run_group(gb, g, place):
        if groups == 1 or backend in _GROUPS_INSIDE:
            kernel(gb, geometry, gol, xl, wl, mask, place, x.dtype)
            return
        gg_name, gg = _subtensor(gb, "grad_output", gol, 1, groups)
        xg_name, xg = _subtensor(gb, "input", xl, 1, groups)
        wg_name, wg = _subtensor(gb, "weight", wl, 0, groups)
        kernel(gb, geometry, gg, xg, wg, mask, place, x.dtype)
        gb.free(xg_name, gg_name, wg_name)

    _run(b, groups, backend, run_group, [i for i in range(3) if mask[i]])
    return b.steps
