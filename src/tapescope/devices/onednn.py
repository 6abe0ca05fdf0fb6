"""Which oneDNN convolution kernel an fp32 CPU convolution runs, and the memory it needs beside
PyTorch's tensors: operands reordered into the kernel's layout, and its scratchpad.

oneDNN (3.x, as bundled with torch; src/cpu/cpu_convolution_list.cpp) tries its kernels in a
fixed order and takes the first whose `init_conf` accepts the problem. PyTorch's
aten/src/ATen/native/mkldnn/Conv.cpp lets the kernel choose its layouts for NCHW tensors (ideep's
`format_tag::any`) and fixes NHWC for channels-last ones; every operand not in the chosen layout
is reordered into a buffer the size of the operand in that layout (blocked layouts round the
channels up to the block: 8 floats on AVX2, 16 on AVX-512), and the scratchpad is allocated
through PyTorch's allocator (ideep's scratchpad mode "user").

What is modelled from the kernels' sources, and checked against the allocator on AVX2 machines
and on an AVX-512 one (an AMD EPYC; tests/test_kernel_workspace.py, which also caps that host at
AVX2 in a child process):
- NCHW: the blocked direct kernels (jit_avx2_convolution, jit_avx2_1x1_convolution,
  jit_avx2_dw_convolution; jit_avx512_common_convolution, _1x1_, _dw_) - their layouts, so the
  reorders, and the padded-bias scratchpad; 2-D and 3-D;
- AVX-512's direct weight gradient (jit_avx512_common_conv_bwd_weights_kernel_f32_t): its own
  applicability (kernels taller than the map, channels-last depthwise padded per group), its
  `balance` and the batch-split reduction buffers, the bias gradient's cpu_reducer and their
  page-aligned barriers; where it refuses, oneDNN goes on to the AVX2 kernels, which an AVX-512
  machine also runs;
- the GEMM fallback for weight gradients (gemm_convolution_bwd_weights_t, src/cpu/
  gemm_convolution_utils.cpp), taken where the direct kernels refuse: per-thread im2col columns
  of one depth slice and per-thread weight accumulators (`key_conv_wei_reduction`, booked as
  `nthr * weights_d.size()` floats - bytes counted as floats, so four times the weights per
  thread).
Everything else (brgemm kernels for channels-last tensors and for AVX2's first-layer
backward-data, the GEMM forward whose blocking follows the L2 size, the 1x1 weight gradient's
reduction buffers) is a heuristic: the reorders follow the layouts the kernel is known to pick,
the scratchpad is an estimate, and the choice carries `exact=False` so the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .cpu import CpuTarget
from .onednn_brgemm_bwd import runs_strided_backward_data, strided_backward_data
from .onednn_primitive import Primitive

__all__ = ["Conv", "Primitive", "forward", "backward_data", "backward_weights", "nested",
           "deconvolution_forward"]

_F32 = 4
# the ISAs whose kernel choices and buffers tests/test_kernel_workspace.py checked against the
# allocator (AVX2 hosts; an AMD EPYC with AVX-512); others are reported as estimates
_MEASURED = ("avx2", "avx512")
_ALIGN = 128  # memory_tracking.hpp: every scratchpad booking carries this much for alignment


def _rnd_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Conv:
    """One convolution as oneDNN sees it (per-group channels, output sizes computed)."""

    mb: int
    ic: int                 # all input channels
    oc: int                 # all output channels
    groups: int
    in_size: tuple          # spatial sizes
    out_size: tuple
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple         # PyTorch's (1 = none); oneDNN's is this minus 1
    channels_last: bool
    bias: bool
    itemsize: int = 4       # the operands' element size: 4 (fp32 kernels, here), 2 (bf16:
                            # devices/onednn_bf16.py)

    @property
    def ic_g(self) -> int:
        return self.ic // self.groups

    @property
    def oc_g(self) -> int:
        return self.oc // self.groups

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.ic_g == 1 and self.oc_g == 1

    @property
    def pointwise(self) -> bool:
        return all(k == 1 for k in self.kernel) and all(p == 0 for p in self.padding)

    @property
    def dilated(self) -> bool:
        return any(d != 1 for d in self.dilation)

    @property
    def ks(self) -> int:
        return prod(self.kernel)

    @property
    def in_spatial(self) -> int:
        return prod(self.in_size)

    @property
    def out_spatial(self) -> int:
        return prod(self.out_size)


def _blocked(n: int, channels: int, spatial: int, block: int) -> int:
    return n * _rnd_up(channels, block) * spatial * _F32


def _plain(n: int, channels: int, spatial: int) -> int:
    return n * channels * spatial * _F32


def _padded_bias(c: Conv, block: int) -> int:
    """`key_conv_padded_bias`: a bias whose channels do not fill the last block."""
    if c.bias and c.groups == 1 and c.oc % block:
        return _rnd_up(c.oc, block) * _F32 + _ALIGN
    return 0


def _flat(c: Conv, cpu: CpuTarget) -> bool:
    """First-layer convolutions read a plain source: jit_avx2_conv_fwd_kernel_f32 `flat =
    ic < simd_w`; jit_avx512_common_conv `is_1stconv` (ic < 16)."""
    return c.groups == 1 and c.ic < cpu.simd_floats


def _direct_weights(c: Conv, block: int, flat: bool) -> int:
    if c.depthwise:
        return _rnd_up(c.groups, block) * c.ks * _F32
    if c.groups > 1:
        return c.groups * c.oc_g * c.ic_g * c.ks * _F32
    ic = c.ic if flat else _rnd_up(c.ic, block)
    return _rnd_up(c.oc, block) * ic * c.ks * _F32


def _grouped_blocks_ok(c: Conv, block: int) -> bool:
    """Grouped (not depthwise) convolutions are not padded: each group must fill its blocks."""
    return c.groups == 1 or c.depthwise or (c.ic_g % block == 0 and c.oc_g % block == 0)


def forward(c: Conv, cpu: CpuTarget) -> Primitive:
    block, isa = cpu.simd_floats, cpu.isa
    if c.channels_last and c.depthwise:  # brdgmm_dw reads NHWC: only the weights reordered
        return Primitive(f"brdgmm_dw:{isa}", weights=_direct_weights(c, block, False),
                         scratchpad=_padded_bias(c, block), exact=isa in _MEASURED)
    if c.channels_last:  # brgemm_convolution_fwd_t<isa> on NHWC: weights into its OC blocks
        return Primitive(f"brg_conv_fwd:{isa}", weights=_rnd_up(c.oc_g, 3 * block) * c.groups
                         * c.ic_g * c.ks * _F32, scratchpad=_brgemm_scratch(c, cpu), exact=False)
    exact = isa in _MEASURED
    direct_ok = _avx512_direct_forward_ok(c) if isa == "avx512" else _direct_forward_ok(c)
    if not _grouped_blocks_ok(c, block) or not (c.pointwise or c.depthwise or direct_ok):
        return _gemm_forward(c, cpu)
    flat = _flat(c, cpu) and not c.pointwise
    kind = "dw" if c.depthwise else ("1x1" if c.pointwise else "direct")
    src = 0 if flat else _blocked(c.mb, c.ic, c.in_spatial, block)
    scratch = _padded_bias(c, block)
    if c.pointwise and any(s != 1 for s in c.stride):  # rtus: the strided source made dense
        scratch += cpu.threads * c.ic * c.out_spatial * _F32 + _ALIGN
    return Primitive(f"jit_{kind}:{isa}", src=src, weights=_direct_weights(c, block, flat),
                     dst=_blocked(c.mb, c.oc, c.out_spatial, block), scratchpad=scratch,
                     exact=exact)


def backward_data(c: Conv, cpu: CpuTarget) -> Primitive:
    block, isa = cpu.simd_floats, cpu.isa
    if c.channels_last and c.depthwise:  # jit_uni_dw reads NHWC: only the weights reordered
        return Primitive(f"jit_dw:{isa}", weights=_direct_weights(c, block, False),
                         exact=isa in _MEASURED)
    if c.channels_last:  # brgemm_convolution_bwd_t<isa>: weights into its IC blocks
        return Primitive(f"brg_conv_bwd:{isa}", weights=_rnd_up(c.ic_g, 3 * block) * c.groups
                         * c.oc_g * c.ks * _F32, scratchpad=_brgemm_scratch(c, cpu), exact=False)
    if runs_strided_backward_data(c):  # brgconv_strided, ahead of the jit kernels
        return strided_backward_data(c, cpu)
    if _flat(c, cpu) and not c.pointwise and isa != "avx512":
        # AVX2's direct kernel refuses a flat source; the brgemm kernels run in NHWC (AVX-512's
        # direct kernel pads the few channels to a block instead: is_1stconv is false there)
        return Primitive(f"brgconv_strided:{isa}", src=_plain(c.mb, c.oc, c.out_spatial),
                         weights=_rnd_up(c.ic, block) * c.oc * c.ks * _F32,
                         dst=_plain(c.mb, c.ic, c.in_spatial),
                         scratchpad=_brgemm_scratch(c, cpu), exact=False)
    if not _grouped_blocks_ok(c, block):
        return Primitive("gemm:jit", dst=_plain(c.mb, c.ic, c.in_spatial),
                         scratchpad=_gemm_columns(c, cpu, c.in_spatial), exact=False)
    kind = "dw" if c.depthwise else ("1x1" if c.pointwise else "direct")
    scratch = 0
    strided_1x1 = c.pointwise and any(s != 1 for s in c.stride)
    if strided_1x1:  # rtus: the strided diff_src gathered per thread (estimate)
        scratch = cpu.threads * c.ic * c.out_spatial * _F32 + _ALIGN
    return Primitive(f"jit_{kind}:{isa}", src=_blocked(c.mb, c.oc, c.out_spatial, block),
                     weights=_direct_weights(c, block, False),
                     dst=_blocked(c.mb, c.ic, c.in_spatial, block), scratchpad=scratch,
                     exact=isa in _MEASURED and not strided_1x1)


def _avx512_direct_forward_ok(c: Conv) -> bool:
    """jit_avx512_common_conv_fwd_kernel_t::init_conf refuses only a kernel that lies wholly in
    the padding (`kernel_outside_src`); it has none of the AVX2 kernel's width-unroll limits."""
    for k, d, p, i, o, s in zip(c.kernel, c.dilation, c.padding, c.in_size, c.out_size,
                                c.stride):
        ext = (k - 1) * d + 1
        end_pad = (o - 1) * s + ext - i - p
        if ext <= p or ext <= end_pad:
            return False
    return True


