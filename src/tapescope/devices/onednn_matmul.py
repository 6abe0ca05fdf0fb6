"""The scratchpad oneDNN's bfloat16 matmul books inside a CPU `mm`/`addmm`/`bmm` on AVX512-BF16.

ATen's bf16 gemm (aten/src/ATen/native/mkldnn/Matmul.cpp, `mkldnn_gemm`) hands every product with
m * n * k > 16^3 to oneDNN's matmul through ideep, with the operands' own strides (src = mat1,
weights = mat2, dst = the result) and a user scratchpad that ideep allocates from PyTorch's CPU
allocator for the call. On avx512_core_bf16 (no AMX) the primitive is `brg_matmul:avx512_core_bf16`
and its scratchpad (src/cpu/x64/matmul/brgemm_matmul_utils.cpp, oneDNN v3.12 as bundled with torch
2.14: init_brgemm_matmul_conf, compute_blocking_heuristic_avx512, init_aux_values,
init_scratchpad) holds, per thread:
- the brgemm batch (16 entries of 40-byte `brgemm_batch_element_t`),
- a copy of a column-major (transposed) mat1 block, M_blk x LDA bf16 (`use_buffer_a`),
- B repacked to VNNI pairs, N_blk x K_blk bf16 (`use_buffer_b`: always for bf16),
- f32 accumulators M_blk x N_blk (`use_buffer_c`; `is_buffer_c_required` reads K_chunk_elems
  before init_aux_values sets it, so every bf16 result gets one), per N chunk where K is split,
each booking carrying 128 bytes for alignment (memory_tracking.hpp). The blocking is the
imbalance search of compute_blocking_heuristic_avx512, which reads only the shape and the
threads: no cache size enters on this ISA (the AMX kernels' blocking reads L1/L2 sizes; an AMX
host is not modelled and says so).

A bf16 `bmm`/`baddbmm` (mkldnn_matmul) runs the same primitive with the batch as its outer
dimension: the batch multiplies get_parallel_work, enters the low-parallel-work test and the
work count, and rules out the K split (`bwd_w_par_k_blk` wants batch 1); the bookings stay per
thread.

Checked against the CPU allocator on an AVX512-BF16 host (tests/test_kernel_workspace.py::
test_bf16_matmul_scratchpad_matches_the_allocator, test_bf16_bmm_scratchpad_matches_the_allocator;
benchmarks/bf16_bmm_sweep.py). Where oneDNN has no bf16 matmul (AVX2 and
below: `mkldnn_bf16_device_check`), ATen's own gemm runs and allocates nothing.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bf16_matmul_scratchpad"]

_BF16, _F32 = 2, 4
_ALIGN = 128              # memory_tracking.hpp default_alignment: added to every booking
_BATCH_ELEMENT = 40       # sizeof(brgemm_batch_element_t): two pointers, vvpad (2 x dim_t), dim_t
_BATCH_PER_THREAD = 16    # brgemm_batch_element_per_thr_sz = 16 * brgemm_batch_size
_N_BLK = 64               # get_default_n_block for plain B (no AMX)
_WEI_K_BLK = 32           # get_wei_k_blk: 16 x the bf16 VNNI granularity 2
_CACHE_LINE_ELEMS = 32    # bf16 elements in a 64-byte cache line (get_actual_lda)
_MIN_ONEDNN_WORK = 16 * 16 * 16   # mkldnn_gemm: m * n * k at most this stays in ATen


def _div_up(x: int, m: int) -> int:
    return -(-x // m)


def _rnd_up(x: int, m: int) -> int:
    return _div_up(x, m) * m


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _spatial_disbalance(work: int, block: int) -> np.float32:
    mod = work % block
    scalar = block - mod if work < block else min(block - mod, mod)
    return np.float32(scalar) / np.float32(block)


def _imbalance(M, N, K, m_blk, n_blk, n_chunks, k_blk, nthr_k, nthr, batch) -> np.float32:
    """matmul_avx512_blocking_params_t::get_imbalance (m_chunks 1), in float32 as the C++
    computes it; the batch multiplies the parallel work (get_parallel_work)."""
    f = np.float32
    cur_nthr = nthr // nthr_k
    parallel_work = _div_up(M, m_blk) * _div_up(N, n_blk * n_chunks) * batch
    parallel_work_disb = _spatial_disbalance(parallel_work, cur_nthr)
    m_blk_disb = f((m_blk * _div_up(M, m_blk)) % M) / f(M)
    num_n_blk = _div_up(N, n_blk)
    par_n_chunks = _div_up(num_n_blk, n_chunks)
    n_chunk_disb = (f(par_n_chunks) * f(n_chunks) - f(num_n_blk)) / f(num_n_blk)
    k_disb = _spatial_disbalance(K, nthr_k * k_blk)
    thread_disb = (f(nthr - cur_nthr * nthr_k) / f(nthr) if cur_nthr * nthr_k != nthr
                   else f(0))
    return (((parallel_work_disb + m_blk_disb) + n_chunk_disb) + thread_disb + k_disb) / f(5)


def _blocking(M, N, K, transposed_a, use_buffer_a, nthr, batch):
    """compute_blocking_heuristic_avx512 for a bf16 problem of `batch` products with a fixed N
    block (ideep passes concrete weight strides, so n_blk_fixed): (m_blk, n_chunks, k_blk,
    nthr_k), or None where no blocking passes (the primitive then refuses). The batch enters the
    parallel work, the low-parallel-work test and the work count; K is split only unbatched."""
    max_m_blk = min(256, M)
    min_m_blk = min(32, M)
    n_blk = min(_N_BLK, N)
    n_chunks = _div_up(N, n_blk)
    n_chunks_start = min(16 if use_buffer_a else 1, n_chunks)
    k_blk = min(K, 1024 if K > 1024 and not transposed_a else 512)
    start_nthr_k = 1
    if nthr > batch * n_chunks:  # low parallel work
        min_m_blk = min(M, 16)
        if batch == 1 and transposed_a and _pow2(K) and K >= 2048:   # bwd_w_par_k_blk
            start_nthr_k = min(nthr, 4)
    best, best_imb = None, np.float32(1.0)
    for nthr_k in range(start_nthr_k, 0, -1):
        found = False
        for n_chunk_size in range(n_chunks_start, 0, -1):
            for m_blk in range(max_m_blk, min_m_blk - 1, -1):
                imb = _imbalance(M, N, K, m_blk, n_blk, n_chunk_size, k_blk, nthr_k, nthr, batch)
                work = batch * _div_up(M, m_blk) * _div_up(N, n_blk * n_chunk_size)
                nthr_bmn = nthr // nthr_k
                if work < nthr_bmn * 3 and work % nthr_bmn and start_nthr_k == 1:
                    continue
                if imb < best_imb:
                    best_imb, best, found = imb, (m_blk, n_chunk_size, k_blk, nthr_k), True
        if not found:
            imb = _imbalance(M, N, K, min_m_blk, n_blk, 1, k_blk, nthr_k, nthr, batch)
            if imb < best_imb:
                best_imb, best = imb, (min_m_blk, 1, k_blk, nthr_k)
    return best


def bf16_matmul_scratchpad(M: int, K: int, N: int, transposed_a: bool, threads: int,
                           batch: int = 1) -> int | None:
    """Bytes of brg_matmul:avx512_core_bf16's scratchpad for dst(M x N) = src(M x K) @ wei(K x N)
    with a bf16 result, `batch` such products in one call (bmm/baddbmm), 0 where ATen keeps a
    2-D product (m * n * k <= 16^3); `transposed_a`: mat1 is read column-major. None where the
    blocking search finds nothing (not modelled)."""
    if batch == 1 and M * N * K <= _MIN_ONEDNN_WORK:
        return 0
    transposed_a = transposed_a and M != 1           # treat_A_as_plain
    # prefer_copy_a: a plain A with a big power-of-two row stride (8 KB) and many rows
    use_buffer_a = transposed_a or (_pow2(K) and K >= 8192 // _BF16 and M >= 1024)
    blocking = _blocking(M, N, K, transposed_a, use_buffer_a, threads, batch)
    if blocking is None:
        return None
    m_blk, n_chunks, k_blk, nthr_k = blocking
    n_blk = min(_N_BLK, N)
    ldb = _N_BLK                                     # use_buffer_b: LDB is the weights' n block
    ldc = n_blk if nthr_k <= 1 else N
    c_chunk = _F32 * ldc * (M if nthr_k > 1 else m_blk)
    c_per_thread = c_chunk if nthr_k > 1 or k_blk >= K else c_chunk * n_chunks
    b_per_thread = _BF16 * _rnd_up(n_blk, ldb) * _rnd_up(k_blk, _WEI_K_BLK)
    bookings = [threads * _BATCH_PER_THREAD * _BATCH_ELEMENT]
    if use_buffer_a:
        lda = _rnd_up(k_blk, _CACHE_LINE_ELEMS)
        if lda >= 512 and _pow2(lda):
            lda += _CACHE_LINE_ELEMS
        bookings.append(threads * _BF16 * m_blk * lda)
    bookings += [threads * b_per_thread, threads * c_per_thread]
    return sum(size + _ALIGN for size in bookings if size)
