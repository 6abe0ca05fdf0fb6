"""Loss kernels on CPU (aten/src/ATen/native/Loss.cpp): the buffers they keep and the scratch they
make, where the fake (meta) kernel gives a 0-d result and allocates nothing else.

Two kinds of difference:
- the result of a reduced loss keeps an input-sized storage: `mse_loss` and `smooth_l1_loss`
  build their output as a broadcast binary op (TORCH_META_FUNC: `build_borrowing_binary_op`)
  and only then `resize_({})` it; `binary_cross_entropy` writes into `empty_like(input)` and
  `soft_margin_loss` into `neg_out(output, input)`, then `resize_` to the reduced shape. Shrinking
  keeps the storage, so the scalar loss holds input-sized memory for as long as it lives (OUTPUT);
- the unreduced loss, and the temporaries of composite formulas, are scratch (WORKSPACE).
"""

from __future__ import annotations

import torch

from .reductions import reduction_scratch
from .registry import OUTPUT, RULES, WORKSPACE, Alloc, Free, Output

__all__ = []

aten = torch.ops.aten
_NONE, _MEAN = 0, 1
_TEST = "tests/test_kernel_workspace.py::test_loss_kernels_match_the_allocator"


def _arg(func, args, kwargs, name):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value)
    raise KeyError(name)


def _numel(*tensors):
    n = 1
    for s in torch.broadcast_shapes(*(t.shape for t in tensors)):
        n *= s
    return n


def _reduced(ctx, func, args, kwargs) -> bool:
    return _arg(func, args, kwargs, "reduction") != _NONE


def _mean(func, args, kwargs) -> bool:
    return _arg(func, args, kwargs, "reduction") == _MEAN


def _keeps_input_sized_storage(*operands):
    """OUTPUT: a reduced loss whose 0-d result keeps the storage of the unreduced one."""
    def handler(ctx, func, args, out):
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or \
                _arg(func, args, {}, "reduction") == _NONE:
            return out
        n = _numel(*(args[i] for i in operands))
        # new_empty on the fake output (a factory function would make a real tensor here, inside
        # the mode's dispatch); the output is fresh: nothing else refers to it yet
        return out.new_empty((n,)).resize_(())
    return handler


for _op, _operands, _where in (
        (aten.mse_loss.default, (0, 1), "TORCH_META_FUNC(mse_loss): build_borrowing_binary_op, "
                                        "then resize_({})"),
        (aten.smooth_l1_loss.default, (0, 1), "TORCH_META_FUNC(smooth_l1_loss)"),
        (aten.binary_cross_entropy.default, (0,), "binary_cross_entropy_cpu: "
                                                  "loss = empty_like(input), resize_as_"),
        (aten.soft_margin_loss.default, (0,), "soft_margin_loss_out: neg_out(output, input), "
                                              "resize_({})")):
    RULES.register(OUTPUT, _op, devices={"cpu"}, name=f"{_op.__name__}_keeps_its_buffer",
                   source=f"aten/src/ATen/native/Loss.cpp ({_where})", test=_TEST,
                   )(_keeps_input_sized_storage(*_operands))


