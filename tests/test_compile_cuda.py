"""The compiled CUDA step without a GPU: inductor's CUDA lowering and Triton/wrapper codegen with
the device queries answered for the named GPU (capture/gpu_less.py), its wrapper run on fake
tensors with the kernels as no-ops.

Truth: the code inductor generated. Each graph's `call()` is read as text, independently of the
run: every `empty_strided_cuda(size, stride, dtype)` is an allocation of the storage those sizes
and strides need, `reinterpret_tensor(buf, ...)` and `bufM = bufN` alias a storage, `del` drops a
name, and a storage no name holds (and the return does not hand on) is freed. That sequence of
allocations and frees, byte for byte and in order, is what the Tape must have recorded inside the
run of that graph. Fusion is what makes the compiled step smaller: the model below (a hand-written
RMSNorm and a SwiGLU MLP, as Llama writes them) saves each pointwise intermediate in eager, while
inductor fuses them into a few kernels and saves only what the backward's matmuls read.
One inductor compile per module (a fixture), small sizes.
"""

import ast
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, d=128, h=384):
        super().__init__()
        self.norm = RMSNorm(d)
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        y = self.norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def two_blocks():
    return nn.Sequential(Block(), Block())


def _device_state():
    """What a process without a GPU answers, and the objects torch.compile keeps about devices."""
    import torch._dynamo.device_interface as di
    from torch._inductor.runtime.hints import DeviceProperties
    from torch._subclasses.fake_tensor import FakeTensorMode
    from triton.runtime import driver

    from tapescope.capture.gpu_less import _cached_functions

    return {
        "is_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count(),
        "torch.cuda": {k: getattr(torch.cuda, k) for k in (
            "is_available", "get_device_properties", "get_device_capability", "current_device",
            "set_device", "_lazy_init", "get_rng_state", "_DeviceGuard")},
        "interface": dict(vars(di.CudaInterface)),
        "worker": (dict(di.caching_worker_device_properties),
                   dict(di.caching_worker_current_devices)),
        "triton driver": driver._active,
        "avoid_device_init": FakeTensorMode.__dict__["avoid_device_init"],
        "DeviceProperties.create": DeviceProperties.create.cache_info().currsize,
        # an answer given inside may not be cached outside (the ones a GPU-less process
        # recomputes after the profile aside)
        "device caches": {f.__qualname__ for f in _cached_functions() if f.cache_info().currsize}
        - {"has_triton", "has_triton_package", "has_torch_tpu", "get_dtype_size"},
    }


@pytest.fixture(scope="module")
def cuda_compiled():
    before = _device_state()
    p = tapescope.profile(two_blocks, tapescope.spec((8, 128, 128)), device="cuda", gpu="h100",
                          compile=True, optimizer=None, steps=1)
    return p, before, _device_state()


# ---- the generated code, read as text ----------------------------------------------------------

_ALLOC = re.compile(r"^(\w+) = empty_strided_cuda\((\(.*?\)), (\(.*?\)), torch\.(\w+)\)$")
_ALIAS = re.compile(r"^(\w+) = (?:reinterpret_tensor\()?(\w+)(?:,.*\))?$")
_METADATA = re.compile(r"^assert_tensor_metadata\((\w+), (\(.*?\)), (\(.*?\)), torch\.(\w+)")
_ATEN = re.compile(r"^(\w+) = torch\.ops\.aten\.(\w+)\.(\w+)\((\w+)\b")


def _storage_bytes(size, stride, dtype) -> int:
    if 0 in size:
        return 0
    return (sum((n - 1) * s for n, s in zip(size, stride)) + 1) * getattr(torch, dtype).itemsize


