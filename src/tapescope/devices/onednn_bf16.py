"""Which oneDNN convolution kernel a bfloat16 CPU convolution runs on AVX512-BF16 (avx512_core_bf16),
and the memory it needs beside PyTorch's tensors: operands reordered into the kernel's layout,
and its scratchpad. The fp32 kernels are devices/onednn.py's; this file follows the same plan for
oneDNN's bf16 kernels (3.x as bundled with torch: src/cpu/x64/jit_avx512_core_bf16_conv_kernel.cpp,
src/cpu/cpu_convolution_list.cpp), which choose other layouts and book other scratchpads.

Where oneDNN has no bf16 kernel (AVX2 and below) PyTorch does not call oneDNN for bf16 at all
(`mkldnn_bf16_device_check`): ATen's slow kernels run, capture/fidelity/slow_convolution.py
counts their columns.

What is modelled from the kernels' sources and checked against the allocator on an AVX512-BF16
host (an AMD EPYC; tests/test_kernel_workspace.py::test_bf16_convolution_matches_the_allocator):
- NCHW, not 1x1, not depthwise: jit_avx512_core_bf16_convolution (`jit_bf16`): forward and unit-
  stride backward-data reorder into 16-channel blocks (channels padded for one group, groups
  whose channels fill 8 or 4 lanes use the narrower blocks, a first layer - fewer than 16 input
  channels - keeps its plain source); the forward books a padded bf16 bias. The weight gradient
  (jit_avx512_core_bf16_conv_bwd_weights_kernel_f32_t) transposes the source and diff_dst into
  per-(batch-thread, channel block) buffers (`global_transpose`), accumulates in f32 buffers for
  every batch thread because the gradient is bf16 (`key_conv_wei_bia_reduction`, the bias too),
  with a barrier; its thread split is `balance`'s memory-cost search, followed line by line.
- NCHW depthwise (jit_uni_dw<avx512_core, bf16>): 16-channel blocks, the bf16 bias converted to
  f32 (forward, weight gradient), the weight gradient's f32 accumulators per batch thread (one
  even where the batch is not split), groups padded to 16 there.
- 1x1, one group, NCHW, unit strides (jit_avx512_core_bf16_1x1): forward and backward-data
  reorders and the f32 store buffer, from init_conf's register blocking and load-group count
  (an estimate where that count depends on the core's L2 size).
Everything else (brgemm kernels on channels-last tensors, strided backward-data on
`brgconv_strided`, the 1x1 weight gradient's reduction and transpose buffers, a first layer's
spatially blocked weight gradient, the GEMM fallback) is an estimate:
the reorders follow the layouts those kernels are known to pick, the scratchpad is not counted,
and the choice says `exact=False`.
"""

from __future__ import annotations

from math import prod

import numpy as np

from .cpu import CpuTarget
from .onednn import Conv, Primitive, _best_divider, _dw_backward_weights_ok
from .onednn_brgemm_bwd import runs_strided_backward_data, strided_backward_data

__all__ = ["forward", "backward_data", "backward_weights"]

_BF16 = 2
_F32 = 4
_SIMD = 16           # f32 lanes of a zmm: the bf16 kernels block channels by 16
_ALIGN = 128         # memory_tracking.hpp: every booking carries this much for alignment
_PAGE = 4096         # a simple_barrier::ctx_t booking (cpu_barrier.hpp CTX_ALIGNMENT)
_MAX_UR_W = 28       # jit_avx512_core_bf16_conv_bwd_weights_kernel_f32_t's max_ur_w