@RULES.register(WORKSPACE, aten.mse_loss.default, aten.smooth_l1_loss.default, devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (mse_loss_out / smooth_l1_loss_out: the "
                       "unreduced `loss` of a TensorIterator, then mean_out / sum_out into the "
                       "result)", test=_TEST)
def pointwise_loss_reduces_a_buffer(ctx, func, args, kwargs, out):
    if not _reduced(ctx, func, args, kwargs):
        return None
    if func is aten.smooth_l1_loss.default and _arg(func, args, kwargs, "beta") == 0:
        return None  # l1_loss_out: a composite of recorded ops
    n, dtype = _numel(args[0], args[1]), out.dtype
    return [Alloc("loss", n * dtype.itemsize),
            *reduction_scratch(n, dtype, 1, dtype, mean=_mean(func, args, kwargs))]


@RULES.register(WORKSPACE, aten.huber_loss.default, devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (huber_loss: TensorIterator's `loss`, then "
                       "apply_loss_reduction)", test=_TEST)
def huber_loss_reduces_a_buffer(ctx, func, args, kwargs, out):
    if not _reduced(ctx, func, args, kwargs):
        return None  # the unreduced loss is the output
    n, dtype = _numel(args[0], args[1]), out.dtype
    return [Alloc("loss", n * dtype.itemsize), Output(0),
            *reduction_scratch(n, dtype, 1, dtype, mean=_mean(func, args, kwargs))]


@RULES.register(WORKSPACE, aten.binary_cross_entropy.default, aten.soft_margin_loss.default,
                devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (binary_cross_entropy_out_cpu / "
                       "soft_margin_loss_out: apply_loss_reduction into a temporary, copied back)",
                test=_TEST)
def loss_reduced_into_a_temporary(ctx, func, args, kwargs, out):
    if not _reduced(ctx, func, args, kwargs):
        return None
    n, dtype = args[0].numel(), out.dtype
    return [Alloc("reduced", dtype.itemsize),
            *reduction_scratch(n, dtype, 1, dtype, mean=_mean(func, args, kwargs))]


@RULES.register(WORKSPACE, aten.binary_cross_entropy_with_logits.default, devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (binary_cross_entropy_with_logits: "
                       "log_sigmoid(input) with its buffer, (pos_weight - 1).mul(target), "
                       "(1 - target).mul_(input).sub_(...), apply_loss_reduction)", test=_TEST)
def bce_with_logits_temporaries(ctx, func, args, kwargs, out):
    input, target = args[0], args[1]
    pos_weight = _arg(func, args, kwargs, "pos_weight")
    size = input.dtype.itemsize
    # log_sigmoid_forward_cpu: output and buffer, both empty_like(input); the buffer dies with it
    steps = [Alloc("log_sigmoid", input.numel() * size), Alloc("buffer", input.numel() * size),
             Free("buffer")]
    if pos_weight is not None:  # log_weight = (pos_weight - 1).mul(target).add_(1)
        steps += [Alloc("pos_weight - 1", pos_weight.numel() * size),
                  Alloc("log_weight", _numel(pos_weight, target) * size),
                  Free("pos_weight - 1"), Free("log_weight")]
    if not _reduced(ctx, func, args, kwargs):
        return steps + [Output(0)]  # the loss, (1 - target).mul_(input).sub_(...), is the output
    n, dtype = target.numel(), out.dtype
    return steps + [Alloc("loss", n * size), Output(0),
                    *reduction_scratch(n, dtype, 1, dtype, mean=_mean(func, args, kwargs))]


@RULES.register(WORKSPACE, aten.soft_margin_loss_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (soft_margin_loss_backward_out: "
                       "z = exp(-target * input) before grad_input = mul_out(target, z))",
                test=_TEST)
def soft_margin_backward_temporaries(ctx, func, args, kwargs, out):
    input, target = args[1], args[2]
    size = out.dtype.itemsize
    n = _numel(input, target)
    return [Alloc("-target", target.numel() * size), Alloc("-target * input", n * size),
            Alloc("z", n * size), Free("-target * input"), Free("-target"), Output(0)]


@RULES.register(WORKSPACE, aten.binary_cross_entropy_backward.default, devices={"cpu"},
                source="aten/src/ATen/native/Loss.cpp (binary_cross_entropy_backward_out_cpu: "
                       "grad_input.div_(input.numel()) for a mean)", test=_TEST)
def bce_backward_divides_by_a_wrapped_count(ctx, func, args, kwargs, out):
    if not _mean(func, args, kwargs):
        return None
    return [Alloc("divisor", 8), Alloc("divisor cast", out.dtype.itemsize)]
