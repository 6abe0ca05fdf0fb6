"""CPU convolutions: the memory oneDNN's kernels need beside PyTorch's tensors, in the order
aten/src/ATen/native/mkldnn/Conv.cpp and ideep allocate it.

`aten::convolution` on CPU picks a backend (Convolution.cpp, `_select_conv_backend`); for fp32
tensors that is oneDNN ("Mkldnn") unless the convolution is a single-threaded 1x1, tiny, or
transposed. On that path:
- forward, NCHW: ideep reorders the source and the weights into the kernel's layouts, computes
  into its own (blocked) destination, frees the reordered operands, and only then PyTorch
  allocates the dense output (`mkldnn_to_dense`) and copies into it;
- forward, channels-last: the output is allocated first and written in place; only the weights
  are reordered;
- backward: `grad_output.contiguous(format)`, then backward-data as the forward (its own
  reorders, then grad_input), then backward-weights (grad_output and the source reordered
  again, the weight and bias gradients in the kernel's layout, then the dense grad_bias and
  grad_weight; channels-last converts grad_weight once more with `.to(ChannelsLast)`).
Which kernel runs and how large its buffers are is devices/onednn.py's model; where that is a
heuristic the capture notes it (FidelityContext.notes), and the report says so.
"""

from __future__ import annotations

from math import prod

import torch

from ...devices import onednn, onednn_bf16
from ...torch_compat import select_conv_backend
from .registry import RULES, WORKSPACE, Alloc, Free, Output

__all__ = ["conv_problem", "forward_steps", "backward_steps", "cpu_backend"]

aten = torch.ops.aten
_SOURCE = ("aten/src/ATen/native/mkldnn/Conv.cpp (mkldnn_convolution, "
           "mkldnn_convolution_backward) + ideep convolution_forward/backward compute + oneDNN "
           "src/cpu/cpu_convolution_list.cpp and the kernels' init_conf (devices/onednn.py)")
_TEST = "tests/test_kernel_workspace.py::test_convolution_matches_the_allocator"


def _conv_output_size(size, k, s, p, d):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv_problem(x_shape, w_shape, bias_defined, stride, padding, dilation, groups,
                 channels_last, itemsize: int = 4) -> onednn.Conv:
    """The convolution of an input of `x_shape` (N, C, *spatial) with weights of `w_shape`."""
    spatial = tuple(x_shape[2:])
    kernel = tuple(w_shape[2:])
    out = tuple(_conv_output_size(i, k, s, p, d)
                for i, k, s, p, d in zip(spatial, kernel, stride, padding, dilation))
    return onednn.Conv(x_shape[0], x_shape[1], w_shape[0], groups, spatial, out, kernel,
                       tuple(stride), tuple(padding), tuple(dilation), channels_last,
                       bias_defined, itemsize)


# the kernel model of each dtype oneDNN convolves in (forward, backward_data, backward_weights):
# oneDNN's fp32 and bf16 kernels are different code with their own layouts and scratchpads
_KERNELS = {torch.float32: onednn, torch.bfloat16: onednn_bf16}


def _as_seen(t) -> tuple[tuple, tuple]:
    """The sizes and strides the oneDNN path sees. A 1-D convolution's tensors are made
    contiguous first (Convolution.cpp _convolution: `input.contiguous(backend_memory_format)`,
    where a 3-D tensor's suggested format is always contiguous), then viewed as 2-D (`view4d`:
    `unsqueeze(2)`, whose stride is sizes[2] * strides[2])."""
    sizes, strides = tuple(t.shape), tuple(t.stride())
    if len(sizes) == 3:
        if not _dense_in_order(sizes, strides, (2, 1, 0)):
            strides = (sizes[1] * sizes[2], sizes[2], 1)
        sizes = sizes[:2] + (1,) + sizes[2:]
        strides = strides[:2] + (strides[2] * sizes[3],) + strides[2:]
    return sizes, strides


