"""The CUDA memory prediction and the step-time model, against hand-derived numbers."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.analysis.gpu_memory import cublas_workspace_bytes, predict_cuda_memory
from tapescope.analysis.timing import estimate_step_time
from tapescope.devices.efficiency import HOST_OP_S, KERNEL_OVERHEAD_S, PRIORS
from tapescope.devices.gpus import get_gpu

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")


class OneMatmul(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, n))

    def forward(self, x):
        return (x @ self.w).sum()


def _profile(n=4096, gpu="h100"):
    return tapescope.profile(lambda: OneMatmul(n), tapescope.spec((n, n), dtype=torch.bfloat16),
                             device="cuda", dtype="bf16", gpu=gpu, optimizer=None, steps=1)


def test_cublas_workspace_by_compute_capability():
    # CublasHandlePool.cpp parseChosenWorkspaceSize: 32 MiB on sm 9.x/10.x/12.x, else :4096:2:16:8
    assert cublas_workspace_bytes((9, 0)) == 32 * 2**20
    assert cublas_workspace_bytes((8, 0)) == 2 * 4096 * 1024 + 8 * 16 * 1024


def test_allocator_replay_of_one_matmul_by_hand():
    n = 4096
    p = _profile(n)
    cm = predict_cuda_memory(p.trace, get_gpu("h100"))
    block = n * n * 2  # 32 MiB bf16, a multiple of 2 MiB: one segment each, no rounding
    # Live at the peak: weight and input (setup), the cuBLAS workspace (kept from the first matmul),
    # in backward the weight's gradient (x^T @ grad: 32 MiB; the mm output died after the sum),
    # and two 2-byte scalars (the loss and the ones it is differentiated with), 512 bytes each.
    assert cm.max_allocated == 4 * block + 2 * 512
    # one 32 MiB segment per large block (sizes over 10 MiB are rounded to 2 MiB), one 2 MiB
    # segment holding the small blocks
    assert cm.max_reserved == 4 * block + 2 * 2**20 and not cm.oom
    tiny = tapescope.profile(lambda: OneMatmul(n), tapescope.spec((n, n), dtype=torch.bfloat16),
                             device="cuda", dtype="bf16", gpu="l4", optimizer=None, steps=1)
    assert cublas_workspace_bytes(get_gpu("l4").compute_capability) < 32 * 2**20
    assert predict_cuda_memory(tiny.trace, get_gpu("l4")).max_allocated < cm.max_allocated


def test_roofline_of_one_matmul_by_hand():
    n = 8192
    p = _profile(n)
    t = estimate_step_time(p.ops, p.trace, get_gpu("h100"))
    mm = next(i for i, op in enumerate(p.ops) if op.name == "aten.mm.default")
    flops = 2 * n ** 3
    # H100 SXM's measured matmul ceiling, 794.5 of 989 TFLOPS (MAMF), at the clock it sustains
    # (H200's MSMF / MAMF, 744.5 / 846.5 = 0.880); an 8192 x 8192 output is 2,048 tiles of
    # 256 x 128 on 132 SMs: 16 waves of which the last is 68/132 full, so 2048 / (16 x 132) of
    # the tile work is useful (128 x 128 tiles: 4,096 in 32 waves, the same)
    share = 0.803 * 0.880 * 2048 / (16 * 132)
    expected = max(flops / (get_gpu("h100").peak("bf16") * share),
                   3 * n * n * 2 / (get_gpu("h100").memory_bandwidth * PRIORS["matmul"].memory)
                   ) + KERNEL_OVERHEAD_S
    assert t.op_seconds[mm] == pytest.approx(expected, rel=1e-12)
    assert not t.calibrated and t.bound == "gpu"
    assert t.seconds >= t.gpu_busy and t.host >= len(p.ops) * 0  # host adds up per op
    assert 0 < t.mfu < 1


def test_gemm_tile_and_wave_quantization_by_hand():
    from tapescope.devices.efficiency import gemm_tile_utilization

    # 11 x 12 tiles of 256 x 128 = 132 tiles: one full wave on 132 SMs
    assert gemm_tile_utilization(256 * 11, 128 * 12, 1, 132) == 1.0
    # one 128 x 128 tile (the best fit) on one SM of 132
    assert gemm_tile_utilization(128, 128, 1, 132) == pytest.approx(1 / 132)
    # 133 tiles of 256 x 128 need 2 waves: 133 / 264 of the work is useful; 128 x 128 tiles
    # make 266 in 3 waves, 266 / 396: the smaller tiles win
    assert gemm_tile_utilization(256 * 133, 128, 1, 132) == pytest.approx(266 / 396)
    # a partial tile costs a whole one: m = 257 with 128 x 128 tiles is 3 row tiles, in one wave
    assert gemm_tile_utilization(257, 128, 1, 132) == pytest.approx(257 * 128 / (132 * 128 * 128))


def test_sustained_clock_and_power_limit_by_hand():
    """MSMF / MAMF measured on the part (H200: 744.5 / 846.5 TFLOP/s; B200 1424.5 / 1693.5), the
    clock lowered by a board limit as the cube root of power (500 W against the 679 W drawn at
    the sustained clock), and nothing where no sustained figure was measured (L4)."""
    from tapescope.devices.efficiency import matmul_ceiling, sustained_clock

    assert sustained_clock(get_gpu("h100")) == 0.880
    assert sustained_clock(get_gpu("b200")) == 0.841
    assert sustained_clock(get_gpu("l4")) == 1.0           # no sustained figure: the burst
    assert sustained_clock(get_gpu("h100"), "fp8") == 0.989
    assert sustained_clock(get_gpu("b200"), "fp8") == 0.841   # no fp8 figure: its 16-bit one
    capped = get_gpu("h100-96gb")
    assert capped.power_limit_watts == 500 and capped.memory_type == "HBM2e"
    assert sustained_clock(capped) == pytest.approx(0.880 * (500 / 679) ** (1 / 3))
    assert sustained_clock(capped) == pytest.approx(0.795, abs=1e-3)
    # fp8 GEMMs have their own burst ceiling (H100 SXM 1402.6 of 1979 TFLOP/s)
    assert matmul_ceiling("h100-sxm", "fp8") == 0.709 and matmul_ceiling("h100-sxm") == 0.803
    # one compute-bound matmul on the capped part takes 1 / 0.903 as long as on the 700 W one
    n = 8192
    a, b = (estimate_step_time(p.ops, p.trace, get_gpu(g)) for p, g in
            ((_profile(n), "h100"), (_profile(n, "h100-96gb"), "h100-96gb")))
    mm = next(i for i, op in enumerate(_profile(n).ops) if op.name == "aten.mm.default")
    assert (b.op_seconds[mm] - KERNEL_OVERHEAD_S) / (a.op_seconds[mm] - KERNEL_OVERHEAD_S) == \
        pytest.approx((679 / 500) ** (1 / 3))


# Azure AI-benchmarking-guide, Azure_Results/ND_{A100_v4,H100_v5,H200_v5}_results.md: cuBLASLt
# GEMMs (m, n, k) -> TFLOP/s after 10,000 warm-up iterations; A100 in fp16, H100 / H200 in fp8
AZURE_GEMMS = {
    ("a100", torch.float16): {
        (1024, 1024, 1024): 119.4, (2048, 2048, 2048): 221.8, (4096, 4096, 4096): 228.0,
        (8192, 8192, 8192): 253.7, (16384, 16384, 16384): 256.5, (1024, 2145, 1024): 132.8,
        (6144, 12288, 12288): 250.8, (802816, 192, 768): 157.8},
    ("h100", torch.float8_e4m3fn): {
        (1024, 1024, 1024): 274.1, (2048, 2048, 2048): 1011.3, (4096, 4096, 4096): 1216.9,
        (8192, 8192, 8192): 1290.1, (16384, 16384, 16384): 1377.3,
        (32768, 32768, 32768): 1382.2, (1024, 2145, 1024): 410.7,
        (6144, 12288, 12288): 1351.4, (802816, 192, 768): 663.8},
    ("h200", torch.float8_e4m3fn): {
        (1024, 1024, 1024): 290.8, (2048, 2048, 2048): 1013.4, (4096, 4096, 4096): 1249.1,
        (8192, 8192, 8192): 1300.6, (16384, 16384, 16384): 1366.3,
        (32768, 32768, 32768): 1349.5, (1024, 2145, 1024): 407.9,
        (6144, 12288, 12288): 1318.0, (802816, 192, 768): 717.5},
}


def azure_gemm_errors():
    """(gpu, shape, predicted / measured - 1) for every row of AZURE_GEMMS."""
    from tapescope.analysis.kernel_cost import Kernel, kernel_time

    out = []
    for (name, dtype), rows in AZURE_GEMMS.items():
        gpu = get_gpu(name)
        for (m, n, k), measured in rows.items():
            flops = 2 * m * n * k
            nbytes = (m * k + k * n) * dtype.itemsize + m * n * 2
            t, _ = kernel_time(Kernel("aten.mm.default", "matmul", flops, nbytes, dtype,
                                      (1, m, n)), gpu)
            out.append((name, (m, n, k), flops / t / 1e12 / measured - 1))
    return out


def test_gemms_against_azures_sustained_measurements():
    """The 16384^3 rows set the sustained share of A100 fp16, H100 and H200 fp8 (fitted: within
    0.1%); every other shape is the check, unfitted: GEMMs with every dimension >= 4096 within
    8% of the measurement, and the median over all unfitted shapes 6.3%. Small (1024) and
    skinny-K (k = 768) GEMMs are optimistic by up to 35% (not modelled: tile pipelines too short
    to reach the steady state)."""
    import statistics

    errors = azure_gemm_errors()
    fitted = [e for _, shape, e in errors if shape == (16384, 16384, 16384)]
    unfitted = [(shape, e) for _, shape, e in errors if shape != (16384, 16384, 16384)]
    assert len(fitted) == 3 and all(abs(e) < 1e-3 for e in fitted)
    large = [e for shape, e in unfitted if min(shape) >= 4096]
    assert len(large) == 11 and all(abs(e) < 0.08 for e in large)
    assert statistics.median(abs(e) for _, e in unfitted) == pytest.approx(0.063, abs=0.005)
    # without the SM-fill term on GEMMs of known shape: one 1024^3 A100 GEMM within 6%, not -86%
    assert next(e for g, s, e in errors if g == "a100" and s == (1024, 1024, 1024)) < 0.06


def test_attention_efficiency_by_backend_and_direction():
    from tapescope.devices.efficiency import attention_efficiency

    # FlashAttention-3 paper, H100: cuDNN forward ~0.59, backward ~0.47 of 989 TFLOPS;
    # FlashAttention-2 paper, A100: flash forward ~0.66
    assert attention_efficiency("aten._scaled_dot_product_cudnn_attention.default", "hopper") == 0.59
    assert attention_efficiency("aten._scaled_dot_product_cudnn_attention_backward.default",
                                "hopper") == 0.47
    assert attention_efficiency("aten._scaled_dot_product_flash_attention.default", "ampere") == 0.66
    assert attention_efficiency("aten._scaled_dot_product_flash_attention.default", "volta") is None


def test_attention_efficiency_on_the_published_curves_by_hand():
    """FlashAttention-3 paper, H100 SXM5 bf16 head dim 128 (TFLOP/s of 989.4): cuDNN causal
    forward 518 at 4k, non-causal 609; backward 499 at 4k; FA2 causal forward 191 at 512 and 335
    at 16k, straight in log2(seq) between (4k is 3/5 of the way: 277.4); the causal backward is
    the non-causal one times the cuDNN forward causal / non-causal ratio at that length."""
    from tapescope.analysis.kernel_cost import AttentionShape
    from tapescope.devices.efficiency import attention_efficiency

    def _shape(seq, causal):
        return AttentionShape(32, seq, seq, 128, causal)

    fwd = "aten._scaled_dot_product_cudnn_attention.default"
    bwd = "aten._scaled_dot_product_cudnn_attention_backward.default"
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert attention_efficiency(fwd, "hopper", _shape(4096, True)) == pytest.approx(518 / 989.4)
    assert attention_efficiency(fwd, "hopper", _shape(4096, False)) == pytest.approx(609 / 989.4)
    assert attention_efficiency(bwd, "hopper", _shape(4096, False)) == pytest.approx(499 / 989.4)
    assert attention_efficiency(bwd, "hopper", _shape(4096, True)) == \
        pytest.approx(499 * 518 / 609 / 989.4)
    assert attention_efficiency(flash, "hopper", _shape(4096, True)) == \
        pytest.approx((191 + (335 - 191) * 3 / 5) / 989.4)
    # between two points (3k: log2 3072 = 11.585), beyond the ends flat
    x = 11.584962500721156 - 11
    assert attention_efficiency(fwd, "hopper", _shape(3072, True)) == \
        pytest.approx((484 + (518 - 484) * x) / 989.4)
    assert attention_efficiency(fwd, "hopper", _shape(65536, True)) == pytest.approx(539 / 989.4)
    # no curve on Ampere: the flat figure
    assert attention_efficiency(flash, "ampere", _shape(4096, True)) == 0.66


class CausalAttention(nn.Module):
    def __init__(self, dim=256):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_attention_kernels_carry_their_sequence_head_dim_and_mask():
    """kernel_of reads the attention's shape (batch x heads, query and key lengths, head dim) from
    the traced SDPA call's tensors and is_causal from its own arguments, forward and backward
    alike."""
    from tapescope.analysis.kernel_cost import kernel_of

    p = tapescope.profile(CausalAttention, tapescope.spec((2, 1024, 256)), device="cuda",
                          gpu="h100", dtype="bf16", optimizer=None, steps=1)
    kernels = [kernel_of(op) for op in p.ops if "attention" in op.name]
    assert len(kernels) == 2 and {k.op_class for k in kernels} == {"attention"}
    # batch 2 x 2 heads of 128
    assert all(k.attention == (4, 1024, 1024, 128, True) for k in kernels)


def test_compute_overlapped_with_a_collective_runs_on_the_remaining_sms():
    from tapescope.analysis.timing import _stretched

    # 10 us of work from t=0; a collective holds 1/4 of the SMs from 2 to 6 us: 2 us of work
    # before it, 3 us during it (4 us at 3/4 speed), the last 5 us after: done at 11 us
    assert _stretched(0.0, 10.0, [(2.0, 6.0)], 0.25) == pytest.approx(11.0)
    assert _stretched(0.0, 1.0, [(2.0, 6.0)], 0.25) == pytest.approx(1.0)
    # entirely inside: 1.5 us of work takes 2 us
    assert _stretched(3.0, 1.5, [(2.0, 6.0)], 0.25) == pytest.approx(2.0)


def test_host_bound_when_ops_are_tiny():
    p = tapescope.profile(lambda: OneMatmul(8), tapescope.spec((8, 8)), device="cuda", gpu="h100",
                          optimizer="adamw")
    t = estimate_step_time(p.ops, p.trace, get_gpu("h100"))
    assert t.bound == "host" and t.gpu_busy < t.seconds / 2
    assert t.seconds >= t.host >= HOST_OP_S


def test_oom_verdict():
    # 70k x 70k bf16 = 9.1 GiB per tensor; weight, input and output (30 GB) cannot fit an L4 (24 GB)
    p = _profile(70000, gpu="l4")
    assert p.cuda_memory.oom and p.cuda_memory.oom_at is not None
    assert not _profile(4096, gpu="l4").cuda_memory.oom


def _one_matmul(n=3000, **kw):
    return tapescope.profile(lambda: OneMatmul(n), tapescope.spec((n, n), dtype=torch.bfloat16),
                             device="cuda", dtype="bf16", gpu="h100", optimizer=None, steps=1, **kw)


def test_allocator_settings_change_the_prediction_as_the_allocator_rules_say(monkeypatch):
    """The weight, the input and the weight's gradient are 3000x3000 bf16 = 18,000,000 bytes each;
    with the cuBLAS workspace (32 MiB) and two 2-byte scalars they are the peak. By default
    round_size rounds a request to 512 bytes (18,000,384), get_allocation_size gives it an 18 MiB
    segment, and the block is not split (873,984 bytes would remain, not more than 1 MiB): each
    takes 18 MiB. With roundup_power2_divisions:4 round_size rounds to the next quarter of the
    request's power-of-two interval [16 MiB, 32 MiB): 20 MiB."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    scalars, workspace = 2 * 512, 32 * 2**20
    assert _one_matmul().cuda_memory.max_allocated == 3 * 18 * 2**20 + workspace + scalars
    rounded = 3 * 20 * 2**20 + workspace + scalars
    p = _one_matmul(alloc_conf="roundup_power2_divisions:4")
    assert p.cuda_memory.max_allocated == rounded
    assert p.cuda_memory.settings == "roundup_power2_divisions:4"
    # read from the environment as torch reads it: PYTORCH_ALLOC_CONF first, then the CUDA one
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:4")
    assert _one_matmul().cuda_memory.max_allocated == rounded
    # PYTORCH_ALLOC_CONF wins; with expandable segments should_split splits whenever 512 bytes
    # or more remain, so each block is the rounded request: 18,000,384
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env = _one_matmul().cuda_memory
    assert env.max_allocated == 3 * 18_000_384 + workspace + scalars
    assert env.settings == "expandable_segments:True"


