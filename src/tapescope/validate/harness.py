"""`tapescope validate`: predict a step, run it for real on the device present, compare.

Measured, on CPU: the allocator's peak bytes of the first and the steady step (torch.profiler memory
events, validate.real) and the median wall time of steady steps. On CUDA: max_memory_allocated and
max_memory_reserved over warm-up and steps (and after a peak reset, over the steady steps alone),
the median step time between synchronisations, and whether the op sequence a GPU-less trace
predicted is the op sequence the GPU ran (torch.profiler, outermost dispatched ops).
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..analysis.ops import expanded_ops
from ..capture.model import real_inputs
from ..capture.program import BuiltinStep, StepRuntime, UserStep
from .real import _build, run_real_steps

__all__ = ["Validation", "validate", "same_ops"]


@dataclass
class Validation:
    model: str
    device: str
    gpu: str | None
    rows: list = field(default_factory=list)     # (quantity, predicted, measured)
    ops_match: bool | None = None
    ops_diff: list = field(default_factory=list)
    torch_version: str = torch.__version__

    def error(self, quantity: str) -> float | None:
        for q, p, m in self.rows:
            if q == quantity and p is not None and m:
                return (p - m) / m
        return None


def _repeats(count: int) -> str:
    return f"(the micro-batch before, {count} more times)"


def real_op_names(real, step: int) -> list[str]:
    """The real step's ops as "phase aten.name", a run of micro-batches read as repeats of the
    one before (validate/real.py _Sessions) as one line saying how many; the last micro-batch,
    read in full, is folded into it when it repeats it too."""
    at = {k: n for s, k, n in real.repeated if s == step}
    out, block = [], 0
    for k, (s, ph, name) in enumerate(real.ops + [(None, None, None)]):
        if k in at:
            # the micro-batch before: from its forward's start (the ops are in order)
            j = len(out)
            while j > 0 and not out[j - 1].startswith("forward"):
                j -= 1
            while j > 0 and out[j - 1].startswith("forward"):
                j -= 1
            block = len(out) - j
            out.append(_repeats(at[k]))
        if s == step and ph:
            out.append(f"{ph} {name.replace('::', '.')}")
    # fold the last micro-batch (read in full) into the count when it repeats the block
    for i, line in enumerate(out):
        if line.startswith("(the micro-batch before") and block:
            before, after = out[i - block:i], out[i + 1:i + 1 + block]
            if before == after:
                n = int(line.split(", ")[1].split()[0])
                out[i:i + 1 + block] = [_repeats(n + 1)]
            break
    return out


def same_ops(profile, real_names: list[str]) -> tuple[bool, list[str]]:
    """Compare a profile's op sequence with the profiler's (names without overload). Known naming
    differences are normalised: reshape takes `view` for tensor subclasses where real tensors take
    `_reshape_alias`, and the clone an in-place op's autograd kernel makes is nested inside that op
    in the profiler. Where the real names count a run of repeated micro-batches in one line
    (`real_op_names`), the profile's repeated micro-batch is written the same way."""
    import difflib

    collapsed = any(n.startswith("(the micro-batch before") for n in real_names)
    # a repeated micro-batch as often as it ran, or once and a count like the real names
    ops = _collapsed_ops(profile.ops) if collapsed else expanded_ops(profile.ops)
    fake = []
    for i, op in enumerate(ops):
        if isinstance(op, str):
            fake.append(op)
            continue
        nxt = ops[i + 1] if i + 1 < len(ops) and not isinstance(ops[i + 1], str) else None
        if (op.name == "aten.clone.default" and nxt is not None
                and nxt.name.split(".")[1].endswith("_")   # an in-place op: div_.Tensor, add_...
                and nxt.inputs and op.inputs and nxt.inputs[0].value == op.inputs[0].value):
            continue
        fake.append(f"{op.phase} {op.name.rsplit('.', 1)[0]}")
    real = [n.replace("aten._reshape_alias", "aten.view") for n in real_names]
    diff = [d for d in difflib.unified_diff(real, fake, "measured", "predicted", lineterm="", n=0)
            if not d.startswith(("---", "+++", "@@"))]
    return not diff, diff[:20]


def _collapsed_ops(ops: list) -> list:
    """The step's ops with each repeated micro-batch once, then a line with how many more times
    it ran (expanded_ops's blocks, not expanded)."""
    out, k = [], 0
    while k < len(ops):
        op = ops[k]
        if op.runs == 1:
            out.append(op)
            k += 1
            continue
        end = k + 1
        while (end < len(ops) and ops[end].runs == op.runs
               and ops[end].record.index == ops[end - 1].record.index + 1):
            end += 1
        out += ops[k:end] + [_repeats(op.runs - 1)]
        k = end
    return out