def _dense_in_order(sizes: tuple, strides: tuple, order) -> bool:
    """c10's compute_(channels_last_)contiguous: strides equal the running product of the sizes
    in `order` (innermost first); size-1 dimensions impose nothing."""
    expected = 1
    for d in order:
        if sizes[d] == 1:
            continue
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def _uses_channels_last(x, weight) -> bool:
    """mkldnn_conv_use_channels_last (ConvUtils.h): either operand's suggest_memory_format is
    channels-last (decided from the strides, so an ambiguous tensor with size-1 dimensions -
    a 1-D convolution over one position of a transposed activation - counts when its channel
    stride is the smallest)."""
    return any(_strides_like_channels_last(*_as_seen(t)) for t in (x, weight))


def _strides_like_channels_last(sizes: tuple, strides: tuple) -> bool:
    """c10/core/MemoryFormat.h is_channels_last_strides_{2d_s4,3d_s5}: strides increasing in
    the order C, W, H, (D,) N, the ambiguous N111 case counted as contiguous."""
    if len(sizes) == 4:
        order = (1, 3, 2, 0)
    elif len(sizes) == 5:
        order = (1, 4, 3, 2, 0)
    else:
        return False
    if strides[1] == 0:
        return False
    low = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _is_contiguous_as(t, channels_last: bool) -> bool:
    """`t.is_contiguous(format)` for the tensor as the caller holds it (a 1-D convolution's
    3-D tensor, or the 4-D / 5-D one)."""
    sizes, strides = tuple(t.shape), tuple(t.stride())
    order = tuple(range(len(sizes) - 1, -1, -1))
    if channels_last and len(sizes) in (4, 5):
        order = (1,) + tuple(range(len(sizes) - 1, 1, -1)) + (0,)
    return _dense_in_order(sizes, strides, order)


def _note_ambiguous_1d(ctx, x, channels_last: bool) -> None:
    """A 1-D convolution whose 2-D view has channels-last strides (one position): the
    backward's copies of its operands are not all traced to their source yet (measured up to
    1 KB more inside the op)."""
    if channels_last and x.dim() == 3:
        ctx.note("oneDNN convolution scratch", "a 1-D convolution over one position runs "
                 "channels-last; its backward's operand copies are an estimate")


def _copy_if_needed(name, t, channels_last: bool) -> list:
    """Conv.cpp's `t.contiguous(memory_format)`: a copy where the tensor is not already so."""
    if t is None or _is_contiguous_as(t, channels_last):
        return []
    return [Alloc(name, t.numel() * t.dtype.itemsize)]


def forward_steps(c: onednn.Conv, p: onednn.Primitive) -> list:
    if c.channels_last:
        return [Output(0), Alloc("scratchpad", p.scratchpad), Alloc("weights", p.weights),
                Free("weights"), Free("scratchpad")]
    return [Alloc("scratchpad", p.scratchpad), Alloc("src", p.src), Alloc("weights", p.weights),
            Alloc("dst", p.dst), Free("weights"), Free("src"), Free("scratchpad"), Output(0),
            Free("dst")]


