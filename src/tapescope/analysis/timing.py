"""Step time on a named GPU: a roofline per op, and the host that launches the ops in eager mode.

Each op that launches a kernel takes max(FLOPs / (peak FLOP/s x compute efficiency),
bytes moved / (bandwidth x memory efficiency)) plus a kernel overhead. The peak is the tensor-core
rate of the op's dtype for matmuls, convolutions and attention (fp32 matmuls run on CUDA cores:
torch.backends.cuda.matmul.allow_tf32 is off by default; convolutions use TF32: cudnn.allow_tf32 is
on), the vector rate otherwise. Small kernels cannot fill the GPU: their efficiency falls off below
the class's saturation size. Views and metadata ops launch nothing.

The host issues ops one after another (eager PyTorch) and the GPU runs them in order on one stream,
starting each when the host has launched it and the previous one has finished; a read of a GPU value
on the host (`.item()`) waits for the GPU. The step takes until both are done, so a step of many
small ops is host-bound, as real eager steps are.

Collectives of a distributed step (`comm`: op -> seconds on the interconnect, from
analysis.collectives) run on a communication stream of their own, as NCCL kernels do on the
streams FSDP2 and c10d give them: a collective starts when the host has issued it, the stream is
free and the ops that wrote its inputs are done; an op that reads what a collective wrote waits
for it. So FSDP2's prefetched all-gathers overlap the compute before them, and a tensor-parallel
all-reduce whose output the next op needs is exposed. `exposed_comm` is the time compute waited
on collectives; `comm_overlap` the share of communication hidden behind compute. (NCCL kernels
also take SMs from the compute they overlap; not modelled.)

Constants come from devices.efficiency (priors until measured on a GPU; the result says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..capture.records import Trace
from ..devices.efficiency import HOST_OP_S, HOST_VIEW_S, KERNEL_OVERHEAD_S, efficiency_for
from .op_classes import launches_kernel, op_class

__all__ = ["StepTime", "estimate_step_time"]

_TENSOR_CORE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8",
                torch.float8_e5m2: "fp8"}
_ITEM = torch.ops.aten._local_scalar_dense


def _peak(gpu, cls: str, dtype) -> float:
    if cls != "other" and dtype in _TENSOR_CORE and gpu.peak(_TENSOR_CORE[dtype]):
        return gpu.peak(_TENSOR_CORE[dtype])
    if cls == "convolution" and dtype == torch.float32 and gpu.peak("tf32"):
        return gpu.peak("tf32")
    return gpu.peak("fp32")


@dataclass
class StepTime:
    seconds: float
    gpu_busy: float                 # sum of kernel times
    host: float                     # host time to issue the step's ops
    by_phase: dict                  # phase -> seconds of the step's wall time
    op_seconds: list = field(repr=False, default_factory=list)   # per op, GPU time
    mfu: float = 0.0
    calibrated: bool = False
    bound: str = ""                 # "gpu", or "host" when the GPU idles half the step or more
    recompute: float = 0.0          # GPU seconds of ops recomputed by activation checkpointing
    comm: float = 0.0               # seconds of collectives on the interconnect
    exposed_comm: float = 0.0       # seconds compute waited for collectives

    @property
    def comm_overlap(self) -> float:
        """Share of the collectives' time hidden behind compute (1 without collectives)."""
        return 1.0 - self.exposed_comm / self.comm if self.comm else 1.0

    def to_dict(self) -> dict:
        d = {"seconds": self.seconds, "gpu_busy": self.gpu_busy, "host": self.host,
             "by_phase": self.by_phase, "mfu": self.mfu, "calibrated": self.calibrated,
             "bound": self.bound, "recompute": self.recompute}
        if self.comm:
            d.update(comm=self.comm, exposed_comm=self.exposed_comm,
                     comm_overlap=self.comm_overlap)
        return d


def estimate_step_time(ops: list, trace: Trace, gpu, comm: dict | None = None) -> StepTime:
    """Wall time of a step's ops (analysis.ops.Op, in order) on `gpu` (a devices.gpus.GPU).

    comm: op index (in the step) -> seconds of that collective on the interconnect."""
    comm = comm or {}
    comm_t = comm_total = exposed = 0.0
    ready: dict = {}     # storage -> when the collective that last wrote it is done
    written: dict = {}   # storage -> when the compute op that last wrote it is done
    host = gpu_t = busy = recompute = 0.0
    calibrated = True
    op_seconds = []
    phase_end: dict = {}
    model_dtype = None
    total_flops = 0
    storages = trace.storages
    for op in ops:
        func = op.record.func
        kernel = launches_kernel(func)
        host += HOST_OP_S if kernel else HOST_VIEW_S
        t = 0.0
        total_flops += op.flops or 0
        c = comm.get(op.index)
        if c is not None:
            start = max(comm_t, host, *(written.get(r.storage, 0.0) for r in op.inputs))
            comm_t = start + c
            comm_total += c
            for r in op.outputs:
                ready[r.storage] = comm_t
            op_seconds.append(0.0)
            phase_end[op.phase] = max(gpu_t, host, comm_t)
            continue
        if kernel:
            cls = op_class(func)
            eff = efficiency_for(cls, gpu.key)
            calibrated &= eff.gpu is not None
            dtype = (op.inputs[0].dtype if op.inputs else
                     op.outputs[0].dtype if op.outputs else torch.float32)
            if cls == "matmul" and model_dtype is None:
                model_dtype = dtype
            flops = op.flops or 0
            fill = min(1.0, flops / eff.saturation_flops) if flops else 1.0
            compute = flops / (_peak(gpu, cls, dtype) * eff.compute * max(fill, 0.05)) if flops else 0.0
            memory = (op.bytes_read + op.bytes_written) / (gpu.memory_bandwidth * eff.memory)
            t = max(compute, memory) + KERNEL_OVERHEAD_S
            start = max(gpu_t, host)
            if ready:
                waits = max((ready.get(r.storage, 0.0) for r in op.inputs), default=0.0)
                if waits > start:
                    exposed += waits - start
                    start = waits
            gpu_t = start + t
            busy += t
            if op.recompute:
                recompute += t
            if comm:
                for r in op.outputs:
                    written[r.storage] = gpu_t
        if func.overloadpacket is _ITEM and op.inputs and op.inputs[0].storage >= 0 \
                and storages[op.inputs[0].storage].device.type == "cuda":
            host = max(host, gpu_t)  # .item() waits for the GPU
        op_seconds.append(t)
        phase_end[op.phase] = max(gpu_t, host)
    total = max(gpu_t, host, comm_t)
    by_phase, start = {}, 0.0
    for phase in ("forward", "backward", "optimizer"):
        if phase in phase_end:
            by_phase[phase] = phase_end[phase] - start
            start = phase_end[phase]
    peak = gpu.peak(_TENSOR_CORE.get(model_dtype, "fp32")) or gpu.peak("fp32")
    mfu = (total_flops / total / peak) if total and peak else 0.0
    # host-bound: the GPU waits for launches more than half the step
    return StepTime(total, busy, host, by_phase, op_seconds, mfu, calibrated,
                    "gpu" if busy >= total / 2 else "host", recompute, comm_total, exposed)
