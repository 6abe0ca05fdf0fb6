"""oneDNN's strided backward-data convolution, `brgconv_strided` (brgemm_convolution_bwd_strided_t),
for NCHW problems on AVX2 and AVX-512, fp32 and bf16.

In oneDNN's list (cpu_convolution_list.cpp, v3.12 as bundled with torch 2.14) this kernel comes
before the direct jit kernels and takes every strided, undilated problem it can block; ideep
leaves the data formats to oneDNN, which picks channels-last (`acdb`): PyTorch's NCHW diff_dst is
reordered into an NHWC copy, the weights into `Bcda<ic_block>b` (bf16: `BcdA<ic_block>b2a`),
the kernel writes an NHWC diff_src that is copied into PyTorch's grad_input through one more
buffer (a `jit_direct_copy` reorder). Its scratchpad (jit_brgemm_conv_bwd_utils.cpp init_jcp,
init_conf, init_scratchpad; every booking page-aligned, +4096 bytes) per thread:
- the brgemm batch, rounded up to a page (`adjusted_batch_size`: 103 elements of 40 bytes for a
  kernel of at most 102 taps),
- the diff_dst with the kernel's overflow rows and columns (`inp_buffer`: odp x ohp x owp x
  oc_block, rounded to 4096 elements), and its block mask (a page for maps of at most 4096
  blocks),
- for a width the stride does not divide (`exec_trans`), one output row block (iw_block x
  stride x ic, rounded to 4096 elements),
- for a bf16 diff_src, f32 accumulators ic_block x the row block (`use_buffer`).
The ic block (16 to 64 channels, 8 to 32 on AVX2) and the row block come from brg_blocking_t's
efficiency estimate, which reads the core's L1/L2 sizes: where a size depends on that choice
(padded channels that differ between blocks, the bf16 accumulators, a wide uneven row) the
result says `exact=False`; the fp32 sizes are otherwise independent of it. Checked against the
allocator on both ISAs in tests/test_kernel_workspace.py (`STRIDED_BACKWARD`).
"""

from __future__ import annotations

from math import prod

from .cpu import CpuTarget
from .onednn_primitive import Primitive

__all__ = ["runs_strided_backward_data", "strided_backward_data"]

_PAGE = 4096                 # P4K: the alignment of every booking here, and of its sizes
_BATCH_ELEMENT = 40          # sizeof(brgemm_batch_element_t)
_MAX_IC_BLOCKS = 4           # try_exec_type: ic_block = icb x simd for icb <= 4
_F32 = 4


def _rnd_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _div_up(x: int, m: int) -> int:
    return -(-x // m)


def runs_strided_backward_data(c) -> bool:
    """brgemm_convolution_bwd_strided_t takes this NCHW problem (init_jcp: not unit strides, no
    dilation; one group here - grouped problems pick other weight layouts, not modelled)."""
    return (any(s != 1 for s in c.stride) and not c.dilated and c.groups == 1
            and not c.channels_last)


def _ic_blocks(c, simd: int, wei_size: int, big_spatial: bool) -> list[int]:
    """try_exec_type's ic blocks (icb x simd for icb <= 4) that fast_check_ic_block admits: 64
    and 48 only where they divide the channels rounded to a vector, for few channels (48: a big
    map)."""
    rnd_ic = _rnd_up(c.ic, simd)
    out = []
    for block in (b * simd for b in range(min(_div_up(c.ic, simd), _MAX_IC_BLOCKS), 0, -1)):
        if block == 64 and not (rnd_ic % 64 == 0 and rnd_ic * wei_size < 192 * 4):
            continue
        if block == 48 and not (rnd_ic % 48 == 0 and rnd_ic * wei_size <= 384 * 4
                                and big_spatial):
            continue
        out.append(block)
    return out


def _ovf(ext: int, pad_front: int, pad_end: int, stride: int) -> tuple[int, int]:
    return max(0, ext - 1 - pad_front) // stride, max(0, ext - 1 - pad_end) // stride


def strided_backward_data(c, cpu: CpuTarget):
    """The primitive's reorders and scratchpad (an onednn.Primitive; `dst` is the NHWC diff_src,
    which is copied into grad_input through a buffer of the same size)."""
    itemsize, isa = c.itemsize, cpu.isa
    bf16 = itemsize == 2
    simd = 16 if isa == "avx512" else 8                # acc_simd_w: f32 lanes
    vnni = 2 if bf16 else 1
    nthr = cpu.threads
    dims = len(c.kernel)
    pad3 = lambda t, one: (one,) * (3 - dims) + tuple(t)   # noqa: E731 - (d, h, w)
    (kd, kh, kw), (sd, sh, sw) = pad3(c.kernel, 1), pad3(c.stride, 1)
    (pd, ph, pw) = pad3(c.padding, 0)
    (id_, ih, iw), (od, oh, ow) = pad3(c.in_size, 1), pad3(c.out_size, 1)
    ovf = [_ovf(k, p, (o - 1) * s + k - i - p, s)
           for k, p, i, o, s in ((kd, pd, id_, od, sd), (kh, ph, ih, oh, sh), (kw, pw, iw, ow, sw))]
    odp, ohp, owp = (o + a + b for o, (a, b) in zip((od, oh, ow), ovf))
    uneven = iw % sw != 0                               # has_uneven_iw: exec_trans
    oc_block = _rnd_up(c.oc, vnni) if uneven else c.oc  # select_oc_block: one block
    candidates = _ic_blocks(c, simd, itemsize, od * oh * ow > 81 * sd * sh * sw)
    # the search weighs padding against other costs; it picked the least padding, then the
    # widest block, in every case measured, and the weights' size depends on it only where the
    # candidates pad the channels differently
    ic_block = min(candidates, key=lambda b: (_rnd_up(c.ic, b), -b))
    exact = (len({_rnd_up(c.ic, b) for b in candidates}) == 1 and c.ks <= 102
             and id_ * ih * iw <= _PAGE)
    scratch = nthr * _div_up(_PAGE, _BATCH_ELEMENT) * _BATCH_ELEMENT + _PAGE
    scratch += nthr * _rnd_up(odp * ohp * owp * oc_block, _PAGE) * itemsize + _PAGE
    scratch += nthr * _PAGE + _PAGE                     # the block mask, one byte a block
    sp = _rnd_up(iw, sw) if uneven else iw              # the widest row block
    if uneven:
        scratch += nthr * _rnd_up(sp * sw * c.ic, _PAGE) * itemsize + _PAGE
        exact = exact and sp * sw * c.ic <= _PAGE
    if c.pointwise:  # a 1x1 problem blocks by fast_check_ic_block_1x1 (not followed here)
        exact = False
    if bf16:  # f32 accumulators of one row block: its size is the blocking search's choice
        scratch += nthr * ic_block * _div_up(sp, sw) * _F32 + _PAGE
        exact = False
    return Primitive(f"brgconv_strided:{isa}{'_core_bf16' if bf16 and isa == 'avx512' else ''}",
                     src=c.mb * c.oc * c.out_spatial * itemsize,
                     weights=_rnd_up(c.oc, vnni) * _rnd_up(c.ic, ic_block) * c.ks * itemsize,
                     dst=c.mb * c.ic * prod(c.in_size) * itemsize, scratchpad=scratch,
                     exact=exact)