def backward_steps(c: onednn.Conv, d: onednn.Primitive | None,
                   w: onednn.Primitive | None, weight_numel: int) -> list:
    """`weight_numel`: the weight's elements (its dense channels-last copy has c.itemsize
    bytes each)."""
    steps = []
    if d is not None:
        if d.impl.startswith("brgconv_strided") and not c.channels_last:
            # NHWC copies: diff_dst and the weights reordered, the kernel's NHWC diff_src, its
            # scratchpad last; the diff_src reaches grad_input through one more buffer
            steps += [Alloc("d.diff_dst", d.src), Alloc("d.weights", d.weights),
                      Alloc("d.diff_src", d.dst), Alloc("d.scratchpad", d.scratchpad),
                      Free("d.scratchpad"), Free("d.weights"), Free("d.diff_dst"), Output(0),
                      Alloc("d.copy", d.dst), Free("d.copy"), Free("d.diff_src")]
        elif c.channels_last:
            steps += [Output(0), Alloc("d.scratchpad", d.scratchpad),
                      Alloc("d.weights", d.weights), Free("d.weights"), Free("d.scratchpad")]
        else:
            steps += [Alloc("d.scratchpad", d.scratchpad), Alloc("d.diff_dst", d.src),
                      Alloc("d.weights", d.weights), Alloc("d.diff_src", d.dst),
                      Free("d.weights"), Free("d.diff_dst"), Free("d.scratchpad"), Output(0),
                      Free("d.diff_src")]
    if w is not None:
        steps += [Alloc("w.diff_dst", w.diff_dst), Alloc("w.src", w.src),
                  Alloc("w.diff_weights", w.dst), Alloc("w.scratchpad", w.scratchpad),
                  Alloc("w.diff_bias", w.bias), Free("w.src"), Free("w.diff_dst"),
                  Free("w.scratchpad"), Output(2)]
        if c.channels_last:  # mkldnn_to_dense(grad_w).to(ChannelsLast)
            steps += [Alloc("w.dense", weight_numel * c.itemsize), Output(1), Free("w.dense")]
        else:
            steps += [Output(1)]
        steps += [Free("w.diff_weights"), Free("w.diff_bias")]
    return steps


# ConvBackend::MkldnnTranspose has no Python name: torch._C._ConvBackend prints it as "???"
# (the only unnamed value), which on a CPU tensor is oneDNN's deconvolution
_MKLDNN_TRANSPOSE = "???"


def _on_onednn_transposed(x, weight, stride, padding, dilation, transposed, output_padding,
                          groups) -> bool:
    if not transposed or x.dtype != torch.float32 or x.dim() not in (3, 4, 5):
        return False
    return select_conv_backend(x, weight, stride, padding, dilation, transposed,
                               output_padding, groups) == _MKLDNN_TRANSPOSE


def cpu_backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                groups) -> str:
    """PyTorch's backend (a ConvBackend name) for this convolution on the profiled CPU: the
    host's choice (Convolution.cpp `_select_conv_backend`), except where the profiled CPU would
    choose otherwise:
    - a bf16 convolution oneDNN runs here for a target below AVX-512, where oneDNN has no bf16
      kernel (`mkldnn_bf16_device_check` fails) and ATen's slow kernels run (dilated or not, 2-D
      or 3-D);
    - `use_mkldnn` decides one case by the thread count: a stride-1, undilated 1x1 convolution
      of batch < 16 runs on oneDNN only when several threads do (re-decided for `threads=`)."""
    backend = select_conv_backend(x, weight, stride, padding, dilation, transposed,
                                  output_padding, groups)
    onednn_dtype = x.dtype == torch.float32 or (x.dtype == torch.bfloat16
                                                and ctx.cpu.isa == "avx512")
    if backend == "Mkldnn" and x.dtype == torch.bfloat16 and ctx.cpu.isa != "avx512":
        dilated = any(d != 1 for d in _per_dim(dilation, x.dim() - 2))
        backend = ("SlowDilated" if dilated else "Slow") + ("3d" if x.dim() == 5 else "2d")
    threads = ctx.cpu.threads
    if (onednn_dtype and not transposed and threads != torch.get_num_threads()
            and backend in ("Mkldnn", "Slow2d")):
        n, c = x.shape[0], x.shape[1]
        kernel, spatial = weight.shape[2:], x.shape[2:]
        if (all(k == 1 for k in kernel) and all(s == 1 for s in _per_dim(stride, len(kernel)))
                and all(d == 1 for d in _per_dim(dilation, len(kernel))) and n < 16):
            backend = "Mkldnn" if threads > 1 and (
                groups > 1 or n > 1 or n * c * prod(spatial) > 20480) else "Slow2d"
    return backend


def _on_onednn(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
               groups) -> bool:
    """Whether oneDNN's convolution (modelled here) runs; else ATen's slow kernels
    (slow_convolution.py) or a backend no rule models. An fp16 convolution on oneDNN (a CPU
    with AVX512-FP16 or AMX-FP16) is not modelled: noted."""
    if transposed or x.dim() not in (3, 4, 5) or not x.is_floating_point():
        return False
    backend = cpu_backend(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                          groups)
    if backend == "Mkldnn" and x.dtype not in _KERNELS:
        ctx.note("oneDNN convolution scratch", f"oneDNN's {str(x.dtype)[6:]} convolution "
                 "kernels' reorders and scratchpad are not counted (an estimate)")
    return backend == "Mkldnn" and x.dtype in _KERNELS