def test_bad_allocator_settings_are_a_clear_error():
    with pytest.raises(tapescope.TapescopeError, match="max_split_size must be >= 20 MB"):
        _one_matmul(alloc_conf="max_split_size_mb:4")
    with pytest.raises(tapescope.TapescopeError, match="Unrecognized key 'nonsense'"):
        _one_matmul(alloc_conf="nonsense:1")


def _elementwise(index, func, stream, inputs, outputs, nbytes):
    from tapescope.analysis.ops import Op
    from tapescope.capture.records import OpRecord, TensorRef

    refs = [tuple(TensorRef((nbytes // 2,), torch.bfloat16, s, s) for s in ids)
            for ids in (inputs, outputs)]
    rec = OpRecord(index, func, "forward", 1, (), {}, refs[1], refs[0], stream=stream)
    return Op(index, str(func), "forward", None, None, None, None, refs[0], refs[1], None,
              nbytes * len(inputs), nbytes * len(outputs), False, None, rec)


def test_a_side_stream_runs_in_its_own_queue_and_its_readers_wait_for_it():
    """Schedule by hand, from each kernel's own time and the host's per-op issue cost: a short op
    on the compute stream, a long one on another stream (FSDP2's copy-in stream) that does not
    queue behind it, then a compute op reading the side op's output, which waits for it."""
    from tapescope.analysis.timing import kernel_seconds

    gpu = get_gpu("h100")
    add = torch.ops.aten.add.Tensor
    ops = [_elementwise(0, add, 0, (1, 2), (3,), 1 << 20),
           _elementwise(1, add, 1, (4, 5), (6,), 1 << 30),
           _elementwise(2, add, 0, (3, 6), (7,), 1 << 20)]
    t0, t1, t2 = (kernel_seconds(op, gpu)[0] for op in ops)
    trace = SimpleNamespace(storages={})   # only read for .item()
    t = estimate_step_time(ops, trace, gpu)
    side_done = 2 * HOST_OP_S + t1          # issued second, starts when the host issues it
    assert HOST_OP_S + t0 < side_done       # the compute stream is idle when op 2 is issued
    assert t.seconds == pytest.approx(side_done + t2)
    # on one stream the same three ops run back to back
    one = [_elementwise(i, add, 0, tuple(r.storage for r in op.inputs),
                        tuple(r.storage for r in op.outputs), (1 << 30) if i == 1 else 1 << 20)
           for i, op in enumerate(ops)]
    start1 = max(HOST_OP_S + t0, 2 * HOST_OP_S)   # after op 0 and after the host issued it
    assert estimate_step_time(one, trace, gpu).seconds == pytest.approx(start1 + t1 + t2)


def test_a_stream_waits_for_the_event_it_was_made_to_wait_on():
    """Schedule by hand (cudaStreamWaitEvent: a stream's later work starts after the work the
    event was recorded behind): a long op on the compute stream, then an op on another stream
    that reads nothing of it but whose stream waits on an event recorded after it (FSDP2's next
    all-gather copy-in waiting for a copy-out) starts when it ends, not when the host issues it.
    A wait held by an op that launches nothing (an `empty`) applies to that stream's next kernel."""
    from tapescope.analysis.timing import kernel_seconds

    gpu = get_gpu("h100")
    add = torch.ops.aten.add.Tensor
    empty = torch.ops.aten.empty.memory_format
    long = _elementwise(0, add, 0, (1, 2), (3,), 1 << 30)
    side = _elementwise(1, add, 1, (4, 5), (6,), 1 << 20)
    t0, t1 = (kernel_seconds(op, gpu)[0] for op in (long, side))
    trace = SimpleNamespace(storages={})
    assert HOST_OP_S + t0 > 2 * HOST_OP_S       # the host issues op 1 long before op 0 ends
    free = estimate_step_time([long, side], trace, gpu).seconds
    assert free == pytest.approx(HOST_OP_S + t0)            # op 1 runs beside op 0
    side.record.waits = (0,)
    assert estimate_step_time([long, side], trace, gpu).seconds == pytest.approx(HOST_OP_S + t0 + t1)
    side.record.waits = ()
    hold = _elementwise(1, empty, 1, (), (8,), 1 << 20)
    hold.record.waits = (0,)
    side2 = _elementwise(2, add, 1, (4, 5), (6,), 1 << 20)
    t = estimate_step_time([long, hold, side2], trace, gpu).seconds
    assert t == pytest.approx(HOST_OP_S + t0 + t1)


def test_a_collective_on_a_side_stream_holds_that_stream_until_it_ends():
    """distributed_c10d calls work.wait() after a synchronous collective (async_op=False), which
    blocks the issuing CUDA stream until the collective completes: the next op on that stream
    starts when the collective ends (issue time + its seconds), though it reads nothing of it;
    on another stream it starts when the host issues it."""
    from tapescope.analysis.timing import kernel_seconds

    gpu = get_gpu("h100")
    add = torch.ops.aten.add.Tensor
    gather = _elementwise(0, torch.ops.c10d._allgather_base_.default, 2, (1,), (2,), 1 << 20)
    after = _elementwise(1, add, 2, (4, 5), (6,), 1 << 20)
    t1 = kernel_seconds(after, gpu)[0]
    trace = SimpleNamespace(storages={})
    c = 0.01
    assert estimate_step_time([gather, after], trace, gpu, {0: c}).seconds == \
        pytest.approx(HOST_OP_S + c + t1)
    after.record.stream = 3
    assert estimate_step_time([gather, after], trace, gpu, {0: c}).seconds == \
        pytest.approx(HOST_OP_S + c)          # it ran beside the collective
    assert 2 * HOST_OP_S + t1 < HOST_OP_S + c


def test_collectives_of_different_process_groups_run_side_by_side():
    """ProcessGroupNCCL gives each process group its own NCCL stream: two collectives issued back
    to back on different groups (FSDP's all-gather, TP's) overlap, each starting when the host
    issues it; on one group the second starts when the first ends. Schedule by hand, from the
    host's per-op issue cost and each collective's seconds."""
    gpu = get_gpu("h100")
    gather = torch.ops._c10d_functional.all_gather_into_tensor.default
    ops = [_elementwise(0, gather, 0, (1,), (2,), 1 << 20),
           _elementwise(1, gather, 0, (3,), (4,), 1 << 20)]
    trace = SimpleNamespace(storages={})
    c0, c1 = 0.01, 0.004
    one = estimate_step_time(ops, trace, gpu, {0: c0, 1: c1}, {0: "fsdp", 1: "fsdp"})
    assert one.seconds == pytest.approx(HOST_OP_S + c0 + c1)
    two = estimate_step_time(ops, trace, gpu, {0: c0, 1: c1}, {0: "fsdp", 1: "tp"})
    assert two.seconds == pytest.approx(max(HOST_OP_S + c0, 2 * HOST_OP_S + c1))
    assert two.comm == pytest.approx(c0 + c1)
    # without streams named, every collective shares one (as before groups were known)
    assert estimate_step_time(ops, trace, gpu, {0: c0, 1: c1}).seconds == one.seconds


def test_collective_spans_merge_where_they_overlap():
    from tapescope.analysis.timing import _occupy

    spans = [(0.0, 1.0), (2.0, 3.0)]
    assert _occupy(spans, 3.0, 4.0) == 2 and spans == [(0.0, 1.0), (2.0, 3.0), (3.0, 4.0)]
    assert _occupy(spans, 1.5, 1.8) == 1 and spans[1] == (1.5, 1.8)
    assert _occupy(spans, 0.5, 2.5) == 0 and spans == [(0.0, 3.0), (3.0, 4.0)]
    assert _occupy(spans, -1.0, 5.0) == 0 and spans == [(-1.0, 5.0)]


def test_bound_names_what_the_wall_time_goes_to_most():
    """`bound`: the compute stream's kernels, the GPU waiting for the host, or compute waiting
    for a collective, whichever takes most of the step. A step of tiny ops waits for the host in
    every phase; an op that reads a 10 ms all-gather's output waits for it (communication)."""
    tiny = tapescope.profile(lambda: OneMatmul(8), tapescope.spec((8, 8)), device="cuda",
                             gpu="h100", optimizer="adamw")
    t = estimate_step_time(tiny.ops, tiny.trace, get_gpu("h100"))
    assert t.bound == "host" and set(t.host_bound_phases) == set(t.by_phase)
    assert sum(t.host_wait.values()) > t.seconds / 2

    gpu = get_gpu("h100")
    gather = _elementwise(0, torch.ops.c10d._allgather_base_.default, 0, (1,), (2,), 1 << 20)
    reader = _elementwise(1, torch.ops.aten.add.Tensor, 0, (2, 3), (4,), 1 << 20)
    c = 0.01
    t = estimate_step_time([gather, reader], SimpleNamespace(storages={}), gpu, {0: c})
    # the reader is issued at 2 host ops and waits until the collective ends at HOST_OP_S + c
    assert t.exposed_comm == pytest.approx(c - HOST_OP_S)
    assert t.bound == "communication" and t.host_bound_phases == ()


def test_fsdp2_all_gather_carries_its_python_host_cost(monkeypatch):
    """Each FSDP2 all-gather costs the host 0.37 ms in all (pytorch PR #133369, Llama3-8B): the
    traced ops of its span are charged their dispatch (3 launching ops, 3 that launch none), the
    rest once per group at its copy-in: the host's time grows by exactly that per all-gather."""
    import tapescope.analysis.timing as timing
    from tapescope.devices.efficiency import HOST_VIEW_S

    from . import distributed_models as dm

    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp, device="cuda",
                          gpu="h100")
    gathers = sum(1 for op in p.ops if op.name == "fsdp.all_gather_copy_in.default")
    assert gathers >= 2
    with_python = estimate_step_time(p.ops, p.trace, p.gpu)
    monkeypatch.setattr(timing, "PYTHON_HOST_S", {})
    without = estimate_step_time(p.ops, p.trace, p.gpu)
    assert with_python.host - without.host == \
        pytest.approx(gathers * (0.37e-3 - 3 * HOST_OP_S - 3 * HOST_VIEW_S))