def _source_events(code: str) -> list:
    """(+1 | -1, bytes) of each storage the graph's `call()` allocates, in the order its text
    allocates and frees them; the storages it returns stay alive."""
    body = code[code.index("    def call(self, args):"):code.index("\nrunner = Runner(")]
    names, alive, events, returned, pending = {}, {}, [], set(), set()
    for line in body.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("return "):
            returned = set(re.findall(r"\bbuf\d+\b", line))
            continue
        for stmt in (s.strip() for s in line.split(";") if s.strip()):
            if m := _ALLOC.match(stmt):
                n = _storage_bytes(ast.literal_eval(m[2]), ast.literal_eval(m[3]), m[4])
                alive[m[1]] = n
                names[m[1]] = m[1]
                events.append((1, n))
            elif stmt.startswith("del "):
                for name in (x.strip() for x in stmt[4:].split(",")):
                    st = names.pop(name, None)
                    if st in alive and st not in names.values():
                        events.append((-1, alive.pop(st)))
            elif m := _ALIAS.match(stmt):  # a graph input's storage is not one made here
                names[m[1]] = names.get(m[2], f"input {m[2]}")
            elif m := _ATEN.match(stmt):  # an ATen op inductor falls back to
                if getattr(getattr(torch.ops.aten, m[2]), m[3]).is_view:  # by its schema
                    names[m[1]] = names.get(m[4], f"input {m[4]}")
                else:  # it allocates its output: the metadata the wrapper asserts next
                    pending.add(m[1])
            elif (m := _METADATA.match(stmt)) and m[1] in pending:
                pending.discard(m[1])
                n = _storage_bytes(ast.literal_eval(m[2]), ast.literal_eval(m[3]), m[4])
                alive[m[1]] = n
                names[m[1]] = m[1]
                events.append((1, n))
            elif re.match(r"^buf\d+ = ", stmt):  # any other way of making a buffer
                raise AssertionError(f"a buffer this reading does not model: {stmt}")
    kept = {names[r] for r in returned if r in names}
    events += [(-1, n) for st, n in alive.items() if st not in kept]  # dropped at return
    return events


def _tape_events(p, label: str) -> list:
    """(+1 | -1, bytes) of the storages allocated inside the run of one graph, as the Tape saw."""
    trace = p.trace
    start, end = next((s, e) for lab, s, e in trace.compiled_calls if lab == label)
    size = {st.id: st.nbytes for st in trace.storages}
    made = {sid for op, sid, d in trace.events if d > 0 and start <= op < end}
    return [(d, size[sid]) for op, sid, d in trace.events
            if sid in made and start <= op < end]


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_wrapper_allocations_are_what_the_tape_saw(cuda_compiled, kind):
    p, _, _ = cuda_compiled
    graph = next(g for g in p.compiled.graphs if g.kind == kind)
    source = _source_events(graph.wrapper_code)
    call = graph.wrapper_code[graph.wrapper_code.index("def call("):]
    allocations = len(re.findall(r"empty_strided_cuda\(", call))
    assert sum(1 for d, _ in source if d > 0) == allocations > 0
    assert re.search(r"\bdel buf\d+", call)
    assert _tape_events(p, f"{kind} 0") == source


def test_fusion_makes_the_compiled_step_smaller(cuda_compiled):
    p, _, _ = cuda_compiled
    assert p.compiled.regions == 1 and not p.compiled.graph_breaks
    assert p.peak_bytes < 0.8 * p.eager.peak_bytes
    # what the forward leaves for the backward is smaller too (eager saves each pointwise result)
    side = p.to_dict(with_ops=False, with_timeline=False)["eager_vs_compiled"]
    saved = side["saved_activation_bytes"]
    assert 0 < saved["compiled"] < 0.8 * saved["eager"]
    # fused kernels move fewer bytes, and the compiled step has a time of its own
    assert side["kernel_bytes"]["compiled"] < side["kernel_bytes"]["eager"]
    assert p.time is not None and side["time_seconds"]["speedup"] > 0
    # the kernels are Triton kernels generated for the named GPU, and none was compiled
    fw = next(g for g in p.compiled.graphs if g.kind == "forward").wrapper_code
    assert "@triton.jit" in fw and "async_compile.triton(" in fw
    assert "cc=90" in fw and "multi_processor_count=132" in fw