def _per_dim(param, dims: int) -> tuple:
    """ConvUtils.h `expand_param_if_needed`: a one-element stride, padding or dilation holds
    for every spatial dimension (`padding="valid"` reaches `aten::convolution` as `[0]`)."""
    param = tuple(param)
    return param * dims if len(param) == 1 else param


def _as_2d(x, weight, stride, padding, dilation):
    """Convolution.cpp `view1d_as_2d`: a 1-D convolution runs as a 2-D one of height 1 (shapes
    only: a rule must not run ops on the fake tensors it is shown)."""
    xs, ws = tuple(x.shape), tuple(weight.shape)
    stride, padding, dilation = (_per_dim(p, x.dim() - 2) for p in (stride, padding, dilation))
    if x.dim() == 3:
        return ((*xs[:2], 1, xs[2]), (*ws[:2], 1, ws[2]), (1, *stride), (0, *padding),
                (1, *dilation))
    return xs, ws, tuple(stride), tuple(padding), tuple(dilation)


def _note(ctx, prim: onednn.Primitive) -> None:
    if not prim.exact:
        ctx.note("oneDNN convolution scratch",
                 f"{prim.impl} on {ctx.cpu.describe()}: its reorders follow the kernel's layouts, "
                 "its scratchpad is an estimate (devices/onednn.py)")