def _direct_forward_ok(c: Conv) -> bool:
    """jit_avx2_conv_fwd_kernel_f32::init_conf: the width unroll (ur_w = min(3, ow)) must cover
    the left padding (and, after the re-unroll, the right); a kernel wider than 7 needs stride 1
    or no padding; the dilated kernel must overlap the source."""
    kw, iw, ow, sw = c.kernel[-1], c.in_size[-1], c.out_size[-1], c.stride[-1]
    dw, l_pad = c.dilation[-1], c.padding[-1]
    ext_kw = (kw - 1) * dw + 1
    r_pad = max(0, (ow - 1) * sw + ext_kw - iw - l_pad)
    if any((k - 1) * d + 1 <= p for k, d, p in zip(c.kernel, c.dilation, c.padding)) \
            or ext_kw <= r_pad:
        return False
    ur_w = min(3, ow)
    if l_pad > ur_w or (kw > 7 and any(c.padding) and any(s != 1 for s in c.stride)):
        return False
    tail = ow % ur_w
    r_pad_no_tail = max(0, (ow - tail - 1) * sw + ext_kw - iw - l_pad)
    if r_pad_no_tail > ur_w * sw and ow // ur_w > 1:
        ur_w = min(r_pad_no_tail // sw + tail, min(ow, 15 // 2))
        tail = ow % ur_w
        r_pad_no_tail = max(0, (ow - tail - 1) * sw + ext_kw - iw - l_pad)
        return ur_w >= max(l_pad, r_pad_no_tail)
    return True


def _direct_backward_weights_ok(c: Conv) -> bool:
    """jit_avx2_conv_bwd_weights_kernel_f32::init_conf's params_ok and boundaries_ok (2-D, and
    3-D with no depth padding)."""
    if c.dilated or len(c.kernel) not in (2, 3):
        return False
    if len(c.kernel) == 3:
        kd, id_, od, sd, f_pad = c.kernel[0], c.in_size[0], c.out_size[0], c.stride[0], \
            c.padding[0]
        back_pad = max(0, (od - 1) * sd + kd - id_ - f_pad)
        if f_pad or back_pad or kd > id_:
            return False
    (kh, kw), (ih, iw), (oh, ow) = c.kernel[-2:], c.in_size[-2:], c.out_size[-2:]
    (sh, sw), (t_pad, l_pad) = c.stride[-2:], c.padding[-2:]
    b_pad = max(0, (oh - 1) * sh + kh - ih - t_pad)
    r_pad = max(0, (ow - 1) * sw + kw - iw - l_pad)
    return (kw < 14 and kh <= t_pad + ih and kh <= ih and t_pad < kh
            and t_pad < kh and b_pad < kh and l_pad < kw and r_pad < kw)


def _dw_backward_weights_ok(c: Conv) -> bool:
    """jit_uni_dw_conv_bwd_weights_kernel_t::init_conf: kw <= 3, no dilation, stride_w <= kw,
    padding at most half the kernel (a non-unit one a multiple of the stride)."""
    if c.dilated or len(c.kernel) != 2:
        return False
    (kh, kw), (ih, iw), (oh, ow) = c.kernel, c.in_size, c.out_size
    (sh, sw), (t_pad, l_pad) = c.stride, c.padding
    b_pad = max(0, (oh - 1) * sh + kh - ih - t_pad)
    r_pad = max(0, (ow - 1) * sw + kw - iw - l_pad)
    max_hpad, max_wpad = kh // 2, kw // 2
    return (kw <= 3 and sw <= kw and t_pad <= max_hpad and b_pad <= max_hpad
            and l_pad <= max_wpad and r_pad <= max_wpad and ih >= kh + (-t_pad) % sh
            and (t_pad <= 1 or t_pad % sh == 0) and (b_pad <= 1 or b_pad % sh == 0))


def backward_weights(c: Conv, cpu: CpuTarget) -> Primitive:
    block, isa = cpu.simd_floats, cpu.isa
    bias = c.oc * _F32 if c.bias else 0
    if c.depthwise and _dw_backward_weights_ok(c):
        return _dw_backward_weights(c, cpu, bias)
    if c.pointwise and c.groups == 1:
        # the 1x1 kernel reduces per-thread partial gradients in buffers cpu_reducer's balancer
        # sizes from its blocking (not modelled; measured 0 to 2x the weights): not counted
        src = 0 if c.channels_last else _blocked(c.mb, c.ic, c.in_spatial, block)
        diff_dst = 0 if c.channels_last else _blocked(c.mb, c.oc, c.out_spatial, block)
        rtus = 0
        if any(s != 1 for s in c.stride):
            rtus = cpu.threads * c.ic * c.out_spatial * _F32 + _ALIGN
        if isa in ("avx512", "avx2") and not rtus:
            scratch = (_avx512_1x1_bwd_weights_scratch(c, cpu) if isa == "avx512"
                       else _avx2_1x1_bwd_weights_scratch(c, cpu))
            return Primitive(f"jit_1x1:{isa}", src=src, diff_dst=diff_dst,
                             dst=_direct_weights(c, block, False), bias=bias, scratchpad=scratch)
        return Primitive(f"jit_1x1:{isa}", src=src, diff_dst=diff_dst,
                         dst=_direct_weights(c, block, False), bias=bias,
                         scratchpad=_padded_bias(c, block) + rtus, exact=False)
    gemm_cpu = cpu
    if isa == "avx512" and not (c.pointwise and c.groups == 1):
        direct = _avx512_backward_weights(c, cpu, bias)
        if direct is not None:
            return direct
        # jit_avx512_common refuses: oneDNN's list goes on to the AVX2 kernels, which an
        # AVX-512 machine also runs, with their 8-float blocks
        block, isa = 8, "avx2"
        cpu = CpuTarget("avx2", cpu.threads, cpu.detected)
    if not _direct_backward_weights_ok(c):
        return _gemm_backward_weights(c, gemm_cpu, bias)
    if c.channels_last:
        # the direct kernel reads NHWC and pads every group's channels to its blocks
        weights = c.groups * _rnd_up(c.oc_g, block) * _rnd_up(c.ic_g, block) * c.ks * _F32
        scratch = _avx2_bwd_weights_reducers(c, cpu)
        if c.bias and c.oc_g % block:
            scratch += c.groups * _rnd_up(c.oc_g, block) * _F32 + _ALIGN
        return Primitive(f"jit:{isa}", dst=weights, bias=bias, scratchpad=scratch,
                         exact=isa == "avx2")
    if c.groups > 1 and (c.ic_g % block or c.oc_g % block):
        return _gemm_backward_weights(c, gemm_cpu, bias)  # NCHW groups are not padded to blocks
    # jit_avx2_conv_bwd_weights_kernel_f32::init_conf: `flat = ic == 3`; other few-channel
    # sources are padded to a block and reordered (unlike the forward's `ic < simd_w`)
    flat = c.groups == 1 and c.ic == 3
    return Primitive(f"jit:{isa}", src=0 if flat else _blocked(c.mb, c.ic, c.in_spatial, block),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, block),
                     dst=_direct_weights(c, block, flat), bias=bias,
                     scratchpad=_padded_bias(c, block) + _avx2_bwd_weights_reducers(c, cpu),
                     exact=isa == "avx2")


