"""What an inductor-compiled step launches, as the schedule's input: one time for the step.

Inside a compiled region the work is what inductor's generated wrapper launches, which the capture
recorded as it ran the wrapper on fake tensors (capture/compiled.py, `Trace.kernel_launches` and
the ops of `Trace.compiled_calls`):
- each generated Triton kernel (a fused pointwise / reduction chain, or a template GEMM) is a
  Kernel of inductor's own figures: the bytes its arguments load and store (`kernel_num_gb`,
  inductor's `estimate_kernel_num_bytes`: each buffer once, an in-place one twice) and its FLOPs
  (`kernel_flop`: the FLOP counter over the nodes it fused; 0 for pointwise math, as eager ops
  count it); a template (`triton_tem_*`) is a matmul;
- extern kernels (`extern_kernels.mm`, flash attention, convolutions: aten ops the wrapper calls)
  ran through the dispatcher on fake tensors and are ops of the trace, priced as eager ops are
  (kernel_cost.kernel_of: the GEMM / attention model);
- the wrapper's allocations and reinterpretations (`empty_strided_cuda`, `reinterpret_tensor`) are
  C++ helpers, ops of the trace too, which launch nothing.
Everything outside the compiled regions (the loss, graph breaks, the optimizer, AOTAutograd's
runtime wrappers) is eager and scheduled as in an eager step; analysis/timing.py schedules both.

The host: a compiled step issues its kernels from the wrapper's Python, without the dispatcher
and autograd an eager op goes through. Figures measured by PyTorch's own launch-overhead study
(meta-pytorch/tritonbench PR #1017, 2026-04-14, GB200 host, torch.compile'd nop kernels):
- a generated kernel's launch (`CachingAutotuner.run`: inductor's preamble, Triton's binder,
  cuLaunchKernel) 6.8 us with no arguments, 9.1 us with 19: linear in the argument count between;
- a compiled graph's call (dynamo's guards, the compiled graph's runtime wrappers, the wrapper's
  `call()` preamble: argument checks, DeviceGuard) 37.5 us: the full one-kernel call, 44.3 us,
  less its one launch, 6.8 us;
- an extern kernel is a dispatcher call without autograd: priced as an eager op's host cost
  (HOST_OP_S), an upper bound; the wrapper's C++ helpers cost nothing beyond the call's figure.
`mode="reduce-overhead"` replays each region as a CUDA graph: the kernels are submitted with the
graph, one launch per call, so only the call's host cost remains (the static-input copies a
CUDA-graph tree makes are not modelled: capture/compiled.py APPROXIMATIONS).

The stream: the wrapper launches on the current stream (`get_raw_stream`), the compute stream.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..capture.records import BACKWARD, FORWARD, Trace
from .kernel_cost import Kernel

__all__ = ["Launch", "CompiledSchedule", "compiled_schedule", "generated_kernel",
           "kernel_launch_host_s", "step_kernels", "GRAPH_CALL_S"]

# meta-pytorch/tritonbench PR #1017 (GB200): CachingAutotuner.run per kernel, 0 and 19 arguments
_LAUNCH_S_NO_ARGS, _LAUNCH_S_19_ARGS = 6.8e-6, 9.1e-6
# the same study: nop_inductor_kernel end to end (44.3 us) less its one kernel launch (6.8 us)
GRAPH_CALL_S = 44.3e-6 - 6.8e-6


def kernel_launch_host_s(n_args: int) -> float:
    """Host seconds to launch one generated kernel with `n_args` tensor arguments (tritonbench
    #1017; what grows with the arguments is chiefly the binder's pointer query per tensor, so
    the schedule counts a launch's tensors, not its size arguments)."""
    return _LAUNCH_S_NO_ARGS + (_LAUNCH_S_19_ARGS - _LAUNCH_S_NO_ARGS) * n_args / 19


@dataclass(frozen=True)
class Launch:
    """Work the host issues between two ops of the trace: a generated kernel, or (kernel None)
    host work alone (a compiled graph's call)."""

    kernel: Kernel | None
    host: float                 # host seconds to issue it (each run)
    phase: str
    stream: int = 0
    runs: int = 1               # a repeated micro-batch's launches run that many times
    args: tuple = ()            # storage ids it reads or writes (dataflow with collectives)
    writes: tuple = ()          # storage ids it writes


@dataclass
class CompiledSchedule:
    """What the compiled regions add to a step's op list, for analysis/timing.py.

    launches: position in the step's ops -> Launches issued just before that op (the position
    len(ops): after the last op); host: position -> host seconds of an op the wrapper ran (in
    place of an eager op's)."""

    launches: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    cuda_graphs: bool = False

    def kernels(self) -> list:
        """(Kernel, runs) of every generated kernel launched."""
        return [(l.kernel, l.runs) for ls in self.launches.values() for l in ls
                if l.kernel is not None]


def generated_kernel(launch) -> Kernel:
    """The Kernel of one generated kernel's launch (capture.records.KernelLaunch)."""
    template = "_tem_" in launch.name  # inductor's template kernels: triton_tem_fused_mm_0
    return Kernel(launch.name, "matmul" if template else "other", launch.flops or 0,
                  launch.num_bytes or 0, launch.dtype)


def _phase(label: str) -> str:
    return BACKWARD if label.startswith("backward") else FORWARD


def _runs(trace: Trace, index: int) -> int:
    for first, end, runs in trace.repeated:
        if first <= index < end:
            return runs
    return 1


def compiled_schedule(trace: Trace, ops: list, options: dict) -> CompiledSchedule:
    """The launches and host costs of the compiled regions among `ops` (the step's analysis.ops.Op,
    in trace order); `options` the compile options (CompileOptions.to_dict())."""
    from ..devices.efficiency import HOST_OP_S
    from .op_classes import launches_kernel

    cuda_graphs = options.get("mode") == "reduce-overhead"
    indices = [op.record.index for op in ops]
    in_step = set(indices)

    def position(index: int) -> int:
        return bisect.bisect_left(indices, index)

    out = CompiledSchedule(cuda_graphs=cuda_graphs)
    calls = {}  # the compiled calls of this step: call number -> (label, start)
    items = []  # ((trace index, call number, order), Launch): the host issues them in this order
    for n, (label, start, end) in enumerate(trace.compiled_calls):
        if not ((start in in_step) if start < end else (start in in_step or start - 1 in in_step)):
            continue
        calls[n] = (label, start)
        items.append(((start, n, -1), Launch(None, GRAPH_CALL_S, _phase(label),
                                             runs=_runs(trace, start))))
        for i in range(position(start), position(end)):
            # an extern kernel is a dispatcher call without autograd: an eager op's host cost
            # (HOST_OP_S, an upper bound); the wrapper's C++ helpers are in the call's figure
            out.host[i] = HOST_OP_S if launches_kernel(ops[i].record.func) and not cuda_graphs \
                else 0.0
    for k, launch in enumerate(trace.kernel_launches):
        if launch.call not in calls:
            continue
        label, start = calls[launch.call]
        host = 0.0 if cuda_graphs else kernel_launch_host_s(len(launch.args))
        items.append(((launch.op, launch.call, k), Launch(
            generated_kernel(launch), host, _phase(label), launch.stream,
            _runs(trace, start), launch.args, launch.writes)))
    for (index, _, _), item in sorted(items, key=lambda x: x[0]):
        out.launches.setdefault(position(index), []).append(item)
    return out


def step_kernels(ops: list, schedule: CompiledSchedule | None = None) -> list:
    """(Kernel, runs) of every kernel a step launches: its ops' (eager, or extern kernels of a
    compiled wrapper) and, for a compiled step, the generated ones."""
    from .kernel_cost import kernel_of
    from .op_classes import launches_kernel

    out = [(kernel_of(op), op.runs) for op in ops if launches_kernel(op.record.func)]
    return out + (schedule.kernels() if schedule is not None else [])
