"""FLOPs of each recorded op, from a registry of small formulas keyed by op.

Conventions (so the numbers can be checked by hand):
- A multiply-add is 2 FLOPs. Matmuls and convolutions use torch.utils.flop_counter's own formulas,
  so they equal FlopCounterMode's counts exactly.
- Attention counts its matmuls (QK^T and PV forward; five matmuls backward, as FlopCounterMode),
  over the (query, key) pairs the mask lets through: a causal mask keeps
  sum_i min(i+1, S) of the L*S pairs (top-left aligned, as SDPA's is_causal), about half.
  FlopCounterMode counts every pair and has no formula for the CPU flash kernel.
- Pointwise ops: one FLOP per arithmetic operation of the op's definition per output element;
  a transcendental (exp, log, tanh, erf, sqrt, rsqrt) counts one, a comparison or selection one.
  `POINTWISE_COST` lists the ops that do more than one operation (addcmul: 2, gelu: 5 ...).
- Reductions: one FLOP per input element (one add or compare each), plus what the op does after.
- Norms, softmax, losses, embedding backward, pooling and the fused optimizers: formulas below,
  each derived from the op's definition and stated next to it.
- Data movement (views, copies, dtype casts, cat, gather, index, factories, random fills) is 0.
An op with no formula gets `None` and is listed in `Profile.uncounted_ops`, never counted as 0.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils import flop_counter as _fc

from ..capture.records import OpRecord, TensorRef

__all__ = ["flop_formula", "op_flops", "POINTWISE_COST", "ZERO_FLOP_OPS", "attention_pairs"]

aten = torch.ops.aten

# packet -> formula(op, args) -> int, args being the op's arguments bound by schema name.
_FORMULAS: dict = {}


def flop_formula(*packets) -> Callable:
    """Register a formula for one or more op packets (`aten.mm`, not `aten.mm.default`)."""

    def register(fn):
        for p in packets:
            if p in _FORMULAS:
                raise RuntimeError(f"duplicate FLOP formula for {p}")
            _FORMULAS[p] = fn
        return fn

    return register


def _shape(x):
    return tuple(x.shape) if type(x) is TensorRef else x


def _shapes(x):
    if type(x) is TensorRef:
        return tuple(x.shape)
    if type(x) in (tuple, list):
        return type(x)(_shape(i) for i in x)
    return x


# ---- matmul and convolution: torch's own formulas -------------------------------------------

_TORCH_SHAPE_FORMULAS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm,
                         aten.convolution, aten._convolution, aten.cudnn_convolution,
                         aten.convolution_overrideable, aten._slow_conv2d_forward,
                         aten.convolution_backward)


def _torch_formula(packet):
    f = _fc.flop_registry[packet]

    def formula(op, a):
        out = [_shape(o) for o in op.outputs]
        n = f(*(_shapes(x) for x in op.args), **{k: _shapes(v) for k, v in op.kwargs.items()},
              out_val=out[0] if len(out) == 1 else out)
        return int(n) if isinstance(n, (int, float)) else n  # sympy in symbolic profiles

    return formula


for _p in _TORCH_SHAPE_FORMULAS:
    if _p in _fc.flop_registry:
        _FORMULAS[_p] = _torch_formula(_p)


# ---- attention --------------------------------------------------------------------------------

def _half(x):
    return x // 2 if isinstance(x, int) else x / 2  # sympy: exact rational, L*(L+1) is even


def attention_pairs(L, S, causal: str | None) -> int:
    """How many (query, key) pairs a mask keeps: all L*S, or a causal triangle.

    "top_left": query i sees keys 0..i (SDPA's is_causal); "bottom_right": query i sees keys up to
    i + S - L (efficient attention's mask type 2, flash attention's causal with L != S).
    """
    if causal is None:
        return L * S
    if causal == "bottom_right":
        if L == S:
            return _half(L * (L + 1))
        # rows i = 0..L-1 see min(max(i + S - L + 1, 0), S) keys
        return sum(min(max(i + S - L + 1, 0), S) for i in range(L))
    if L == S or L <= S:
        return _half(L * (L + 1))
    return _half(S * (S + 1)) + (L - S) * S


def _attention(q, k, v, causal, bhsd: bool, backward: bool) -> int:
    """Matmul FLOPs of attention. q,k,v shapes (B, H, S, D) if bhsd else (B, S, H, D)."""
    if bhsd:
        b, h, L, dq = q
        S, dv = k[2], v[3]
    else:
        b, L, h, dq = q
        S, dv = k[1], v[3]
    pairs = attention_pairs(L, S, causal)
    # forward: scores = Q K^T (pairs*dq MACs), out = P V (pairs*dv MACs)
    # backward: recompute scores, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q
    macs = pairs * (3 * dq + 2 * dv) if backward else pairs * (dq + dv)
    return 2 * b * h * macs


def _causal(is_causal) -> str | None:
    return "top_left" if is_causal else None


@flop_formula(aten._scaled_dot_product_flash_attention_for_cpu,
              aten._scaled_dot_product_flash_attention,
              aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention)
def _sdpa(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape,
                      _causal(a.get("is_causal")), True, False)


@flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward,
              aten._scaled_dot_product_flash_attention_backward,
              aten._scaled_dot_product_efficient_attention_backward,
              aten._scaled_dot_product_cudnn_attention_backward)
def _sdpa_backward(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape,
                      _causal(a.get("is_causal")), True, True)


def _flash_causal(a):
    if not a.get("is_causal"):
        return None
    return "bottom_right"  # flash attention aligns its causal mask to the bottom right


@flop_formula(aten._flash_attention_forward)
def _flash_fwd(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape, _flash_causal(a), False, False)


@flop_formula(aten._flash_attention_backward)
def _flash_bwd(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape, _flash_causal(a), False, True)


def _mem_eff_causal(a):
    return {0: None, 1: "top_left", 2: "bottom_right"}[a.get("custom_mask_type", 0)]


@flop_formula(aten._efficient_attention_forward)
def _eff_fwd(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape, _mem_eff_causal(a), False, False)


@flop_formula(aten._efficient_attention_backward)
def _eff_bwd(op, a):
    return _attention(a["query"].shape, a["key"].shape, a["value"].shape, _mem_eff_causal(a), False, True)


# ---- pointwise --------------------------------------------------------------------------------

# Operations per output element, for pointwise ops that do more than one (default 1).
POINTWISE_COST = {
    "addcmul": 2, "addcdiv": 2,          # self + value * t1 * t2 (the value multiply: see below)
    "lerp": 3,                           # self + w * (end - self)
    "gelu": 5,                           # 0.5 * x * (1 + erf(x / sqrt 2)); tanh form: 9
    "gelu_backward": 9,                  # g * (cdf + x * pdf), pdf = exp(-x^2/2)/sqrt(2 pi)
    "silu": 4, "silu_backward": 7,       # x * sigmoid(x); g * s * (1 + x * (1 - s))
    "sigmoid": 3, "sigmoid_backward": 3,  # 1 / (1 + exp(-x)); g * (1 - y) * y
    "tanh_backward": 3,                  # g * (1 - y^2)
    "hardswish": 4, "hardswish_backward": 4, "hardsigmoid": 3, "hardsigmoid_backward": 2,
    "mish": 5, "softplus": 3, "elu": 3, "leaky_relu": 2, "leaky_relu_backward": 2,
    "log_sigmoid_forward": 4, "logit": 3,
    "xlogy": 2, "hypot": 4, "atan2": 1, "rsub": 1, "erfinv": 1,
    "masked_fill": 1,                    # a selection per element (not tagged pointwise)
}

# Pointwise-tagged ops that do no arithmetic: copies.
_POINTWISE_ZERO = {"clone", "_to_copy", "copy", "alias_copy", "lift_fresh_copy", "fill", "zero",
                   "bernoulli", "uniform", "normal", "exponential", "random", "rand_like",
                   "randn_like", "randint_like", "full_like", "zeros_like", "ones_like", "empty_like"}


def _pointwise_cost(name: str, a: dict) -> int:
    base = name.rstrip("_")
    cost = POINTWISE_COST.get(base, 1)
    if base == "gelu" and a.get("approximate", "none") == "tanh":
        cost = 9
    if base in ("addcmul", "addcdiv") and a.get("value", 1) != 1:
        cost += 1
    if base in ("add", "sub") and a.get("alpha", 1) != 1:
        cost += 1
    return cost


def _out_numel(op: OpRecord) -> int:
    return sum(o.numel for o in op.tensor_outputs())


# ---- norms, softmax, losses ---------------------------------------------------------------------

def _numel(x) -> int:
    return x.numel if type(x) is TensorRef else 0


@flop_formula(aten._softmax, aten._log_softmax)
def _softmax(op, a):
    return 5 * a["self"].numel  # max, subtract, exp, sum, divide (log-softmax: log instead)


@flop_formula(aten._safe_softmax)
def _safe_softmax(op, a):
    # softmax (5), then rows that are all -inf become 0: x == -inf (1), all() over the row (1),
    # where (1)
    return 8 * a["self"].numel


@flop_formula(aten._softmax_backward_data, aten._log_softmax_backward_data)
def _softmax_backward(op, a):
    return 4 * a["grad_output"].numel  # g*y, row sum, subtract, multiply (log: exp instead of g*y)


@flop_formula(aten.native_layer_norm, aten.native_group_norm)
def _layer_norm(op, a):
    # mean: 1 add, variance: subtract, square, add (3), normalise: subtract, multiply (2): 6,
    # then weight multiply and bias add where present
    x = a["input"]
    return x.numel * (6 + (a.get("weight") is not None) + (a.get("bias") is not None))


@flop_formula(aten.native_layer_norm_backward, aten.native_group_norm_backward)
def _layer_norm_backward(op, a):
    # x_hat (2); dgamma = sum(g * x_hat) (2); dbeta = sum(g) (1);
    # dx = rstd * (g*w - mean(g*w) - x_hat * mean(g*w*x_hat)): 8
    x = a.get("input") if a.get("input") is not None else a.get("grad_out")
    return 13 * x.numel


@flop_formula(aten._fused_rms_norm)
def _rms_norm(op, a):
    # x^2, mean, (rsqrt per row), x * rstd, * weight
    x = a["input"]
    return x.numel * (3 + (a.get("weight") is not None))


@flop_formula(aten._fused_rms_norm_backward)
def _rms_norm_backward(op, a):
    # x_hat (1); dweight = sum(g * x_hat) (2); gw = g*w (1);
    # dx = rstd * (gw - x_hat * mean(gw * x_hat)): 4
    return 8 * a["input"].numel


@flop_formula(aten.native_batch_norm, aten._native_batch_norm_legit,
              aten._native_batch_norm_legit_functional, aten.cudnn_batch_norm,
              aten.miopen_batch_norm)
def _batch_norm(op, a):
    x = a["input"]
    training = a.get("training", True)
    affine = (a.get("weight") is not None) + (a.get("bias") is not None)
    # training: statistics as layer norm (4 per element) + normalise (2); eval: normalise only
    return x.numel * ((6 if training else 2) + affine)


@flop_formula(aten._native_batch_norm_legit_no_training)
def _batch_norm_eval(op, a):
    return a["input"].numel * (2 + (a.get("weight") is not None) + (a.get("bias") is not None))


@flop_formula(aten.native_batch_norm_backward, aten.cudnn_batch_norm_backward,
              aten.miopen_batch_norm_backward)
def _batch_norm_backward(op, a):
    return 13 * a["input"].numel  # as layer norm backward, reduced over the batch instead


@flop_formula(aten.nll_loss_forward, aten.nll_loss2d_forward)
def _nll(op, a):
    return _numel(a["target"]) * (1 + (a.get("weight") is not None))  # pick, (weight), sum


@flop_formula(aten.nll_loss_backward, aten.nll_loss2d_backward)
def _nll_backward(op, a):
    return _numel(a["target"]) * (1 + (a.get("weight") is not None))  # scatter -g (x weight)


@flop_formula(aten.mse_loss)
def _mse(op, a):
    return 3 * a["self"].numel  # subtract, square, sum


@flop_formula(aten.mse_loss_backward)
def _mse_backward(op, a):
    return 3 * a["self"].numel  # 2 * (x - y) * g


@flop_formula(aten.binary_cross_entropy_with_logits)
def _bce_logits(op, a):
    return 8 * a["self"].numel  # (1 - y) * x + log(1 + exp(-x)), stable form


@flop_formula(aten.embedding_dense_backward)
def _embedding_backward(op, a):
    return a["grad_output"].numel  # one add per gradient element into its row


@flop_formula(aten.index_add, aten.index_add_, aten.scatter_add, aten.scatter_add_,
              aten.scatter_reduce, aten.scatter_reduce_, aten.index_put, aten.index_put_,
              aten._index_put_impl_)
def _accumulate(op, a):
    if "index_put" in op.func.overloadpacket.__name__ and not a.get("accumulate"):
        return 0
    src = a.get("source", a.get("src", a.get("values")))
    return _numel(src)


@flop_formula(aten.native_dropout)
def _dropout(op, a):
    return 2 * a["input"].numel  # x * mask * scale (the random mask is not arithmetic)


@flop_formula(aten.native_dropout_backward)
def _dropout_backward(op, a):
    return 2 * a["grad_output"].numel


# ---- reductions -------------------------------------------------------------------------------

@flop_formula(aten.mean)
def _mean(op, a):
    return a["self"].numel + _out_numel(op)  # sum, then one divide per output


@flop_formula(aten.cumsum, aten.cumprod)
def _scan(op, a):
    return a["self"].numel


@flop_formula(aten.var, aten.std, aten.var_mean, aten.std_mean)
def _var(op, a):
    return 4 * a["self"].numel  # mean (1), subtract, square, sum (3)


@flop_formula(aten.linalg_vector_norm, aten.norm)
def _norm(op, a):
    return 2 * a["self"].numel  # |x|^p and sum (p=2: square and add)


@flop_formula(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool2d,
              aten.avg_pool3d)
def _pool(op, a):
    window = 1
    for k in a["kernel_size"]:
        window *= k
    if len(a["kernel_size"]) == 1:
        window = window ** (3 if "3d" in op.func.overloadpacket.__name__ else 2)
    return op.outputs[0].numel * window  # one compare / add per window element


@flop_formula(aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward)
def _max_pool_backward(op, a):
    return a["grad_output"].numel  # scatter-add each gradient into its argmax


@flop_formula(aten.avg_pool2d_backward, aten.avg_pool3d_backward)
def _avg_pool_backward(op, a):
    return a["self"].numel


@flop_formula(aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d)
def _adaptive_pool(op, a):
    return a["self"].numel + _out_numel(op)  # sum each window, divide per output


@flop_formula(aten._adaptive_avg_pool2d_backward, aten._adaptive_avg_pool3d_backward)
def _adaptive_pool_backward(op, a):
    return a["self"].numel


# Interpolation: each output element is a weighted sum of this many input elements (multiply-adds,
# 2 FLOPs each); the backward scatters each output gradient to the same taps (multiply + add).
_INTERPOLATION_TAPS = {"upsample_linear1d": 2, "upsample_bilinear2d": 4, "_upsample_bilinear2d_aa": 4,
                       "upsample_trilinear3d": 8, "upsample_bicubic2d": 16, "_upsample_bicubic2d_aa": 16}


@flop_formula(*(getattr(aten, n) for n in _INTERPOLATION_TAPS if hasattr(aten, n)))
def _interpolate(op, a):
    return 2 * _INTERPOLATION_TAPS[op.func.overloadpacket.__name__] * _out_numel(op)


@flop_formula(*(getattr(aten, n + "_backward") for n in _INTERPOLATION_TAPS
                if hasattr(aten, n + "_backward")))
def _interpolate_backward(op, a):
    taps = _INTERPOLATION_TAPS[op.func.overloadpacket.__name__[:-len("_backward")]]
    return 2 * taps * a["grad_output"].numel


# ---- optimizers -------------------------------------------------------------------------------

def _foreach_numel(x) -> int:
    return sum(t.numel for t in x if type(t) is TensorRef) if type(x) in (tuple, list) else 0


# Per-element cost of torch's fused optimizer kernels, equal to the sum of the per-element costs
# of the ops of the same update done by the foreach / for-loop implementations.
# AdamW: p *= 1 - lr*wd (1); m.lerp_(g, 1-b1) (3); v *= b2 (1); v.addcmul_(g, g, 1-b2) (3);
#        denom = sqrt(v) (1) / bc2_sqrt (1) + eps (1); p.addcdiv_(m, denom, -step_size) (3) = 14.
# Adam: the same without the decay multiply, plus g = g + wd*p when weight_decay != 0.
# SGD: p -= lr * g (2), with momentum: buf = m*buf + g (2), with weight decay g += wd*p (2).
@flop_formula(aten._fused_adamw, aten._fused_adamw_)
def _fused_adamw(op, a):
    return 14 * _foreach_numel(a["self"])


@flop_formula(aten._fused_adam, aten._fused_adam_)
def _fused_adam(op, a):
    return (13 + 2 * (a.get("weight_decay", 0) != 0)) * _foreach_numel(a["self"])


@flop_formula(aten._fused_sgd, aten._fused_sgd_)
def _fused_sgd(op, a):
    per = 2 + 2 * (a.get("momentum", 0) != 0) + 2 * (a.get("weight_decay", 0) != 0)
    return per * _foreach_numel(a["self"])


@flop_formula(aten._amp_foreach_non_finite_check_and_unscale,
              aten._amp_foreach_non_finite_check_and_unscale_)
def _unscale(op, a):
    return 2 * _foreach_numel(a["self"])  # isfinite check and multiply


# ---- ops that do no arithmetic ----------------------------------------------------------------

ZERO_FLOP_OPS = {getattr(aten, n) for n in (
    # allocation and filling
    "empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "scalar_tensor", "arange", "linspace", "new_empty", "new_empty_strided",
    "new_zeros", "new_ones", "new_full", "fill", "fill_", "zero", "zero_", "lift_fresh",
    "lift_fresh_copy", "eye", "tril_indices", "triu_indices",
    # random numbers (generation is not arithmetic on data)
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "bernoulli_", "uniform", "uniform_", "normal", "normal_", "exponential_",
    "random_", "multinomial",
    # copies, casts and layout
    "clone", "copy", "copy_", "_to_copy", "contiguous", "_copy_from", "_copy_from_and_resize",
    "detach", "detach_", "alias", "_unsafe_view", "cat", "stack", "_cat", "constant_pad_nd", "repeat",
    "repeat_interleave", "flip", "roll", "tril", "triu", "masked_scatter", "slice_scatter",
    "select_scatter", "diagonal_scatter", "as_strided_scatter", "pixel_shuffle",
    "pixel_unshuffle", "im2col", "col2im", "unfold_backward", "channel_shuffle",
    "_reshape_alias", "resize_", "set_", "split_with_sizes_copy", "unbind_copy", "as_strided_",
    # gathers and lookups
    "embedding", "index", "index_select", "gather", "take", "masked_select", "_embedding_bag",
    "scatter", "index_copy", "index_fill", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d",
    # backward of views and slicing: zero-fill and place
    "slice_backward", "select_backward", "expand_backward", "as_strided_backward",
    "diagonal_backward", "_unsafe_index",
    # scalars and metadata
    "_local_scalar_dense", "item", "_assert_async", "_assert_scalar", "sym_constrain_range",
    "_foreach_copy_", "_foreach_copy", "_foreach_zero_",
    "_has_compatible_shallow_copy_type", "_pin_memory", "record_stream",
) if hasattr(aten, n)}


# torch.distributed's ops move or pack data: collectives (the adds of a reduction run in the
# communication library's kernels, on the interconnect's time, not counted as model FLOPs) and
# FSDP2's copy-in / copy-out / chunk_cat copies
_DISTRIBUTED_NAMESPACES = ("c10d", "_c10d_functional", "fsdp")


# ---- lookup -----------------------------------------------------------------------------------

_ARG_NAMES: dict = {}


def _bind(func, args, kwargs) -> dict:
    names = _ARG_NAMES.get(func)
    if names is None:
        names = _ARG_NAMES[func] = [(x.name, x.default_value if x.has_default_value() else None)
                                    for x in func._schema.arguments]
    bound = {}
    for i, (n, default) in enumerate(names):
        if i < len(args):
            bound[n] = args[i]
        elif n in kwargs:
            bound[n] = kwargs[n]
        else:
            bound[n] = default
    return bound


def op_flops(op: OpRecord) -> int | None:
    """FLOPs of one op, or None when no formula applies."""
    func = op.func
    packet = func.overloadpacket
    formula = _FORMULAS.get(packet)
    if formula is not None:
        return formula(op, _bind(func, op.args, op.kwargs))
    if packet in ZERO_FLOP_OPS or func.is_view or func.namespace in _DISTRIBUTED_NAMESPACES:
        return 0
    name = packet.__name__
    if name.startswith("_foreach_"):
        return _foreach_flops(op, name)
    tags = func.tags
    if torch.Tag.pointwise in tags:
        if name.rstrip("_") in _POINTWISE_ZERO:
            return 0
        return _pointwise_cost(name, _bind(func, op.args, op.kwargs)) * _out_numel(op)
    if torch.Tag.reduction in tags:
        return sum(t.numel for t in op.tensor_inputs())
    if name.rstrip("_") in POINTWISE_COST:  # elementwise, but not tagged so (hardswish_, ...)
        return _pointwise_cost(name, _bind(func, op.args, op.kwargs)) * _out_numel(op)
    return None


def _foreach_flops(op: OpRecord, name: str) -> int | None:
    """A foreach op costs its single-tensor op's cost over every element of its first list."""
    base = name[len("_foreach_"):].rstrip("_")
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    if packet in ZERO_FLOP_OPS:
        return 0
    a = _bind(op.func, op.args, op.kwargs)
    n = _foreach_numel(next((v for v in a.values() if type(v) in (tuple, list)), ()))
    if base == "norm":
        return 2 * n
    if base in ("max", "sum"):
        return n
    pointwise = any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    if not pointwise and base not in POINTWISE_COST:
        return None
    cost = _pointwise_cost(base, a)
    if base in ("addcmul", "addcdiv") and a.get("scalars") is not None:
        cost += 1  # per-tensor value multiply
    return cost * n