def _avx2_bwd_weights_reducers(c: Conv, cpu: CpuTarget) -> int:
    """jit_avx2_convolution_bwd_weights_t::pd_t::init_balancers: the weights' and the bias's
    cpu_reducer_t over the batch (jit_avx2_convolution.hpp). A reducer books space only where
    its balancer puts several threads on one job: few channel blocks (a 1-D convolution of 8
    channels: one job) and more threads than jobs."""
    od = c.out_size[0] if len(c.out_size) == 3 else 1
    ic_block = c.ic_g if c.ic_g == 3 else 8           # init_conf: flat = (ic == 3)
    nb_ic, nb_oc = -(-c.ic_g // ic_block), -(-c.oc_g // 8)
    scratch = _cpu_reducer_scratch(cpu.threads, c.ks * ic_block * 8, c.groups * nb_ic * nb_oc,
                                   c.mb * od, 1 << 21)
    if c.bias:
        scratch += _cpu_reducer_scratch(cpu.threads, 8, c.groups * nb_oc, c.mb, 1 << 21)
    return scratch


def _dw_backward_weights(c: Conv, cpu: CpuTarget, bias: int) -> Primitive:
    """jit_uni_dw_convolution_bwd_weights_t: partial gradients of threads that split the batch
    are reduced in a scratchpad (jit_uni_dw_conv_kernel_utils.cpp, balance / init_scratchpad)."""
    block = cpu.simd_floats
    weights = _direct_weights(c, block, False)
    if c.channels_last:  # harness_nxc: partition_nthr_nxc (not modelled): all threads assumed
        extra = cpu.threads - 1
        scratch = 0
        if extra:
            scratch = _rnd_up(c.groups, block) * c.ks * extra * _F32 + _ALIGN
            scratch += c.groups * extra * _F32 + _ALIGN if c.bias else 0
        return Primitive(f"jit_dw:{cpu.isa}", dst=weights, bias=bias, scratchpad=scratch,
                         exact=False)
    nthr_g = min(-(-c.groups // block), cpu.threads)          # harness_mb_reduction
    nthr_mb = min(max(1, cpu.threads // nthr_g), c.mb)
    scratch = 0
    if nthr_mb > 1:
        scratch = c.groups * c.ks * (nthr_mb - 1) * _F32 + _ALIGN
        scratch += c.groups * (nthr_mb - 1) * _F32 + _ALIGN if c.bias else 0
    return Primitive(f"jit_dw:{cpu.isa}", src=_blocked(c.mb, c.ic, c.in_spatial, block),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, block), dst=weights,
                     bias=bias, scratchpad=scratch, exact=cpu.isa in _MEASURED)


def _gemm_backward_weights(c: Conv, cpu: CpuTarget, bias: int) -> Primitive:
    """gemm_convolution_bwd_weights_t on plain layouts (gemm_convolution_utils.cpp, init_conf,
    the `!jcp.is_nspc && is_bwd_w` branch). Its `os` and `is` are one depth slice (oh * ow,
    ih * iw): a 3-D convolution's columns are made slice by slice."""
    weights = c.oc * c.ic_g * c.ks * _F32          # weights_d.size(), in bytes
    src, dst = _plain(c.mb, c.ic, c.in_spatial), _plain(c.mb, c.oc, c.out_spatial)
    os = prod(c.out_size[-2:])
    # 1 GiB, or 15 x threads x the operands: above it the columns are cut to an os block
    limit = min(1 << 30, 15 * cpu.threads * (src + weights + dst))
    estimate = _F32 * cpu.threads * weights + _F32 * cpu.threads * c.ic_g * c.ks * cpu.simd_floats
    outer = (estimate < limit and os // cpu.threads < 256
             and (c.mb != 1 or c.groups > 2))
    nthr = cpu.threads if outer else 1
    reduction = nthr * weights * _F32 + _ALIGN  # book<float>(nthr * weights_d.size())
    unit = (c.in_size == c.out_size and all(s == 1 for s in c.stride) and c.ks == 1)
    os_block = os
    col = 0 if unit else c.ic_g * c.ks * os_block
    if col and limit - reduction < nthr * col * _F32:  # cut the columns to fit
        max_os_block = (limit - reduction) // (_F32 * nthr * (col // os))
        os_block = max(cpu.simd_floats, int(max_os_block * 0.05))
        col = c.ic_g * c.ks * os_block
    columns = nthr * col * _F32 + _ALIGN if col else 0
    return Primitive("gemm:jit", dst=weights, bias=bias, scratchpad=reduction + columns,
                     exact=not c.channels_last and cpu.isa in _MEASURED)


def _gemm_columns(c: Conv, cpu: CpuTarget, spatial: int) -> int:
    """An estimate of the GEMM kernels' per-thread im2col columns."""
    return cpu.threads * c.ic_g * c.ks * c.out_spatial * _F32 + _ALIGN


def _gemm_forward(c: Conv, cpu: CpuTarget) -> Primitive:
    """gemm_convolution_fwd_t: its os/oc/ic blocking and threading follow the L2 size (not
    modelled): estimated as one thread's columns of all output positions."""
    unit = c.in_size == c.out_size and all(s == 1 for s in c.stride) and c.ks == 1
    columns = 0 if unit else c.ic_g * c.ks * c.out_spatial * _F32 + _ALIGN
    return Primitive("gemm:jit", dst=_plain(c.mb, c.oc, c.out_spatial), scratchpad=columns,
                     exact=False)


def _brgemm_scratch(c: Conv, cpu: CpuTarget) -> int:
    """An estimate of a brgemm convolution's scratchpad (its per-thread accumulators and
    padded-source buffers): one output row block of accumulators per thread."""
    return cpu.threads * _rnd_up(max(c.oc_g, c.ic_g), cpu.simd_floats) * max(c.out_size[-1], 1) \
        * _F32 + _ALIGN


# jit_avx512_common_conv_bwd_weights_kernel_f32_t (src/cpu/x64/jit_avx512_common_conv_kernel.cpp)
_AVX512_MAX_UR_W = 28       # its max_ur_w
_AVX512_MIN_OH_REDUCE = 9   # its min_oh_reduce


def _avx512_backward_weights(c: Conv, cpu: CpuTarget, bias: int) -> Primitive | None:
    """jit_avx512_common_convolution_bwd_weights_t, or None where its init_conf refuses.

    Unlike the AVX2 kernel it takes kernels taller than the map (a 3x3 on a 2x2 map, a 9x9
    depthwise on 2x2 channels-last) as long as the padding is at most half the kernel; it pads
    channels to 16 (NCHW; per group on NHWC) and reduces the threads' partial weight gradients
    in `key_conv_wei_bia_reduction` when `balance` splits the batch (init_scratchpad).
    3-D convolutions (harness_3d_reduction) follow the same code."""
    if len(c.kernel) not in (2, 3):
        return None
    three_d = len(c.kernel) == 3
    pad3 = (1,) * (3 - len(c.kernel))                       # a 2-D problem has depth 1
    (kd, kh, kw), (id_, ih, iw), (od, oh, ow) = (pad3 + c.kernel, pad3 + c.in_size,
                                                 pad3 + c.out_size)
    (sh, sw), (t_pad, l_pad) = c.stride[-2:], c.padding[-2:]
    dh, dw = c.dilation[-2] - 1, c.dilation[-1] - 1        # oneDNN's dilation: 0 = none
    ext_kh, ext_kw = (kh - 1) * (dh + 1) + 1, (kw - 1) * (dw + 1) + 1
    if (dh and sh != 1) or (dh and ext_kh > ih):
        return None
    if three_d:  # no depth dilation; the depth padding inside the kernel
        sd, f_pad = c.stride[0], c.padding[0]
        back_pad = max(0, (od - 1) * sd + kd - id_ - f_pad)
        if c.dilation[0] != 1 or f_pad >= kd or back_pad >= kd or (f_pad and kd >= id_ + f_pad):
            return None
    r_pad = max(0, (ow - 1) * sw + ext_kw - iw - l_pad)
    b_pad = max(0, (oh - 1) * sh + ext_kh - ih - t_pad)
    nxc = c.channels_last
    first = c.groups == 1 and c.ic < 16                     # is_1stconv on avx512_core
    hw_transp = (not three_d and not nxc and 14 <= kw < 20 and ow == 1 and kw == iw and sh == sw == 1
                 and not dh and not dw and not any((t_pad, l_pad, r_pad, b_pad)))
    if not (l_pad < ext_kw and r_pad < ext_kw and t_pad <= ext_kh // 2 and b_pad <= ext_kh // 2
            and l_pad <= _AVX512_MAX_UR_W and r_pad <= _AVX512_MAX_UR_W):
        return None
    if kw > 14 and not hw_transp:
        return None
    if first and not nxc and c.ic not in (1, 2, 3):
        return None
    pad = not nxc and c.groups == 1                         # ok_to_pad_channels
    if not nxc and not pad and (c.ic_g % 16 or c.oc_g % 16):
        return None
    oc = _rnd_up(c.oc_g, 16) if pad else c.oc_g
    ic = c.ic_g if first else (_rnd_up(c.ic_g, 16) if pad else c.ic_g)
    nthr_mb, nthr = _avx512_bwd_weights_threads(c, cpu.threads, oc, ic, (id_, ih, iw),
                                                (od, oh, ow), nxc, hw_transp, dh)
    scratch = 0
    if nthr_mb > 1:
        weights_and_bias = c.groups * _rnd_up(oc, 16) * (ic if first else _rnd_up(ic, 16)) \
            * c.ks + c.groups * _rnd_up(oc, 16)
        scratch += weights_and_bias * (nthr_mb - 1) * _F32 + _ALIGN
        scratch += _barriers(1)                             # key_conv_wei_bia_reduction_bctx
    if c.bias and c.oc_g % 16:
        scratch += c.groups * _rnd_up(oc, 16) * _F32 + _ALIGN  # key_conv_padded_bias
    if c.bias:  # init_balancers: the bias gradient's cpu_reducer_t (prefix_reducer_bia)
        scratch += _cpu_reducer_scratch(nthr, 16, c.groups * -(-oc // 16), c.mb,
                                        nthr * 3 * 5 * 5 * 16 * 16)
    if nxc:
        weights = c.groups * _rnd_up(c.oc_g, 16) * _rnd_up(c.ic_g, 16) * c.ks * _F32
        return Primitive("jit:avx512", dst=weights, bias=bias, scratchpad=scratch)
    return Primitive("jit:avx512", src=0 if first else _blocked(c.mb, c.ic, c.in_spatial, 16),
                     diff_dst=_blocked(c.mb, c.oc, c.out_spatial, 16),
                     dst=_direct_weights(c, 16, first), bias=bias, scratchpad=scratch)


_PAGE = 4096


def _barriers(n: int) -> int:
    """`book<simple_barrier::ctx_t>(key, n)`: the barrier context is 4096-aligned on Linux
    (cpu_barrier.hpp CTX_ALIGNMENT), so sizeof is a page and the booking's alignment a page too
    (memory_tracking.hpp: capacity = size + max(alignof(T), 128))."""
    return n * _PAGE + _PAGE


def _reduce_balance(nthr: int, job_size: int, njobs: int, reduction_size: int,
                    max_buffer_size: int) -> tuple[int, int, int]:
    """reduce_balancer_t::balance (src/cpu/x64/cpu_reducer.cpp), lock-free: (groups, threads
    per group, jobs per group at most)."""
    min_per_group = max(1, njobs // nthr)
    max_per_group = max(1, max_buffer_size // (nthr * job_size))
    ngroups = min(njobs // min_per_group, nthr)
    nthr_per_group = min(nthr // ngroups, reduction_size)   # lock-free: threads may share a group
    per_group_ub = -(-njobs // ngroups)
    best = njobs * job_size * reduction_size
    for c_per_group in range(min_per_group, njobs):
        c_ngroups = min(njobs // c_per_group, nthr)
        c_nthr = min(nthr // c_ngroups, reduction_size)
        c_ub = -(-njobs // c_ngroups)
        if c_nthr > 1 and c_ub > max_per_group:
            continue
        cost = job_size * c_ub * (-(-reduction_size // c_nthr) + (c_nthr != 1))
        if cost < best:
            ngroups, nthr_per_group, per_group_ub, best = c_ngroups, c_nthr, c_ub, cost
    return ngroups, nthr_per_group, per_group_ub


def _cpu_reducer_scratch(nthr: int, job_size: int, njobs: int, reduction_size: int,
                         max_buffer_size: int) -> int:
    """cpu_reducer_t's scratchpad (src/cpu/x64/cpu_reducer.cpp): with more than one thread per
    group, the space of all but the groups' masters, page-aligned, and a barrier per group."""
    ngroups, nthr_per_group, per_group_ub = _reduce_balance(nthr, job_size, njobs,
                                                            reduction_size, max_buffer_size)
    if nthr_per_group == 1:
        return 0
    space = ngroups * (nthr_per_group - 1) * per_group_ub * job_size * _F32
    return space + _PAGE + _barriers(ngroups)               # book<float>(..., PAGE_4K)


def _cpu_reducer_2d_scratch(nthr: int, job_size: int, njobs: int, reduction_size: int,
                            max_buffer_size: int) -> int:
    """cpu_reducer_2d_t's scratchpad: every thread of a group books its space (the master too),
    with the default alignment, and a barrier per group."""
    ngroups, nthr_per_group, per_group_ub = _reduce_balance(nthr, job_size, njobs,
                                                            reduction_size, max_buffer_size)
    if nthr_per_group == 1:
        return 0
    return (ngroups * nthr_per_group * per_group_ub * job_size * _F32 + _ALIGN
            + _barriers(ngroups))


def _shrink_blocking(blocks: int, limit: int) -> int:
    """jit_avx2_1x1_conv_kernel_f32::init_conf: halve or third the blocking down to `limit`."""
    while blocks > limit:
        if blocks % 2 == 0:
            blocks //= 2
        elif blocks % 3 == 0:
            blocks //= 3
        else:
            break
    return blocks


def _avx2_1x1_bwd_weights_scratch(c: Conv, cpu: CpuTarget) -> int:
    """jit_avx2_1x1_convolution_bwd_weights_t at unit strides: init_conf's load and bcast
    blockings, then init_balancers' 2-D weights reducer over batch x output positions and the
    bias reducer (jit_avx2_1x1_convolution.hpp), and a padded bias."""
    nxc = c.channels_last
    pad = not nxc and c.groups == 1
    oc = _rnd_up(c.oc_g, 8) if pad else c.oc_g
    ic = _rnd_up(c.ic_g, 8) if pad else c.ic_g
    nb_load, nb_bcast = -(-oc // 8), -(-ic // 8)
    load_blocking = _shrink_blocking(nb_load, 32) if (not nxc or oc % 8 == 0) else nb_load
    bcast_blocking = nb_bcast
    if not nxc or (ic % 8 == 0 and c.in_spatial <= 1024):
        bcast_blocking = _shrink_blocking(nb_bcast, 17 if nxc else 9)
    job_size = load_blocking * bcast_blocking * 8 * 8
    njobs = c.groups * -(-nb_load // load_blocking) * -(-nb_bcast // bcast_blocking)
    max_buffer = cpu.threads * job_size * 8
    scratch = _cpu_reducer_2d_scratch(cpu.threads, job_size, njobs, c.mb * c.out_spatial,
                                      max_buffer)
    if c.bias:
        scratch += _cpu_reducer_scratch(cpu.threads, 8, c.groups * nb_load, c.mb, max_buffer)
        if oc != c.oc_g or (nxc and oc % 8):
            scratch += c.groups * _rnd_up(oc, 8) * _F32 + _ALIGN   # key_conv_padded_bias
    return scratch


def _avx512_bwd_weights_threads(c: Conv, nthreads: int, oc: int, ic: int, in_dhw: tuple,
                                out_dhw: tuple, nxc: bool, hw_transp: bool,
                                dh: int) -> tuple[int, int]:
    """(threads that split the batch, threads in all): jit_avx512_common_conv_bwd_weights_
    kernel_f32_t::balance (its two cost searches, followed line by line)."""
    if nthreads < c.groups:
        return 1, nthreads
    nthr = nthreads // c.groups
    (id_, ih, iw), (od, oh, ow) = in_dhw, out_dhw
    three_d = len(c.kernel) == 3
    two_d = (not three_d and not dh and oh > _AVX512_MIN_OH_REDUCE and not hw_transp
             and not nxc)
    if hw_transp:
        ih, oh, iw, ow = iw, ow, ih, oh                     # tr_ih, ow-as-oh, tr_iw, oh-as-ow
    ih_r, oh_r = (ih, oh) if two_d else (1, 1)
    ih_n, oh_n = (1, 1) if two_d else (ih, oh)
    nthr_oh_reduce = max(1, oh_r // _AVX512_MIN_OH_REDUCE)
    nb_oc, nb_ic = -(-oc // 16), -(-ic // 16)
    ic_block = ic if (c.groups == 1 and c.ic < 16) else 16
    g = 1                                                   # div_up(ngroups, nthr_g = ngroups)
    sd = c.stride[0] if three_d else 1
    sh, sw = c.stride[-2:]

    def mem(mb, ocb, icb):
        return (-(-c.mb * ih_r // mb) * g * -(-nb_ic // icb) * ic_block * ih_n * iw * id_
                // sd // sh // sw
                + -(-c.mb * oh_r // mb) * g * -(-nb_oc // ocb) * 16 * oh_n * ow * od
                + 8 * g * -(-nb_oc // ocb) * -(-nb_ic // icb) * c.ks * ic_block * 16)

    def comp(mb, ocb, icb):
        return -(-c.mb * oh_r // mb) * g * -(-nb_oc // ocb) * -(-nb_ic // icb)

    best = (1, 1, 1)
    best_mem = mem(*best)
    mb_max = min(nthr, c.mb * od * nthr_oh_reduce)
    for mb in range(1, mb_max + 1):
        par = nthr // mb
        for ocb in range(1, min(par, nb_oc) + 1):
            icb = min(par // ocb, nb_ic)
            cost = mem(mb, ocb, icb)
            if cost <= best_mem:
                best_mem, best = cost, (mb, ocb, icb)
    best_comp = comp(*best)
    for mb in range(1, mb_max + 1):
        par = nthr // mb
        for ocb in range(1, min(par, nb_oc) + 1):
            icb = min(par // ocb, nb_ic)
            cost, work = mem(mb, ocb, icb), comp(mb, ocb, icb)
            if (work <= best_comp and (hw_transp or cost < 1.1 * best_mem)) \
                    or 4 * work <= 3 * best_comp:
                best_comp, best = work, (mb, ocb, icb)
    nthr_mb = best[0]
    if nthreads // 2 < nthr_mb < nthreads:
        nthr_mb = min(c.mb * od * nthr_oh_reduce, nthreads)
    return nthr_mb, nthr_mb * c.groups * best[1] * best[2]


def nested(prim: Primitive) -> Primitive:
    """A primitive run inside another one's scratchpad (ref_deconvolution's convolution):
    `book(key_nested, conv_pd->scratchpad_registry())` adds one booking's alignment
    (memory_tracking.hpp), where the inner scratchpad is not empty."""
    from dataclasses import replace

    return replace(prim, scratchpad=prim.scratchpad + _ALIGN if prim.scratchpad else 0)


def deconvolution_forward(c: Conv, cpu: CpuTarget, bias: bool) -> Primitive:
    """oneDNN's deconvolution forward, `c` being the convolution with the roles swapped (from
    the deconvolution's output to its input).

    Unit strides: ref_deconvolution_fwd_t runs that convolution's backward-data primitive
    (nested) and, with a bias the convolution cannot add, an f32 copy of the padded output
    (`key_deconv_bias`, ref_deconvolution.hpp init_scratchpad). Other strides: that convolution's
    brgconv_strided on NHWC copies (devices/onednn_brgemm_bwd.py), nested: jit_brgemm_deconv runs
    it inverted where the strides divide the map, adding the bias in the kernel; where they do
    not (the inverted kernel refuses uneven maps) ref_deconvolution runs it with the bias's f32
    output copy, as at unit strides."""
    block = cpu.simd_floats
    strided = runs_strided_backward_data(c)
    if (all(s == 1 for s in c.stride) or strided) and not c.channels_last:
        d = nested(backward_data(c, cpu))
        uneven = any(i % s for i, s in zip(c.in_size, c.stride))
        if strided and not uneven:
            return Primitive(f"brg_deconv:{cpu.isa}+{d.impl}", src=d.src, weights=d.weights,
                             dst=d.dst, scratchpad=d.scratchpad, exact=d.exact)
        if bias:
            d = Primitive(d.impl, src=d.src, weights=d.weights, dst=d.dst,
                          scratchpad=d.scratchpad + max(d.dst, _plain(c.mb, c.ic, c.in_spatial))
                          + _ALIGN, exact=d.exact)
        return d
    weights = _rnd_up(c.ic_g, block) * c.groups * c.oc_g * c.ks * _F32
    return Primitive(f"brg_deconv:{cpu.isa}",
                     src=0 if c.channels_last else _plain(c.mb, c.oc, c.out_spatial),
                     weights=weights,
                     dst=0 if c.channels_last else _plain(c.mb, c.ic, c.in_spatial),
                     scratchpad=_brgemm_scratch(c, cpu), exact=False)


def _best_divider(value: int, min_divider: int, max_divider: int, find_max: bool) -> int:
    """jit_uni_1x1_conv_utils.hpp best_divider: the divider that pads `value` least."""
    max_divider = max(1, min(max_divider, value))
    min_divider = max(1, min(min_divider, max_divider))
    best, chosen = float("inf"), max_divider
    for divider in range(max_divider, min_divider - 1, -1):
        padded = _rnd_up(value, divider)
        loss = (padded - value) / padded
        if (find_max and loss < best) or (not find_max and loss <= best):
            best, chosen = loss, divider
    return chosen


def _avx512_1x1_bwd_weights_scratch(c: Conv, cpu: CpuTarget) -> int:
    """jit_avx512_common_1x1_convolution_bwd_weights_t at unit strides: init_conf's reduce
    blocking, `balance` (its memory-cost search over batch, output and input channel splits),
    init_scratchpad (the batch-split weight reduction, its barrier, a padded bias) and the bias
    gradient's cpu_reducer (jit_avx512_common_1x1_conv_kernel.cpp, ..._1x1_convolution.hpp)."""
    nxc = c.channels_last
    pad = not nxc and c.groups == 1                         # ok_to_pad_channels
    oc = _rnd_up(c.oc_g, 16) if pad else c.oc_g
    ic = _rnd_up(c.ic_g, 16) if pad else c.ic_g
    spatial, iw = c.in_spatial, c.in_size[-1]
    reduce_block = _best_divider(spatial, 7, 16, True)
    if spatial % reduce_block:
        reduce_block = _best_divider(iw, 4, iw, False)
    if reduce_block > 256:
        reduce_block = 1
    nb_bcast, nb_load, nb_reduce = -(-ic // 16), -(-oc // 16), -(-spatial // reduce_block)
    nthr_mb = nthr_oc_b = nthr_ic_b = 1
    if cpu.threads >= c.groups:
        nthr = cpu.threads // c.groups

        def cost(mb, ocb, icb):
            return (-(-c.mb * nb_reduce // mb) * -(-nb_bcast // icb) * 16 * reduce_block
                    + -(-c.mb * nb_reduce // mb) * -(-nb_load // ocb) * 16 * reduce_block
                    + 12 * -(-nb_load // ocb) * -(-nb_bcast // icb) * 16 * 16)
        best = cost(1, 1, 1)
        for mb in range(1, min(nthr, c.mb * nb_reduce) + 1):
            par = nthr // mb
            for ocb in range(1, min(par, nb_load) + 1):
                icb = min(par // ocb, nb_bcast)
                if cost(mb, ocb, icb) <= best:
                    best, nthr_mb, nthr_oc_b, nthr_ic_b = cost(mb, ocb, icb), mb, ocb, icb
        if cpu.threads // 2 < nthr_mb < cpu.threads:
            nthr_mb = min(c.mb, cpu.threads)
    threads = nthr_mb * c.groups * nthr_oc_b * nthr_ic_b
    scratch = 0
    if c.bias and (oc != c.oc_g or (nxc and oc % 16)):
        scratch += c.groups * _rnd_up(oc, 16) * _F32 + _ALIGN   # key_conv_padded_bias
    if nthr_mb > 1:
        scratch += c.groups * _rnd_up(oc, 16) * _rnd_up(ic, 16) * (nthr_mb - 1) * _F32 + _ALIGN
        scratch += _barriers(1)
    if c.bias:
        scratch += _cpu_reducer_scratch(threads, 16, c.groups * nb_load, c.mb,
                                        threads * 3 * 5 * 5 * 16 * 16)
    return scratch