def test_nothing_process_wide_survives(cuda_compiled):
    _, before, after = cuda_compiled
    # the device caches are emptied on exit: what they hold after was computed without a GPU
    assert after.pop("device caches") <= before.pop("device caches")
    # emptied on exit too: entries an earlier compile of this process made (a CPU one, when the
    # whole suite runs) are dropped and recomputed on demand, never replaced by a GPU answer
    assert after.pop("DeviceProperties.create") <= before.pop("DeviceProperties.create")
    assert after == before
    assert after["is_available"] is False and after["device_count"] == 0


def test_cli_profile_llama_compiled_on_h100():
    """`tapescope profile zoo:llama --device cuda --gpu h100 --amp bf16 --compile`: eager and
    compiled side by side, GPU-less."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_LLAMA

    r = CliRunner().invoke(app, ["profile", TINY_LLAMA, "--batch", "2", "--seq", "32",
                                 "--device", "cuda", "--gpu", "h100", "--amp", "bf16",
                                 "--compile"])
    assert r.exit_code == 0, r.output
    assert "Eager vs torch.compile (backend=inductor" in r.output
    assert "peak bytes" in r.output and "H100" in r.output


def test_device_properties_of_the_named_gpu():
    """What inductor reads of an H100 SXM, as `torch.cuda.get_device_properties(0)` reports it on
    one (CUDA C++ Programming Guide's limits for compute capability 9.0: 2048 threads and 64 K
    registers per SM, 228 KiB shared memory per SM of which 227 KiB for one block); every GPU of
    the catalogue has its capability's limits."""
    from tapescope.capture.gpu_less import device_properties
    from tapescope.devices.gpus import GPUS, get_gpu

    p = device_properties(get_gpu("h100"))
    assert (p.major, p.minor, p.multi_processor_count, p.warp_size) == (9, 0, 132, 32)
    assert (p.max_threads_per_multi_processor, p.regs_per_multiprocessor) == (2048, 65536)
    assert (p.shared_memory_per_multiprocessor, p.shared_memory_per_block_optin) == (233472, 232448)
    assert p.L2_cache_size == 50 * 2**20 and p.total_memory == 85_028_896_768
    for gpu in GPUS.values():
        assert device_properties(gpu).max_threads_per_multi_processor in (1024, 1536, 2048)


# ---- GPU-less compile of common fp32 models (issue 36) ------------------------------------------


def test_lone_linear_wrapper_runs_without_device_guard():
    """A lone Linear compiles to extern kernels only (`extern_kernels.addmm`), no Triton kernel:
    its wrapper still enters `torch.cuda._DeviceGuard(0)`, which on fake tensors needs no device.
    Truth: the wrapper's own text, allocation by allocation."""
    p = tapescope.profile(lambda: nn.Linear(64, 64), tapescope.spec((8, 64)), device="cuda",
                          gpu="h100", compile=True, optimizer=None, steps=1)
    fw = next(g for g in p.compiled.graphs if g.kind == "forward")
    assert "_DeviceGuard(0)" in fw.wrapper_code and "@triton.jit" not in fw.wrapper_code
    assert _tape_events(p, "forward 0") == _source_events(fw.wrapper_code) != []