def _time_steps(build, inputs, input_kwargs, loss_fn, optimizer, device, dtype, warmup, steps,
                amp=None, accumulate=1, step=None, setup=None):
    device = torch.device(device)
    m = _build(build, device, dtype)
    args, kwargs = real_inputs((tuple(inputs), input_kwargs or {}), device, dtype,
                               torch.Generator().manual_seed(0))
    program = UserStep(step, setup, optimizer) if step is not None else \
        BuiltinStep(loss_fn, optimizer, accumulate)
    opt = program.setup(m, list(m.parameters()), device)
    runtime = StepRuntime(phase=lambda step, name: nullcontext())
    if amp is not None:
        runtime.forward_context = lambda: torch.autocast(device.type, dtype=amp)
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
            if i == warmup:
                torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        program.run(m, args, kwargs, opt, i + 1, runtime)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    out = {"time": statistics.median(times)}
    if cuda:
        out["steady_allocated"] = torch.cuda.max_memory_allocated()
        out["steady_reserved"] = torch.cuda.max_memory_reserved()
    return out


def validate(model, *inputs, loss_fn=None, input_kwargs=None, optimizer="adamw", device=None,
             dtype=None, amp=None, warmup: int = 2, steps: int = 5, name: str | None = None,
             gpu=None, accumulate: int = 1, progress=None, stage=None, step=None,
             setup=None) -> Validation:
    """Profile the step, run it for real on `device` (default: the GPU if there is one, else the
    CPU) and compare. Quantities are bytes, except "step time" (seconds). `progress(step,
    phase)` is told of each traced phase, `stage(message)` of each part begun. step, setup:
    the user's own step and setup, as profile() takes them (functions or FILE.py:FN)."""
    from ..api import profile
    from ..capture.model import model_of
    from ..errors import DeviceError, TapescopeError
    from ..losses import resolve_loss
    from ..options import Options

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    options = Options.create(loss_fn=loss_fn, optimizer=optimizer, device=device, dtype=dtype,
                             amp=amp, gpu=gpu, step=step, setup=setup)
    step, setup = options.step, options.setup  # functions, loaded once
    loss_fn, dtype, amp, dev = resolve_loss(loss_fn), options.dtype, options.amp, options.device
    if dev.type == "meta":
        raise DeviceError("validate runs the step for real: use --device cpu or cuda, not meta")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError("validate runs the step for real, and this machine has no usable CUDA "
                          "GPU (torch.cuda.is_available() is False): validate on --device cpu, or "
                          "profile --device cuda to predict the GPU's step without one")
    if warmup < 0 or steps < 1:
        raise TapescopeError(f"validate needs --warmup >= 0 and --steps >= 1, got {warmup} and {steps}")
    if dev.type == "cuda" and gpu is None:
        from ..devices.gpus import resolve_gpu_key

        gpu = resolve_gpu_key(torch.cuda.get_device_name())
    stage = stage or (lambda message: None)
    stage("predicting the step on fake tensors")
    p = profile(model_of(model), *inputs,
                loss_fn=loss_fn, input_kwargs=input_kwargs, optimizer=optimizer, device=device,
                dtype=dtype, amp=amp, name=name, gpu=gpu, accumulate=accumulate,
                progress=progress, step=step, setup=setup)
    stage(f"running 2 real steps on {dev.type} under the profiler")
    v = Validation(p.model, str(dev), gpu)
    if dev.type == "cpu":
        real = run_real_steps(model, inputs, input_kwargs, loss_fn=loss_fn, optimizer=optimizer,
                              device=dev, dtype=dtype, amp=amp, accumulate=accumulate, step=step,
                              setup=setup)
        v.rows += [("first-step peak bytes", p.first_step_peak_bytes, real.peaks.get(1)),
                   ("steady peak bytes", p.peak_bytes, real.peaks.get(2))]
        v.ops_match, v.ops_diff = same_ops(p, real_op_names(real, 2))
        stage(f"timing {warmup} + {steps} real steps")
        t = _time_steps(model, inputs, input_kwargs, loss_fn, optimizer, dev, dtype, warmup, steps, amp,
                        accumulate, step, setup)
        v.rows.append(("step time", None, t["time"]))
        return v
    # CUDA: a real GPU is present
    real = run_real_steps(model, inputs, input_kwargs, loss_fn=loss_fn, optimizer=optimizer,
                          device=dev, dtype=dtype, amp=amp, accumulate=accumulate, step=step,
                          setup=setup)
    v.ops_match, v.ops_diff = same_ops(p, real_op_names(real, 2))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    stage(f"timing {warmup} + {steps} real steps")
    t = _time_steps(model, inputs, input_kwargs, loss_fn, optimizer, dev, dtype, warmup, steps, amp,
                    accumulate, step, setup)
    cm = p.cuda_memory
    v.rows += [("steady peak bytes (tensors)", p.peak_bytes, real.peaks.get(2)),
               ("max_memory_allocated (steady)", cm.steady_allocated, t["steady_allocated"]),
               ("max_memory_reserved (steady)", cm.steady_reserved, t["steady_reserved"]),
               ("step time", p.time.seconds, t["time"])]
    return v