@RULES.register(WORKSPACE, aten.convolution.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def convolution_scratch(ctx, func, args, kwargs, out):
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    if not _on_onednn(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                      groups):
        return None  # ATen's slow kernels: slow_convolution.py
    cl = _uses_channels_last(x, weight)
    xs, ws, stride, padding, dilation = _as_2d(x, weight, stride, padding, dilation)
    c = conv_problem(xs, ws, bias is not None, stride, padding, dilation, groups, cl,
                     x.dtype.itemsize)
    prim = _KERNELS[x.dtype].forward(c, ctx.cpu)
    _note(ctx, prim)
    return (_copy_if_needed("input", x, cl) + _copy_if_needed("weight", weight, cl)
            + forward_steps(c, prim))


@RULES.register(WORKSPACE, aten.convolution_backward.default, devices={"cpu"}, source=_SOURCE,
                test=_TEST)
def convolution_backward_scratch(ctx, func, args, kwargs, out):
    grad_output, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, \
        groups, mask = args[:11]
    if _on_onednn_transposed(x, weight, stride, padding, dilation, transposed, output_padding,
                             groups):
        return _transposed_backward(ctx, grad_output, x, weight, stride, padding, dilation,
                                    groups, mask)
    if not _on_onednn(ctx, x, weight, stride, padding, dilation, transposed, output_padding,
                      groups):
        return None  # ATen's slow kernels: slow_convolution.py
    cl = _uses_channels_last(x, weight)
    _note_ambiguous_1d(ctx, x, cl)
    xs, ws, stride, padding, dilation = _as_2d(x, weight, stride, padding, dilation)
    c = conv_problem(xs, ws, bool(mask[2]), stride, padding, dilation, groups, cl,
                     x.dtype.itemsize)
    kernels = _KERNELS[x.dtype]
    d = kernels.backward_data(c, ctx.cpu) if mask[0] else None
    w = kernels.backward_weights(c, ctx.cpu) if (mask[1] or mask[2]) else None
    for prim in (d, w):
        if prim is not None:
            _note(ctx, prim)
    copies = (_copy_if_needed("grad_output", grad_output, cl)
              + _copy_if_needed("input", x, cl) + _copy_if_needed("weight", weight, cl))
    return copies + backward_steps(c, d, w, weight.numel())


@RULES.register(WORKSPACE, aten.convolution.default, devices={"cpu"}, source=_SOURCE,
                test="tests/test_kernel_workspace.py::test_transposed_convolution")
def transposed_convolution_scratch(ctx, func, args, kwargs, out):
    """oneDNN's deconvolution forward (onednn.deconvolution_forward): at unit strides the
    swapped convolution's backward-data kernel with the f32 output copy a bias needs, in its
    order; otherwise the brgemm strided kernel on NHWC copies (devices/onednn_brgemm_bwd.py),
    then the dense output and an output-sized buffer (the NHWC result copied through it).
    Channels-last deconvolutions are not modelled (noted)."""
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    if not _on_onednn_transposed(x, weight, stride, padding, dilation, transposed,
                                 output_padding, groups):
        return None
    cl = _uses_channels_last(x, weight)
    if cl:
        ctx.note("oneDNN convolution scratch", "a channels-last transposed convolution's "
                 "forward (oneDNN deconvolution) scratch is not counted (an estimate)")
        return None
    os_, ws, stride, padding, dilation = _as_2d(out, weight, stride, padding, dilation)
    c = conv_problem(os_, ws, False, stride, padding, dilation, groups, False)
    prim = onednn.deconvolution_forward(c, ctx.cpu, bias is not None)
    if not prim.exact:
        ctx.note("oneDNN convolution scratch", f"{prim.impl} on {ctx.cpu.describe()}: a "
                 "transposed convolution's forward scratchpad is an estimate (devices/onednn.py)")
    if "brgconv_strided" in prim.impl or not prim.exact:
        # NHWC: the kernel's output reaches PyTorch's through one more buffer of its size
        out_bytes = out.numel() * out.dtype.itemsize
        return (_copy_if_needed("input", x, False) + _copy_if_needed("weight", weight, False)
                + [Alloc("scratchpad", prim.scratchpad), Alloc("src", prim.src),
                   Alloc("weights", prim.weights), Alloc("dst", prim.dst), Free("weights"),
                   Free("src"), Free("scratchpad"), Output(0), Alloc("output copy", out_bytes),
                   Free("output copy"), Free("dst")])
    return (_copy_if_needed("input", x, False) + _copy_if_needed("weight", weight, False)
            + forward_steps(c, prim))


def _transposed_backward(ctx, grad_output, x, weight, stride, padding, dilation, groups, mask):
    """mkldnn_convolution_transpose_backward (mkldnn/Conv.cpp) on oneDNN's ref_deconvolution:
    a deconvolution is a convolution with the roles swapped - the convolution from the output
    (grad_output: Cout channels) to the input (Cin channels) with the weights as they are
    (Cin x Cout/groups x k). Its grad_input is that convolution's forward; its weight gradient
    that convolution's weight gradient (src = grad_output, diff_dst = input), without a bias:
    ref_deconvolution sums the deconvolution's bias gradient itself (one Cout-float buffer, as
    ideep's bias gradient)."""
    from dataclasses import replace

    cl = _uses_channels_last(x, weight)
    gs, ws, stride, padding, dilation = _as_2d(grad_output, weight, stride, padding, dilation)
    c = conv_problem(gs, ws, False, stride, padding, dilation, groups, cl)
    # each convolution runs nested in the deconvolution's scratchpad (ref_deconvolution.hpp)
    d = onednn.nested(onednn.forward(c, ctx.cpu)) if mask[0] else None
    w = onednn.nested(onednn.backward_weights(c, ctx.cpu)) if (mask[1] or mask[2]) else None
    if w is not None:
        w = replace(w, bias=grad_output.shape[1] * 4 if mask[2] else 0)
    for prim in (d, w):
        if prim is not None:
            _note(ctx, prim)
    steps = (_copy_if_needed("grad_output", grad_output, cl)
             + _copy_if_needed("input", x, cl) + _copy_if_needed("weight", weight, cl))
    if d is not None:  # the swapped convolution's forward makes grad_input (output 0)
        steps += forward_steps(c, d)
    return steps + backward_steps(c, None, w, weight.numel())
