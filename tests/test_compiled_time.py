"""Time of an inductor-compiled CUDA step, GPU-less (analysis/compiled_time.py).

Truths: hand-derived bytes of a fused kernel (each buffer it loads or stores, once), 2mnk for an
extern GEMM, and the host cost the generated wrapper's own text implies under the published
per-launch and per-call figures (tritonbench #1017). One small compile per fixture.
"""

import re

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.analysis.compiled_time import (GRAPH_CALL_S, compiled_schedule,
                                              kernel_launch_host_s, step_kernels)
from tapescope.analysis.kernel_cost import kernel_of
from tapescope.devices.efficiency import HOST_OP_S

N, M = 4096, 64


class Chain(nn.Module):
    """A pointwise chain inductor fuses into one kernel: mul, add, sigmoid, relu, mul."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(N))

    def forward(self, x):
        return torch.sigmoid(x * self.w + 1.0).relu() * x


def _profile(model, shape, **compile_options):
    return tapescope.profile(model, tapescope.spec(shape), device="cuda", gpu="h100",
                             compile=compile_options or True, optimizer=None, steps=1)


@pytest.fixture(scope="module")
def chain():
    return _profile(Chain, (M, N))


def _forward_launches(p):
    call = next(i for i, (label, _, _) in enumerate(p.trace.compiled_calls)
                if label.startswith("forward"))
    return [k for k in p.trace.kernel_launches if k.call == call]


def test_fused_chain_moves_its_inputs_and_output_once(chain):
    """The forward is one Triton kernel: it loads x (M x N fp32) and w (N fp32) and stores the
    result (M x N fp32); the partitioner saves no intermediate (the backward recomputes it)."""
    (launch,) = _forward_launches(chain)
    assert launch.name.startswith("triton_poi_fused")
    assert launch.num_bytes == (M * N + N + M * N) * 4 == 2_113_536
    assert launch.flops == 0  # pointwise math: no FLOP formula, as eager ops count it


def test_fusion_moves_fewer_bytes_than_eager(chain):
    """Eager runs each op of the chain as a kernel that reads and writes DRAM; fused, the
    intermediates never leave the registers."""
    eager = sum(k.bytes * runs for k, runs in step_kernels(chain.eager.ops))
    compiled = sum(k.bytes * runs for k, runs in step_kernels(chain.ops, chain.compiled_schedule))
    # eager forward alone: mul (x, w -> t) 2 MiB + 16 KiB, add, sigmoid, relu 2 MiB each, mul
    # 3 MiB; the fused forward 2 MiB + 16 KiB
    assert compiled < 0.5 * eager
    side = chain.to_dict(with_ops=False, with_timeline=False)["eager_vs_compiled"]
    assert side["kernel_bytes"] == {"eager": eager, "compiled": compiled}


def test_compiled_cuda_profile_has_a_time(chain):
    t, e = chain.time, chain.eager.time
    assert t is not None and e is not None and t.seconds > 0
    # the two Triton kernels are on the GPU, priced by kernel_cost as any kernel
    assert len(chain.compiled_schedule.kernels()) == 2
    d = chain.to_dict(with_ops=False, with_timeline=False)
    assert d["time"]["seconds"] == t.seconds
    assert d["eager_vs_compiled"]["time_seconds"]["speedup"] == pytest.approx(e.seconds / t.seconds)


class Linear2(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128, bias=False), nn.Linear(128, 32, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


_RUN = re.compile(r"^\s*(\w+)\.run\(([^)]*)\)", re.M)


def _text_host(code: str) -> float:
    """Host seconds the wrapper's text implies: each `kernel.run(...)` by its tensor arguments
    (names, not numbers), each extern kernel as a dispatcher call."""
    call = code[code.index("    def call(self, args):"):code.index("\nrunner = Runner(")]
    total = 0.0
    for _, args in _RUN.findall(call):
        names = [a.strip() for a in args.split(",") if "=" not in a]
        total += kernel_launch_host_s(sum(1 for a in names if re.fullmatch(r"[A-Za-z_]\w*", a)))
    total += HOST_OP_S * len(re.findall(r"\bextern_kernels\.\w+\(", call))
    return total


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_host_cost_is_what_the_wrapper_text_launches(mode, capsys):
    """Each compiled graph call costs the published per-call figure; each launch its per-launch
    figure; under CUDA graphs (reduce-overhead) the launches are replayed with the graph and
    only the calls remain. Counted from the generated code's text."""
    p = _profile(Linear2, (16, 64), **({"mode": mode} if mode else {}))
    # inductor prints each module's path under benchmark_kernel (set for the figures): not shown
    assert "Compiled module path" not in capsys.readouterr().err
    sched = p.compiled_schedule
    calls = sum(1 for ls in sched.launches.values() for launch in ls if launch.kernel is None)
    assert calls == len(p.compiled.graphs) == 2
    inside = sum(sched.host.values())
    launches = sum(launch.host for ls in sched.launches.values() for launch in ls)
    expected = 0.0 if mode else sum(_text_host(g.wrapper_code) for g in p.compiled.graphs)
    assert inside + launches == pytest.approx(2 * GRAPH_CALL_S + expected)