def _rnd_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _div_up(x: int, m: int) -> int:
    return -(-x // m)


def _blocked(n: int, channels: int, spatial: int, block: int) -> int:
    return n * _rnd_up(channels, block) * spatial * _BF16


def _barriers(n: int) -> int:
    return n * _PAGE + _PAGE


def _first_layer(c: Conv) -> bool:
    """`is_1stconv`: fewer than 16 input channels in one group."""
    return c.groups == 1 and c.ic < _SIMD


def _pads(c: Conv) -> list[tuple[int, int, int]]:
    """(extended kernel, front padding, end padding) per spatial dimension (calculate_end_padding
    with oneDNN's dilation, which is PyTorch's minus one)."""
    out = []
    for k, d, p, i, o, s in zip(c.kernel, c.dilation, c.padding, c.in_size, c.out_size,
                                c.stride):
        ext = (k - 1) * d + 1
        out.append((ext, p, (o - 1) * s + ext - i - p))
    return out


def _kernel_outside_src(c: Conv) -> bool:
    return any(ext <= front or ext <= end for ext, front, end in _pads(c))


def _simd(c: Conv) -> int | None:
    """The channel block: 16, or for a group whose channels do not fill 16 lanes the first of
    8 and 4 that divides both (`ok_to_try_lower_zmm`); None where none does (oneDNN refuses)."""
    if c.groups == 1 or (c.ic_g % _SIMD == 0 and c.oc_g % _SIMD == 0):
        return _SIMD
    return next((s for s in (8, 4) if c.ic_g % s == 0 and c.oc_g % s == 0), None)


def _estimate(impl: str, c: Conv, **sizes) -> Primitive:
    return Primitive(f"{impl}:avx512_core_bf16", exact=False, **sizes)


def forward(c: Conv, cpu: CpuTarget) -> Primitive:
    if c.channels_last:  # brgemm_convolution_fwd_t / jit_uni_dw on NHWC: the weights reordered
        kind = "brdgmm_dw" if c.depthwise else "brg_conv_fwd"
        return _estimate(kind, c, weights=c.groups * _rnd_up(c.oc_g, _SIMD) * c.ic_g * c.ks
                         * _BF16)
    if c.depthwise:  # jit_uni_dw: the bf16 bias in f32, padded (key_conv_bias_bf16_convert_wsp)
        return Primitive("jit_dw:avx512_core_bf16", src=_blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                         weights=_rnd_up(c.groups, _SIMD) * c.ks * _BF16,
                         dst=_blocked(c.mb, c.oc, c.out_spatial, _SIMD),
                         scratchpad=_rnd_up(c.oc, _SIMD) * _F32 + _ALIGN if c.bias else 0,
                         exact=not _kernel_outside_src(c))
    simd = _simd(c)
    if _plain_1x1(c):
        return _pointwise(c, cpu, forward=True)
    if c.pointwise or simd is None or _kernel_outside_src(c):
        kind = "jit_bf16_1x1" if c.pointwise else "gemm:jit"
        return _estimate(kind, c, src=_blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                         weights=_rnd_up(c.oc, _SIMD) * _rnd_up(c.ic_g, _SIMD) * c.ks * _BF16,
                         dst=_blocked(c.mb, c.oc, c.out_spatial, _SIMD))
    first = _first_layer(c)
    if first:  # plain source; weights OhwI16o2i: output channels by 16, input channels by 2
        src, weights = 0, _rnd_up(c.oc, _SIMD) * _rnd_up(c.ic, 2) * c.ks * _BF16
    else:
        src = _blocked(c.mb, c.ic, c.in_spatial, simd)
        weights = c.groups * _rnd_up(c.oc_g, simd) * _rnd_up(c.ic_g, simd) * c.ks * _BF16
    scratch = 0
    if c.bias and c.groups == 1 and c.oc % _SIMD:  # key_conv_padded_bias, in the bias's bf16
        scratch = _rnd_up(c.oc, _SIMD) * _BF16 + _ALIGN
    return Primitive("jit_bf16:avx512_core_bf16", src=src, weights=weights,
                     dst=_blocked(c.mb, c.oc, c.out_spatial, simd), scratchpad=scratch)


def backward_data(c: Conv, cpu: CpuTarget) -> Primitive:
    if c.channels_last:
        kind = "jit_dw" if c.depthwise else "brg_conv_bwd"
        return _estimate(kind, c, weights=c.groups * _rnd_up(c.ic_g, _SIMD) * c.oc_g * c.ks
                         * _BF16)
    plain_dst = c.mb * c.oc * c.out_spatial * _BF16
    plain_src = c.mb * c.ic * c.in_spatial * _BF16
    if c.depthwise and all(s == 1 for s in c.stride):  # jit_uni_dw: blocked, no scratchpad
        return Primitive("jit_dw:avx512_core_bf16",
                         src=_blocked(c.mb, c.oc, c.out_spatial, _SIMD),
                         weights=_rnd_up(c.groups, _SIMD) * c.ks * _BF16,
                         dst=_blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                         exact=not _kernel_outside_src(c))
    if runs_strided_backward_data(c):  # brgconv_strided (devices/onednn_brgemm_bwd.py)
        return strided_backward_data(c, cpu)
    if any(s != 1 for s in c.stride):
        # brgemm_convolution_bwd_strided_t on a problem not modelled there (groups): NHWC
        return _estimate("brgconv_strided", c, src=plain_dst,
                         weights=_rnd_up(c.ic_g, _SIMD) * c.groups * c.oc_g * c.ks * _BF16,
                         dst=plain_src)
    simd = _simd(c)
    if _plain_1x1(c):
        return _pointwise(c, cpu, forward=False)
    if c.depthwise or c.pointwise or simd is None or _kernel_outside_src(c):
        kind = "jit_dw" if c.depthwise else ("jit_bf16_1x1" if c.pointwise else "gemm:jit")
        return _estimate(kind, c, src=_blocked(c.mb, c.oc, c.out_spatial, _SIMD),
                         weights=_rnd_up(c.oc, _SIMD) * _rnd_up(c.ic_g, _SIMD) * c.ks * _BF16,
                         dst=_blocked(c.mb, c.ic, c.in_spatial, _SIMD))
    # jit_avx512_core_bf16_bwd_data_kernel_t::init_conf: both data tensors blocked (a first
    # layer's few channels padded like any other), weights OIhw8o16i2o
    return Primitive("jit_bf16:avx512_core_bf16",
                     src=_blocked(c.mb, c.oc, c.out_spatial, simd),
                     weights=c.groups * _rnd_up(c.oc_g, simd) * _rnd_up(c.ic_g, simd) * c.ks
                     * _BF16,
                     dst=_blocked(c.mb, c.ic, c.in_spatial, simd))


def backward_weights(c: Conv, cpu: CpuTarget) -> Primitive:
    bias = c.oc * _BF16 if c.bias else 0       # ideep's own bias gradient, bf16 like the weights
    if c.depthwise and not c.channels_last:
        if _dw_backward_weights_ok(c):
            return _dw_backward_weights(c, cpu, bias)
        # gemm_bf16_convolution_bwd_weights_t on plain layouts: its scratchpad not modelled
        return _estimate("gemm:jit", c, bias=bias, dst=c.oc * c.ic_g * c.ks * _BF16)
    if _plain_1x1(c):
        return _pointwise_backward_weights(c, cpu, bias)
    if c.channels_last or c.depthwise or c.pointwise:
        kind = "jit_dw" if c.depthwise else ("jit_bf16_1x1" if c.pointwise else "jit_bf16")
        src = 0 if c.channels_last else _blocked(c.mb, c.ic, c.in_spatial, _SIMD)
        diff_dst = 0 if c.channels_last else _blocked(c.mb, c.oc, c.out_spatial, _SIMD)
        return _estimate(kind, c, src=src, diff_dst=diff_dst, bias=bias,
                         dst=c.groups * _rnd_up(c.oc_g, _SIMD) * _rnd_up(c.ic_g, _SIMD) * c.ks
                         * _BF16)
    conf = _bwd_weights_conf(c)
    if conf is None:  # the jit kernel refuses: gemm_bf16_convolution_bwd_weights_t
        return _estimate("gemm:jit", c, bias=bias,
                         dst=c.oc * c.ic_g * c.ks * _BF16)
    return _bwd_weights(c, cpu, conf, bias)


def _bwd_weights_conf(c: Conv) -> dict | None:
    """jit_avx512_core_bf16_conv_bwd_weights_kernel_f32_t::init_conf for a blocked (NCHW)
    problem: None where it refuses, else the sizes its scratchpad depends on."""
    three_d = len(c.kernel) == 3
    pads = _pads(c)
    (ext_kw, l_pad, r_pad), (ext_kh, t_pad, b_pad) = pads[-1], pads[-2]
    ext_kd, f_pad, back_pad = pads[0] if three_d else (1, 0, 0)
    r_pad, b_pad, back_pad = max(0, r_pad), max(0, b_pad), max(0, back_pad)
    dh, dw = c.dilation[-2] - 1, c.dilation[-1] - 1
    dd = c.dilation[0] - 1 if three_d else 0
    sd = c.stride[0] if three_d else 1
    sh, sw = c.stride[-2:]
    ih, iw, oh, ow = c.in_size[-2], c.in_size[-1], c.out_size[-2], c.out_size[-1]
    if (dd and sd != 1) or (dh and sh != 1) or (dw and sw != 1) or (dh and ext_kh > ih):
        return None
    if dd and (back_pad or f_pad):
        return None
    first = _first_layer(c)
    if c.groups > 1 and (c.ic_g % _SIMD or c.oc_g % _SIMD):
        return None                                          # block_ok: groups are not padded
    if not (l_pad < ext_kw and r_pad < ext_kw and t_pad <= ext_kh // 2 and b_pad <= ext_kh // 2
            and f_pad < ext_kd and back_pad < ext_kd):
        return None                                          # boundaries_ok
    if first and ow > _MAX_UR_W and not (l_pad < _MAX_UR_W and ext_kw <= ow):
        return None
    if c.kernel[-1] > (24 if first else 14):
        return None
    ic = c.ic if first else _rnd_up(c.ic_g, _SIMD)
    oc = _rnd_up(c.oc_g, _SIMD)
    ic_block = c.ic if first else _SIMD
    # uses_permw_transposition: on blocked tensors only a 3-D kernel one wide (ic_block_step 8)
    permw = not first and sw == 1 and not dw and three_d and c.kernel[-1] == 1
    transpose_src = not permw and not first
    transpose_dst = not permw
    if not transpose_src and not (l_pad < _MAX_UR_W and r_pad < _MAX_UR_W
                                  and ext_kw <= iw + 1):
        return None                                          # padding_ok
    tr_pad = _rnd_up(max(l_pad, r_pad + 1), 2)
    tr_iw = _rnd_up(_div_up(iw, sw) + tr_pad, 2) * sw if transpose_src else iw
    tr_ow = _rnd_up(ow, 2) if transpose_dst else ow
    # a first layer with a wide, large diff_dst may transpose it in spatial blocks instead
    # (`use_spatial_blocking`: "large" is against the core's L2 size, which a target does not
    # name): such a problem is an estimate
    maybe_blocked = first and ((not three_d and ow >= 124 and oh > 1)
                               or (three_d and ow * oh >= 64 * 124 and c.out_size[0] > 1))
    full_spatial = (not three_d and ih == oh and iw == ow and 1 not in c.kernel[-2:]
                    and sh == sw == 1 and not dh and not dw and l_pad == c.kernel[-1] // 2
                    and t_pad == c.kernel[-2] // 2 and not permw and not first and ic >= 128
                    and (ic_block * tr_iw + _SIMD * tr_ow) * _BF16 * max(1, b_pad, t_pad)
                    <= _FULL_SPAT_WORKING_SET)
    mb_work = c.mb * (c.out_size[0] if three_d else (1 if full_spatial else oh))
    return dict(ic=ic, oc=oc, ic_block=ic_block, tr_iw=tr_iw, tr_ow=tr_ow, tr_pad=tr_pad,
                permw=permw, transpose_src=transpose_src, mb_work=mb_work,
                maybe_blocked=maybe_blocked)


_FULL_SPAT_WORKING_SET = 48 * 1024   # full_spat_opt_working_set_size (the kernel's header)


def _balance(c: Conv, conf: dict, threads: int) -> tuple[int, int, int, int]:
    """jit_avx512_core_bf16_conv_bwd_weights_kernel_f32_t::balance: (threads in all, batch
    threads, output-channel-block threads, input-channel-block threads), its float costs in
    float32 as the C++ computes them."""
    if threads < c.groups:
        return threads, 1, 1, 1
    f = np.float32
    nthr = threads // c.groups
    three_d = len(c.kernel) == 3
    id_, ih = (c.in_size[0] if three_d else 1), c.in_size[-2]
    od, oh = (c.out_size[0] if three_d else 1), c.out_size[-2]
    sd = c.stride[0] if three_d else 1
    sh, sw = c.stride[-2:]
    ic, oc, ic_block = conf["ic"], conf["oc"], conf["ic_block"]
    tr_iw, tr_ow, work = conf["tr_iw"], conf["tr_ow"], conf["mb_work"]
    nb_ic, nb_oc = _div_up(ic, ic_block), _div_up(oc, _SIMD)
    src_size = c.mb * ic * id_ * ih * tr_iw * 2
    dst_size = c.mb * oc * od * oh * tr_ow * 2
    wei_size = oc * ic * c.ks * 4
    wei_scale = f(0.5) * f(dst_size + src_size) / f(wei_size)
    ratio = f(nb_oc) / f(nb_ic)
    src_coef = max(f(1.0) / ratio, f(1.0))
    if wei_scale < f(1.0):
        src_coef *= f(4.0)
    dst_coef, wei_coef = max(ratio, f(1.0)), max(wei_scale, f(1.0))

    def cost(mb, ocb, icb):
        src = src_coef * f(_div_up(work, mb) * _div_up(nb_ic, icb) * c.mb * ic_block * id_
                           * ih * tr_iw) / f(work * sd * sh * sw)
        wei = wei_coef * f(_div_up(nb_oc, ocb) * _div_up(nb_ic, icb) * c.ks * ic_block * _SIMD)
        dst = dst_coef * f(_div_up(work, mb) * _div_up(nb_oc, ocb) * c.mb * _SIMD * od * oh
                           * tr_ow) / f(work)
        return f(f(src + dst) + wei)

    best_cost, best = cost(1, 1, 1), (1, 1, 1)
    for mb in range(1, min(nthr, work) + 1):
        par = nthr // mb
        for ocb in range(1, min(par, nb_oc) + 1):
            icb = min(par // ocb, nb_ic)
            here = cost(mb, ocb, icb)
            if here <= best_cost:
                best_cost, best = here, (mb, ocb, icb)
    mb, ocb, icb = best
    if nthr // 2 < mb < nthr:
        mb = min(work, nthr)
    return mb * c.groups * ocb * icb, mb, ocb, icb


def _bwd_weights(c: Conv, cpu: CpuTarget, conf: dict, bias: int) -> Primitive:
    """init_scratchpad: the transposed source and diff_dst (one buffer per batch thread and
    channel block under `global_transpose`), their barriers where channel blocks are split
    across threads, then the f32 accumulators of every batch thread (the gradient is bf16) and
    their barrier."""
    nthr, nthr_mb, nthr_oc_b, nthr_ic_b = _balance(c, conf, cpu.threads)
    ic, oc, ic_block = conf["ic"], conf["oc"], conf["ic_block"]
    nb_ic, nb_oc = _div_up(ic, ic_block), _div_up(oc, _SIMD)
    three_d = len(c.kernel) == 3
    id_, ih = (c.in_size[0] if three_d else 1), c.in_size[-2]
    od, oh = (c.out_size[0] if three_d else 1), c.out_size[-2]
    scratch = 0
    if not conf["permw"]:
        # global_transpose (OpenMP threads can synchronize): a buffer per batch thread and
        # channel block; key_conv_tr_src is booked with its guard elements even where the source
        # is not transposed (a first layer: no buffers, tr_src_buf_count 0)
        size = conf["tr_pad"]
        if conf["transpose_src"]:
            size += nthr_mb * nb_ic * c.groups * conf["tr_iw"] * ic_block * ih * id_
        scratch += size * _BF16 + _ALIGN
        if nthr_oc_b > 1:
            scratch += _barriers(nthr // nthr_oc_b)          # key_conv_tr_src_bctx
        scratch += (nthr_mb * nb_oc * c.groups * conf["tr_ow"] * _SIMD * oh * od * _BF16
                    + _ALIGN)                                # key_conv_tr_diff_dst
        if nthr_ic_b > 1:
            scratch += _barriers(nthr // nthr_ic_b)          # key_conv_tr_diff_dst_bctx
    wei = c.groups * nb_oc * _SIMD * nb_ic * ic_block * c.ks
    bia = c.groups * nb_oc * _SIMD if c.bias else 0
    scratch += (wei + bia) * nthr_mb * _F32 + _ALIGN        # key_conv_wei_bia_reduction
    scratch += _barriers(1)                                  # key_conv_wei_bia_reduction_bctx
    weights = c.groups * oc * ic * c.ks * _BF16
    return Primitive("jit_bf16:avx512_core_bf16",
                     src=0 if _first_layer(c) else _blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, _SIMD), dst=weights,
                     bias=bias, scratchpad=scratch, exact=not conf["maybe_blocked"])


def _dw_backward_weights(c: Conv, cpu: CpuTarget, bias: int) -> Primitive:
    """jit_uni_dw_convolution_bwd_weights_t<avx512_core, bf16> on NCHW (harness_mb_reduction):
    the threads split the groups' blocks, then the batch (`balance`, as fp32's); the f32
    accumulators of a bf16 gradient - one per batch thread, one even where no thread splits the
    batch - the bias's partial sums where the batch is split, and the bf16 bias gradient's f32
    buffer (jit_uni_dw_conv_kernel_utils.cpp init_scratchpad)."""
    nthr_g = min(_div_up(c.groups, _SIMD), cpu.threads)
    nthr_mb = min(max(1, cpu.threads // nthr_g), c.mb)
    groups = _rnd_up(c.groups, _SIMD)                         # init_conf pads jcp.ngroups
    scratch = groups * c.ks * nthr_mb * _F32 + _ALIGN         # key_conv_wei_reduction
    if nthr_mb > 1 and c.bias:
        scratch += groups * (nthr_mb - 1) * _F32 + _ALIGN     # key_conv_bia_reduction
    if c.bias:
        scratch += groups * _F32 + _ALIGN                     # key_conv_bias_bf16_convert_wsp
    return Primitive("jit_dw:avx512_core_bf16", src=_blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, _SIMD),
                     dst=_rnd_up(c.groups, _SIMD) * c.ks * _BF16, bias=bias, scratchpad=scratch)


def _plain_1x1(c: Conv) -> bool:
    """A 1x1 convolution jit_avx512_core_bf16_1x1_convolution runs as modelled here: one group,
    NCHW, unit strides (a strided one's backward-data is brgconv_strided's)."""
    return (c.pointwise and c.groups == 1 and not c.channels_last
            and all(s == 1 for s in c.stride))


# jit_avx512_core_bf16_1x1_conv_kernel_t::init_conf's thresholds
_SMALL_SPATIAL, _BIG_SPATIAL, _BIG_LOAD_DIM = 10, 28, 256
# the per-core L2 of AVX512-BF16 CPUs lies between these (in bf16 elements: 256 KB and 2 MB)
_L2_ELEMENTS_AT_LEAST, _L2_ELEMENTS_AT_MOST = 2 ** 17, 2 ** 20


def _pointwise(c: Conv, cpu: CpuTarget, forward: bool) -> Primitive:
    """The bf16 1x1 kernel's forward or backward-data: channels padded to 16 and blocked, and
    its f32 store buffer (`key_conv_store_wsp`: threads x the broadcast dimension rounded to the
    register blocking `ur` x the load channels one thread group stores), from init_conf's
    register blocking and load-group count; the forward's padded bf16 bias. Where the load-group
    count depends on the core's L2 size (a map of at most 64 positions with large weights), an
    estimate."""
    nthr, mb = cpu.threads, c.mb
    ic, oc = _rnd_up(c.ic, _SIMD), _rnd_up(c.oc, _SIMD)
    reduce_dim, load_dim = (ic, oc) if forward else (oc, ic)
    bcast_dim = os_ = prod(c.out_size)                     # = is: unit strides, no padding
    spatial = prod(c.out_size[:-1])                        # od * oh (id * ih)
    expl_bcast = (8 * mb) // nthr >= 1                     # (no odd reduce tail: padded)
    if expl_bcast:
        max_regs, min_regs, threshold = 9, 6, 14
        if 128 < load_dim < _BIG_LOAD_DIM and _SMALL_SPATIAL < spatial < _BIG_SPATIAL:
            max_regs, min_regs = 6, 5
    else:
        max_regs, min_regs, threshold = 30, 9, 14
    ur = 1
    for ur_w in range(max_regs, min_regs - 1, -1):
        if (spatial >= threshold and spatial % ur_w == 0) or (spatial < threshold
                                                              and os_ % ur_w == 0):
            ur = ur_w
            break
    if ur == 1:
        ur, os_tail = min(max_regs, os_), os_ % max_regs
        for i in range(max_regs, min_regs - 1, -1):
            if os_ % i > os_tail or os_ % i == 0:
                ur, os_tail = i, os_ % i
                if os_tail == 0:
                    break
    nb_bcast, nb_load = _div_up(bcast_dim, ur), _div_up(load_dim, _SIMD)
    if nthr <= 28 and mb < nthr and nb_load * nb_bcast > nthr:
        lgc = _load_group_count(c, nthr, nb_load, nb_bcast, ur, reduce_dim, load_dim, bcast_dim)
    else:
        lgc = _div_up(nthr, mb * nb_bcast)
        lgc = _best_divider(nthr, lgc, 2 * lgc, False)
    load_size = load_dim * reduce_dim
    exact = True
    if expl_bcast and bcast_dim <= 64 and load_size >= _L2_ELEMENTS_AT_LEAST:
        exact = load_size >= _L2_ELEMENTS_AT_MOST          # else it depends on this L2
        lgc = max(lgc, 4)
    elif bcast_dim <= 49 and mb <= nthr and load_dim > 512 and load_dim // reduce_dim >= 4:
        lgc = max(lgc, 2)
    groups = _div_up(nthr, _div_up(nthr, lgc))
    if _BF16 * mb * bcast_dim * reduce_dim < 8192 and 1 < nthr and nb_bcast * nb_load < nthr:
        nthr = min(nthr, max(nb_bcast, nb_load))           # a small problem: fewer threads
    store = nthr * _rnd_up(bcast_dim, ur) * _rnd_up(_div_up(load_dim, groups), _SIMD)
    scratch = store * _F32 + _ALIGN
    if forward and c.bias and c.oc % _SIMD:
        scratch += oc * _BF16 + _ALIGN                     # key_conv_padded_bias
    src_c, dst_c = (c.ic, c.oc) if forward else (c.oc, c.ic)
    return Primitive("jit_bf16_1x1:avx512_core_bf16",
                     src=_blocked(c.mb, src_c, prod(c.in_size), _SIMD),
                     weights=oc * ic * _BF16,
                     dst=_blocked(c.mb, dst_c, prod(c.in_size), _SIMD),
                     scratchpad=scratch, exact=exact)


def _load_group_count(c: Conv, nthr: int, nb_load: int, nb_bcast: int, ur: int,
                      reduce_dim: int, load_dim: int, bcast_dim: int) -> int:
    """init_conf's "some heuristic here" for a batch smaller than the threads: the load-group
    count of least job cost (float32, as the C++)."""
    f = np.float32
    ratio = f(load_dim * reduce_dim) / f(c.mb * bcast_dim * reduce_dim)
    best_lgc, best_cost = (nthr if ratio > 1 else 1), f(np.finfo(np.float32).max)

    def job_cost(lb, tg, mem_k):
        bb = c.mb * _div_up(nb_bcast, tg)
        calc = f(bb * ur) * f(lb * _SIMD) * f(reduce_dim)
        mem = f(bb * ur + lb * _SIMD) * f(reduce_dim)
        return f(f(0.01) * calc) + f(mem_k * mem)

    for i in range(nthr):
        lgc = nthr - i if ratio > 1 else i + 1
        min_lb, max_lb = nb_load // lgc, _div_up(nb_load, lgc)
        min_tg, max_tg = nthr // lgc, _div_up(nthr, lgc)
        mem_k = f(1.0) if max_tg == 1 else f(1.3)
        if nthr % lgc < nb_load % lgc:
            cost = job_cost(max_lb, min_tg, mem_k)
        else:
            cost = max(job_cost(max_lb, max_tg, mem_k), job_cost(min_lb, min_tg, mem_k))
        if cost < best_cost:
            best_lgc, best_cost = lgc, cost
    return best_lgc


def _best_divider(value: int, min_divider: int, max_divider: int, find_max: bool,
                  step: int = 1) -> int:
    """jit_uni_1x1_conv_utils.hpp best_divider: the divider (stepping by `step`) that pads
    `value` least."""
    top = max(1, min(max_divider, value))
    low = max(1, min(min_divider, top))
    best, chosen = float("inf"), top
    for divider in range(top, low - 1, -step):
        padded = _rnd_up(value, divider)
        loss = float(np.float32(padded - value) / np.float32(padded))
        if (find_max and loss < best) or (not find_max and loss <= best):
            best, chosen = loss, divider
    return chosen


def _pointwise_backward_weights(c: Conv, cpu: CpuTarget, bias: int) -> Primitive:
    """jit_avx512_core_bf16_1x1's weight gradient (init_conf's backward_weights branch,
    `balance`, init_scratchpad): f32 accumulators of weights and bias for every batch thread
    (the gradient is bf16), a barrier where the batch is split, and - without the permw
    transposition (maps of 14 or fewer rows or columns) - per-thread transposed diff_dst and
    source buffers over the whole map; a padded bf16 bias."""
    ic, oc = _rnd_up(c.ic, _SIMD), _rnd_up(c.oc, _SIMD)
    oh, ow = c.out_size[-2], c.out_size[-1]
    three_d = len(c.kernel) == 3
    reduce_dim = prod(c.in_size)
    permw = oh > 14 and ow > 14 and (not three_d or oc <= 64)
    iw = c.in_size[-1]
    if permw:
        reduce_block = _best_divider(reduce_dim, 7, min(256, reduce_dim), True, 2)
    else:
        reduce_block = _best_divider(reduce_dim, 8, 16, True, 2)
    if reduce_dim % reduce_block:
        reduce_block = _best_divider(iw, 4, iw, permw, 2)
    if reduce_block > 256:
        reduce_block = 1
    if not permw:
        reduce_block = _rnd_up(reduce_block, 2)
    nb_bcast, nb_load = ic // _SIMD, oc // _SIMD
    nb_reduce = _div_up(reduce_dim, reduce_block)
    nthr_mb = nthr_oc_b = nthr_ic_b = 1
    nthr = cpu.threads
    output_koeff = 4 * max(1, oc // ic)                     # unit strides

    def cost(mb, ocb, icb):
        return (_div_up(c.mb * nb_reduce, mb) * _div_up(nb_bcast, icb) * _SIMD * reduce_block
                + _div_up(c.mb * nb_reduce, mb) * _div_up(nb_load, ocb) * _SIMD * reduce_block
                + output_koeff * _div_up(nb_load, ocb) * _div_up(nb_bcast, icb) * _SIMD * _SIMD)

    best = cost(1, 1, 1)
    for mb in range(1, min(nthr, c.mb * nb_reduce) + 1):
        par = nthr // mb
        for ocb in range(1, min(par, nb_load) + 1):
            icb = min(par // ocb, nb_bcast)
            if cost(mb, ocb, icb) <= best:
                best, nthr_mb, nthr_oc_b, nthr_ic_b = cost(mb, ocb, icb), mb, ocb, icb
    if nthr // 2 < nthr_mb < nthr:
        nthr_mb = min(c.mb, nthr)
    threads = nthr_mb * nthr_oc_b * nthr_ic_b
    scratch = 0
    if c.bias and c.oc % _SIMD:
        scratch += oc * _BF16 + _ALIGN                     # key_conv_padded_bias
    wei_bias = oc * ic + (oc if c.bias else 0)
    scratch += wei_bias * nthr_mb * _F32 + _ALIGN           # key_conv_wei_reduction
    if nthr_mb > 1:
        scratch += _barriers(1)                             # key_conv_wei_reduction_bctx
    if not permw:
        load_blocking = _best_divider(nb_load, 16, nb_load, False)
        bcast_blocking = _best_divider(nb_bcast, 5, nb_bcast, False)
        rows = _rnd_up(reduce_dim, 2)
        scratch += threads * rows * _SIMD * load_blocking * _BF16 + _ALIGN   # tr_diff_dst
        scratch += threads * rows * _SIMD * bcast_blocking * _BF16 + _ALIGN  # tr_src
    return Primitive("jit_bf16_1x1:avx512_core_bf16",
                     src=_blocked(c.mb, c.ic, c.in_spatial, _SIMD),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, _SIMD), dst=oc * ic * _BF16,
                     bias=bias, scratchpad=scratch)
