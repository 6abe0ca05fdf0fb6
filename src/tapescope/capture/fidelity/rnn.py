"""nn.LSTM on CPU: `mkldnn_rnn_layer` and its backward, as aten/src/ATen/native/mkldnn/RNN.cpp and
oneDNN's reference RNN (src/cpu/rnn: rnn_utils.hpp, rnn_utils.cpp, ref_rnn.cpp) allocate.

torch's meta kernel returns an empty workspace and, in the backward, one tensor for both bias
gradients; the real forward allocates a workspace of oneDNN's size (kept for the backward) and
the real backward clones the bias gradient. Inside, the forward adds the two biases, reorders the
weights into oneDNN's `ldigo` layout with padded leading dimensions and books a scratchpad; the
backward makes contiguous gradients (zeros for the ones autograd leaves undefined), computes the
weight gradients in `ldigo` and reorders them back.

oneDNN's f32 LSTM runs the reference implementation for training on every x86 ISA (ref_rnn.cpp,
init_brgemm: "f32 datatype in brgemm-based implementation" is refused for forward_training and
backward), so the sizes below do not depend on the ISA; bf16/fp16 LSTMs take other kernels and
are not modelled (the trace keeps torch's meta outputs for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...torch_compat import untyped_storage_key
from .registry import OUTPUT, RULES, WORKSPACE, Alloc, Free, Output

__all__ = ["LstmSizes", "lstm_sizes"]

aten = torch.ops.aten
_PAGE = 4096
_SCRATCH_ALIGN = 128  # memory_tracking.hpp: default_alignment, added to every booking
_GATES = 4
_SOURCE = ("aten/src/ATen/native/mkldnn/RNN.cpp ({}) + oneDNN src/cpu/rnn/rnn_utils.hpp "
           "(init_conf, set_workspace_sizes), rnn_utils.cpp (set_offsets, get_good_ld), "
           "ref_rnn.cpp (init_scratchpad)")
_TEST = "tests/test_kernel_workspace.py::test_lstm_matches_the_allocator"


def _rnd_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _good_ld(dim: int, size: int) -> int:
    """rnn_utils::get_good_ld: 64-byte aligned, not a multiple of 256 (4K aliasing)."""
    ld = _rnd_up(dim, 64 // size)
    return ld + 64 // size if ld % 256 == 0 else ld


def _pages(sizes) -> int:
    """rnn_utils::set_offsets: each region starts on a page; the total is page-rounded."""
    offset = 0
    for size in sizes:
        offset = _rnd_up(offset, _PAGE) + size
    return _rnd_up(offset, _PAGE)


@dataclass(frozen=True)
class LstmSizes:
    workspace: int          # the forward's 4th output, kept for the backward
    weights_layer: int      # W_ih in ldigo with a padded leading dimension (the forward's
    weights_iter: int       # layout, and the backward's for the weight gradients); W_hh
    weights_layer_bwd: int  # W_ih in ldgoi with a padded leading dimension (the backward's
    weights_iter_bwd: int   # layout; 0 where that is PyTorch's plain layout); W_hh
    scratchpad: int         # the primitive's scratchpad (rnn space + pointer arrays)


def lstm_sizes(seq: int, batch: int, input_size: int, hidden: int, forward: bool) -> LstmSizes:
    """Bytes of one f32 LSTM layer and direction (L = D = 1) in training, as oneDNN computes
    them for the primitive PyTorch creates (tnc input, ldnc states)."""
    f = 4  # sizeof(float): states, gates, accumulators
    t, n, slc, dhc = seq, batch, input_size, hidden
    sic = dlc = dhc
    states_ld = _good_ld(max(sic, slc, dlc), f)
    diff_ld = _good_ld(max(slc, dlc, sic, dhc), f)
    steps = 2 * (t + 1) * n  # (n_layer + 1) * n_dir * (n_iter + 1) * mb
    workspace = _pages([
        t * n * _good_ld(dhc * _GATES, f) * f,  # ws_gates
        t * n * _good_ld(dhc, f) * f,           # ws_ht
        steps * states_ld * f,                  # ws_states_layer (= ws_states_iter)
        steps * dhc * f,                        # ws_states_iter_c
        steps * diff_ld * f,                    # ws_diff_states_layer
        steps * diff_ld * f,                    # ws_diff_states_iter
        steps * dhc * f,                        # ws_diff_states_iter_c
        0,                                      # ws_grid_comp (lbr GRU only)
    ])
    # merge_gemm_layer: forward with mb < 128, or backward; merge_gemm_iter: LSTM backward
    merged = (not forward) or n < 128
    rnn_space = _pages([
        f * (t if merged else 1) * n * _good_ld(max(dlc, _GATES * dhc), f),  # scratch_gates
        f * n * _good_ld(dhc, f),                                           # scratch_ht
        f * n * _good_ld(dlc, f),                                           # scratch_diff_ht
        0,                                                                  # scratch_cell
    ])
    pointers = 3 * (8 + _SCRATCH_ALIGN) + (4 * 8 + _SCRATCH_ALIGN)  # wei_layer/iter/proj, bias
    scratchpad = rnn_space + _PAGE + pointers  # the rnn space is booked page-aligned
    gates_ld = _good_ld(_GATES * dhc, f)  # set_good_strides(ldigo): strides[2] = good ld

    def ldgoi(i: int) -> int:  # set_good_strides(ldgoi): the `o` stride is the good ld of i
        return 0 if _good_ld(i, f) == i else _GATES * dhc * _good_ld(i, f) * f

    return LstmSizes(workspace, slc * gates_ld * f, sic * gates_ld * f, ldgoi(slc), ldgoi(sic),
                     scratchpad)


def _modelled(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32


def _lstm(args) -> tuple:
    """(seq, batch, input size, hidden) of a mkldnn_rnn_layer call (RNNParams: input is tnc)."""
    x = args[0]
    return x.shape[0], x.shape[1], x.shape[2], args[1].shape[0] // _GATES


@RULES.register(OUTPUT, aten.mkldnn_rnn_layer.default, devices={"cpu"},
                source=_SOURCE.format("mkldnn_rnn_layer: workspace = "
                                      "at::empty(pd.workspace_desc().get_size())"), test=_TEST)
def lstm_workspace_output(ctx, func, args, out):
    """The workspace output has oneDNN's size (the meta kernel's is empty)."""
    if not (_modelled(args[0]) and torch.is_grad_enabled() and args[9] == 2):  # 2: LSTM
        return out
    sizes = lstm_sizes(*_lstm(args), forward=True)
    return (*out[:3], out[3].new_empty((sizes.workspace,), dtype=torch.uint8))


@RULES.register(OUTPUT, aten.mkldnn_rnn_layer_backward.default, devices={"cpu"},
                source=_SOURCE.format("mkldnn_rnn_layer_backward: diff_b2_ = "
                                      "at::clone(diff_b_)"), test=_TEST)
def lstm_backward_clones_the_bias_gradient(ctx, func, args, out):
    """The real kernel returns the bias gradient and a clone of it; the meta kernel returns one
    tensor twice, which would make the two bias parameters share their gradient's storage."""
    if out[3] is None or out[4] is None or out[3] is not out[4]:
        return out
    return (*out[:4], torch.empty_like(out[3]), *out[5:])