def test_extern_gemm_is_priced_as_2mnk():
    """`extern_kernels.mm` runs through the dispatcher on fake tensors: an op of the trace, its
    Kernel the GEMM model's, with 2mnk FLOPs and the output's shape."""
    p = _profile(Linear2, (16, 64))
    label, start, end = next(c for c in p.trace.compiled_calls if c[0].startswith("forward"))
    mms = [kernel_of(op) for op in p.ops if start <= op.record.index < end
           and op.record.func is torch.ops.aten.mm.out]  # extern_kernels.mm(..., out=buf)
    assert [(k.flops, k.op_class, k.gemm) for k in mms] == [
        (2 * 16 * 128 * 64, "matmul", (1, 16, 128)), (2 * 16 * 32 * 128, "matmul", (1, 16, 32))]
    # it reads its operands and writes its output once (`out=` is not read): fp32 16x64 @
    # 64x128 -> 16x128
    assert mms[0].bytes == (16 * 64 + 64 * 128 + 16 * 128) * 4


def test_aot_eager_is_timed_as_its_aten_ops():
    p = tapescope.profile(Linear2, tapescope.spec((16, 64)), device="cuda", gpu="h100",
                          compile={"backend": "aot_eager"}, optimizer=None, steps=1)
    assert p.compiled_schedule is None and p.time is not None
    assert p.trace.kernel_launches == []  # AOTAutograd's graphs run as aten ops: no kernels
    assert compiled_schedule(p.trace, p.ops, {}).kernels() == []


class Broken(nn.Module):
    """Two compiled regions: a graph break between the layers (print is not traceable)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        x = torch.relu(self.a(x)).sigmoid()
        torch._dynamo.graph_break()
        return torch.relu(self.b(x)).sigmoid()


def test_graph_break_regions_and_eager_ops_share_one_schedule():
    """Each region's forward and backward is a compiled call with its own host cost and
    kernels; the eager ops between (the loss, AOTAutograd's wrappers, the optimizer) are in the
    same schedule: the step's time covers all of them, phase by phase."""
    p = tapescope.profile(Broken, tapescope.spec((32, 64)), device="cuda", gpu="h100",
                          compile=True, steps=1)
    assert p.compiled.regions == 2 and len(p.compiled.graph_breaks) == 1
    sched = p.compiled_schedule
    calls = [launch for ls in sched.launches.values() for launch in ls if launch.kernel is None]
    assert sorted(launch.phase for launch in calls) == ["backward"] * 2 + ["forward"] * 2
    # every generated kernel of every run of compiled code is in the step's schedule
    assert len(sched.kernels()) == len(p.trace.kernel_launches) >= 4
    t = p.time
    assert set(t.by_phase) == {"forward", "backward", "optimizer"}
    assert t.seconds == pytest.approx(sum(t.by_phase.values()))
    assert t.host > len(calls) * GRAPH_CALL_S