def test_pad_mm_decides_without_benchmarking():
    """pad_mm's rules that need no benchmark are inductor's own, fed the named GPU's datasheet
    figures; hand-derived: arithmetic intensity MNK / (MK + NK + MN) against half the machine
    balance (peak FLOP/s / DRAM bytes/s). H100 SXM: 66.9 TFLOP/s fp32, 989.4 TFLOP/s bf16,
    3350 GB/s -> balance/2 = 9.99 (fp32), 147.7 (bf16)."""
    import torch._inductor.fx_passes.pad_mm as pad_mm

    from tapescope.capture.gpu_less import cuda_answered
    from tapescope.devices.gpus import get_gpu

    with cuda_answered(get_gpu("h100")):
        # 8x64 @ 64x10: 5120 / 1232 = 4.2 < 9.99, not padded, no benchmark
        assert not pad_mm.is_mm_compute_bound(8, 64, 10, torch.float32)
        # 64x64 @ 64x64 fp32: 64/3 = 21.3 > 9.99
        assert pad_mm.is_mm_compute_bound(64, 64, 64, torch.float32)
        # bf16: 128^3 / (3 * 128^2) = 42.7 < 147.7; 1024: 341 > 147.7
        assert not pad_mm.is_mm_compute_bound(128, 128, 128, torch.bfloat16)
        assert pad_mm.is_mm_compute_bound(1024, 1024, 1024, torch.bfloat16)
        # where inductor would time both on the device: the unpadded graph
        assert pad_mm.get_cached_should_pad("any key") is False
    # Linear(64, 10) (n = 10 is not a multiple of 4 fp32 elements: pad_mm looks at it) and a
    # compute-bound one with unaligned sizes (it would be benchmarked): both compile
    for d_in, d_out in ((64, 10), (130, 66)):
        p = tapescope.profile(lambda: nn.Linear(d_in, d_out), tapescope.spec((64, d_in)),
                              device="cuda", gpu="h100", compile=True, optimizer=None, steps=1)
        assert "constant_pad_nd" not in next(g for g in p.compiled.graphs
                                            if g.kind == "forward").wrapper_code


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("case", [
    {"compile": {"mode": "max-autotune"}}, {"compile": {"mode": "reduce-overhead"}},
    {"compile": {"dynamic": True}}, {"gpu": "t4"}, {"accumulate": 2},
    {"checkpointing": ["a"]}, {"compile": {"activation_memory_budget": 0.5}}])
def test_compile_options_on_cuda_without_a_gpu(case):
    """Each torch.compile setting a user reaches for compiles GPU-less (max-autotune keeps the
    ATen GEMM, the one choice that needs no benchmark), and the compiled forward's allocations
    are those its wrapper makes."""
    kw = {"device": "cuda", "gpu": "h100", "compile": True, "steps": 1, **case}
    p = tapescope.profile(TwoLinear, tapescope.spec((8, 64)), **kw)
    fw = next(g for g in p.compiled.graphs if g.kind == "forward")
    if not case.get("compile", {}).get("dynamic"):  # sizes the text names as symbols (s0)
        assert _tape_events(p, "forward 0") == _source_events(fw.wrapper_code)
    assert p.peak_bytes > 0 and "empty_strided_cuda" in fw.wrapper_code


def test_compile_failure_message_names_the_wrapped_error():
    """dynamo wraps a backend's error as "backend='inductor' raised:\\nRuntimeError: ..."; the
    message shown is the wrapped error, every line of it (errors.py: torch's wrappers put the
    cause after a first line of their own), not the line that ends in "raised:"."""
    from torch._dynamo.exc import BackendCompilerFailed

    from tapescope.errors import from_trace_failure

    def inductor():
        pass

    exc = BackendCompilerFailed(inductor, RuntimeError("Found no NVIDIA driver\nsecond line"),
                                None)
    msg = str(from_trace_failure(exc))
    assert "raised BackendCompilerFailed" in msg
    assert msg.endswith(": RuntimeError: Found no NVIDIA driver second line"), msg
    assert "raised:" not in msg


def test_bf16_on_a_gpu_inductor_skips_is_said():
    """Inductor cannot compile bf16 graphs below sm80 and asks dynamo to run the frame eagerly
    (SkipFrame "BF16 is not supported", compile_fx.py); with caches off that request arrived
    wrapped as an InductorError traceback. Now one line that says so and what to do."""
    from tapescope.errors import DeviceError

    with pytest.raises(DeviceError, match=r"BF16 is not supported.*runs it eagerly.*Fix: "):
        tapescope.profile(lambda: nn.Linear(64, 10), tapescope.spec((8, 64)), device="cuda",
                          gpu="t4", amp="bf16", compile=True, optimizer=None, steps=1)