@RULES.register(WORKSPACE, aten.mkldnn_rnn_layer.default, devices={"cpu"},
                source=_SOURCE.format("mkldnn_rnn_layer; ideep lstm_forward_training"),
                test=_TEST)
def lstm_forward_scratch(ctx, func, args, kwargs, out):
    x, w_ih = args[0], args[1]
    if not _modelled(x) or args[9] != 2:
        return None
    seq, batch, input_size, hidden = _lstm(args)
    steps = [Output(0), Output(1), Output(2),
             Alloc("bias", _GATES * hidden * w_ih.dtype.itemsize)]  # b_ih + b_hh, or zeros
    if not torch.is_grad_enabled():
        return steps  # lstm_forward_inference: another primitive, not modelled
    sizes = lstm_sizes(seq, batch, input_size, hidden, forward=True)
    return steps + [Output(3), Alloc("weights_layer", sizes.weights_layer),
                    Alloc("weights_iter", sizes.weights_iter),
                    Alloc("scratchpad", sizes.scratchpad)]


@RULES.register(WORKSPACE, aten.mkldnn_rnn_layer_backward.default, devices={"cpu"},
                source=_SOURCE.format("mkldnn_rnn_layer_backward; ideep lstm_backward"),
                test=_TEST)
def lstm_backward_scratch(ctx, func, args, kwargs, out):
    x, hx, cx, output = args[0], args[5], args[6], args[7]
    grad_output, grad_hy, grad_cy = args[10], args[11], args[12]
    if not _modelled(x) or args[14] != 2 or all(g is None for g in (grad_output, grad_hy, grad_cy)):
        return None
    seq, batch, input_size, hidden = _lstm(args)
    sizes = lstm_sizes(seq, batch, input_size, hidden, forward=False)
    steps = []
    # grad_output.contiguous() or zeros_like(output); likewise grad_hy and grad_cy
    for name, grad, like in (("grad_output", grad_output, output), ("grad_hy", grad_hy, hx),
                             ("grad_cy", grad_cy, cx)):
        if grad is None or not grad.is_contiguous():
            t = like if grad is None else grad
            steps.append(Alloc(name, t.numel() * t.dtype.itemsize))
    steps.append(Alloc("bias", _GATES * hidden * args[1].dtype.itemsize))
    if untyped_storage_key(hx.untyped_storage()) == untyped_storage_key(cx.untyped_storage()):
        steps.append(Alloc("cx", cx.numel() * cx.dtype.itemsize))  # at::clone(cx_tmp)
    bias_grad = _GATES * hidden * 4
    steps += [Output(0), Output(5), Output(6), Output(1), Output(2), Output(3),
              # the weights reordered where the backward's padded ldgoi is not PyTorch's layout;
              # the weight gradients in ldigo and the bias gradient in oneDNN's layouts, reordered
              # back into the outputs
              Alloc("weights_layer", sizes.weights_layer_bwd),
              Alloc("weights_iter", sizes.weights_iter_bwd),
              Alloc("diff_weights_layer", sizes.weights_layer),
              Alloc("diff_weights_iter", sizes.weights_iter),
              Alloc("diff_bias", bias_grad), Alloc("scratchpad", sizes.scratchpad),
              Free("scratchpad"), Free("diff_bias"), Free("diff_weights_iter"),
              Free("diff_weights_layer"), Free("weights_iter"), Free("weights_layer"), Output(4)]
    return steps
