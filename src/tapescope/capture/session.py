"""Capture: run training steps of a fake copy of the model on a Tape and return the Trace.

Steps. Memory in the first step differs from later ones: the optimizer creates its state during the
first `optimizer.step()`. Step 2 is the steady state. Its forward and backward run exactly the ops of
step 1 when the step leaves the model as it found it (same tensors in the same storages), so we trace
forward and backward once and the optimizer step twice, and build step 2 from step 1's forward and
backward plus the second optimizer step. When the model changed (a cache built in the first forward,
parameters replaced), step 2 is traced in full. `Trace.step2` says which happened.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import DeviceError, TapescopeError, from_trace_failure
from .model import Spec, build_on_meta, fake_copy, fake_inputs, fake_tensor_like
from .modules import module_names, track_modules
from .optimizers import make_optimizer
from .records import (BACKWARD, BUFFER, FORWARD, GRADIENT, INPUT, OPTIMIZER, OPTIMIZER_STATE,
                      PARAMETER, Trace)
from .step import train_step
from .composites import RealTensorBranches
from .engine import PythonEngine
from .hooks import HookRegistry, SavedTensors
from .tape import Tape

__all__ = ["capture", "check_device", "LOSS_MODULE"]

LOSS_MODULE = "(loss)"  # the module name of ops computing the loss outside the model
DEFAULT_GPU = "h100"     # device="cuda" without a named GPU traces what an H100 would run
INTERNAL_GUARD = "<tapescope>"  # a guard tapescope's own code placed (structural, not the model's)


def check_device(device: torch.device) -> None:
    """Fail before tracing where torch itself would abort the process."""
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        # On a CPU-only build, any autograd op on a fake CUDA tensor aborts the process (SIGABRT
        # from AccumulateGrad): this check must come first.
        raise DeviceError(
            f"device='cuda' needs a CUDA build of PyTorch, and this one ({torch.__version__}) is "
            "CPU-only. A GPU is not needed, only the CUDA build: install one, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu128`, "
            "or profile with --device cpu.")
    if device.type not in ("cpu", "cuda", "meta"):
        raise DeviceError(f"unsupported device {device}; use cpu, cuda or meta")


def _tensors_fingerprint(model: nn.Module) -> tuple:
    """Which tensors the model holds and where they live; equal before and after a step unless the
    step replaced or added tensors."""
    out = []
    for mod in model.modules():
        for k, v in mod.__dict__.items():
            if isinstance(v, torch.Tensor):
                out.append((id(mod), k, id(v), v.untyped_storage()._cdata))
        for d in (mod._parameters, mod._buffers):
            for k, v in d.items():
                out.append((id(mod), k, id(v), None if v is None else v.untyped_storage()._cdata))
    return tuple(out)


ENGINES = ("python", "torch")


def autocast(device: torch.device, dtype: torch.dtype):
    """torch.autocast for the traced device, also for CUDA on a machine without a GPU.

    torch.autocast("cuda") switches itself off (with a warning) when no GPU is present; the
    dispatcher's autocast keys work on fake CUDA tensors all the same, so we enable it anyway.
    """
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx = torch.autocast(device.type, dtype=dtype)
    ctx._enabled = True
    return ctx


def _symbols(shape_env, names, inputs) -> tuple[dict, dict]:
    """One SymInt per named dimension, its hint the size the inputs give it (at least 2: the
    shape environment specialises sizes 0 and 1)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    found: dict[str, int] = {}
    for x in tree_leaves(inputs, is_leaf=lambda x: isinstance(x, Spec)):
        if isinstance(x, Spec):
            for size, name in zip(x.shape, x.dim_names()):
                if name in names:
                    found.setdefault(name, size)
    missing = [n for n in names if n not in found]
    if missing:
        raise TapescopeError(
            f"no input has a dimension named {', '.join(missing)}: name dimensions with "
            "tapescope.spec(shape, dims=('batch', 'seq', ...)) (zoo models name theirs)")
    sizes, hints = {}, {}
    for name, size in found.items():
        hint = max(size, 2)
        sym = shape_env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        sizes[name] = shape_env.create_symintnode(sym, hint=hint, source=ConstantSource(name))
        hints[name] = hint
    return sizes, hints


def _guards_name_user_lines(shape_env, tape: Tape) -> None:
    """Make every guard remember the model's source line that asked for it (ShapeEnv finds user
    frames only under dynamo). An instance attribute: no other ShapeEnv is affected."""
    from torch._guards import SLoc

    import sys

    original = shape_env._get_sloc
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    ours = tuple(os.path.join(_PACKAGE_DIR, d) + os.sep for d in ("capture", "analysis", "devices"))

    # frames that only pass an op through to the dispatcher: the guard belongs to their caller
    dispatch = tuple(os.path.join(_PACKAGE_DIR, "capture", f)
                     for f in ("tape.py", "replay.py", "composites.py"))

    def get_sloc(framework_loc=None):
        sloc = original(framework_loc)
        f = sys._getframe(1)
        while f is not None and (f.f_code.co_filename.startswith(torch_dir)
                                 or f.f_code.co_filename in dispatch):
            f = f.f_back
        if f is not None and f.f_code.co_filename.startswith(ours):
            return SLoc(sloc.framework_loc, INTERNAL_GUARD)  # our own bookkeeping asked
        frame = tape.user_frame()
        return SLoc(sloc.framework_loc, str(frame) if frame is not None else sloc.maybe_user_loc)

    shape_env._get_sloc = get_sloc


def _as_specs(inputs):
    """Tensors become Specs (dim 0 named "batch") so that a symbolic trace can size them."""

    def convert(x):
        if isinstance(x, torch.Tensor):
            return Spec(tuple(x.shape), x.dtype, None, x.requires_grad)
        return x

    return tree_map(convert, inputs, is_leaf=lambda x: isinstance(x, Spec))


@contextmanager
def _gpu_attention(gpu, counts: dict):
    """F.scaled_dot_product_attention as `gpu` would run it.

    The C++ composite picks its backend by asking the device (sdp_utils.cpp), which a fake CUDA
    tensor on a machine without a GPU cannot answer, so the trace would fall back to the math path.
    devices.sdpa applies the same rules to the named GPU's compute capability and issues the ops
    of the chosen backend. Patched on torch.nn.functional for the duration of the capture.
    """
    import torch.nn.functional as F

    from ..devices.sdpa import SdpaRequest, call_backend, choose_backend

    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        req = SdpaRequest.from_tensors(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                       enable_gqa)
        backend, _ = choose_backend(req, gpu.compute_capability)
        counts[backend] = counts.get(backend, 0) + 1
        return call_backend(backend, query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def capture(model, args=(), kwargs=None, *, loss_fn=None, optimizer="adamw", device="cpu",
            dtype=None, amp=None, steps: int = 2, engine: str = "python", forward_context=None,
            symbolic: tuple = (), gpu=None, progress=None) -> tuple[Trace, dict]:
    """Trace `steps` (1 or 2) training steps; returns the Trace and facts about the run.

    engine: "python" runs backward with tapescope's engine (capture.engine), which needs no GPU and
    decides like the C++ engine does for real tensors; "torch" calls loss.backward() (on a CUDA
    device this needs a GPU).
    """
    if engine not in ENGINES:
        raise TapescopeError(f"engine must be one of {ENGINES}, got {engine!r}")
    if amp is not None and forward_context is None:
        forward_context = lambda: autocast(device, amp)  # noqa: E731
    device = torch.device(device)
    check_device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # what fake CUDA tensors report
    if device.type == "cuda" and not hasattr(gpu, "compute_capability"):
        from ..devices.gpus import get_gpu

        try:
            gpu = get_gpu(gpu or DEFAULT_GPU)
        except ValueError as e:  # an unknown name: say which ones we know
            raise TapescopeError(str(e)) from None
    if steps not in (1, 2):
        raise TapescopeError(f"steps must be 1 (first step only) or 2 (steady state), got {steps}")
    kwargs = kwargs or {}
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TapescopeError(f"model must be an nn.Module or a function that builds one, "
                                 f"got {type(model).__name__}")
        model = build_on_meta(model)

    shape_env = None
    if symbolic:
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        shape_env = ShapeEnv(duck_shape=False)  # batch 8 and seq 8 stay two symbols
        args, kwargs = _as_specs((tuple(args), kwargs))
    tape = Tape(shape_env=shape_env)
    trace = tape.tape
    if shape_env is not None:
        _guards_name_user_lines(shape_env, tape)
    trace.device = device
    facts: dict = {}
    if gpu is not None:
        facts["gpu"] = gpu.key
    attention = _gpu_attention(gpu, facts.setdefault("sdpa_backends", {})) if device.type == "cuda" \
        else nullcontext()
    with tape, attention:
        fmodel = fake_copy(model, lambda t: fake_tensor_like(t, device, dtype))
        sizes = {}
        if symbolic:
            sizes, trace.hints = _symbols(shape_env, tuple(symbolic), (args, kwargs))
            trace.symbols = {name: s.node.expr for name, s in sizes.items()}
            trace.shape_env = shape_env
        fargs, fkwargs = fake_inputs((tuple(args), kwargs), device, dtype, sizes)
        names = module_names(fmodel)
        param_fqn = {}
        for fqn, p in fmodel.named_parameters(remove_duplicate=False):
            param_fqn.setdefault(id(p), fqn)
            sid = tape.register(p, fqn, PARAMETER)
            trace.storage_owner.setdefault(sid, fqn)
        for fqn, b in fmodel.named_buffers(remove_duplicate=False):
            trace.storage_owner.setdefault(tape.register(b, fqn, BUFFER), fqn)
        for i, t in enumerate(x for x in tree_leaves((fargs, fkwargs)) if isinstance(x, torch.Tensor)):
            tape.register(t, f"input{i}", INPUT)
        params = list(fmodel.parameters())
        facts["parameters"] = sum(p.numel() for p in params)
        opt = make_optimizer(optimizer, params, device)
        facts["optimizer"] = None if opt is None else _describe_optimizer(opt)

        saved = SavedTensors(tape)
        hooks = HookRegistry()

        def on_node(node):
            tape.tape_backward_node = node

        py_engine = PythonEngine(saved, hooks, on_node)

        def run_backward(loss):
            _name_forward_nodes(loss, trace)
            if engine == "python":
                py_engine.backward(loss)
            else:
                loss.backward()

        def mark_grads_and_state():
            for p in params:
                if p.grad is not None:
                    sid = tape.storage_id(p.grad)
                    if sid is not None:
                        trace.storages[sid].roles.add(GRADIENT)
                        trace.storage_owner.setdefault(sid, param_fqn.get(id(p), "?"))
            if opt is not None:
                for p, state in opt.state.items():
                    for t in tree_leaves(state):
                        if isinstance(t, torch.Tensor):
                            sid = tape.storage_id(t)
                            if sid is not None:
                                trace.storages[sid].roles.add(OPTIMIZER_STATE)
                                trace.storage_owner.setdefault(sid, param_fqn.get(id(p), "?"))

        @contextmanager
        def phase(step, name):
            with tape.phase(step, name):
                yield
            if name == BACKWARD:
                mark_grads_and_state()
            if progress is not None:
                progress(step, name)

        def zero_grad(step):
            with tape.phase(step, OPTIMIZER, "zero_grad"):
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    for p in params:
                        p.grad = None

        @contextmanager
        def in_loss():
            tape.tape_modules.append(LOSS_MODULE)
            try:
                yield
            finally:
                tape.tape_modules.pop()

        def one_step(step):
            train_step(fmodel, fargs, fkwargs, loss_fn, opt, step=step, phase=phase,
                       backward=run_backward, forward_context=forward_context or nullcontext,
                       loss_context=in_loss)
            mark_grads_and_state()

        try:
            with track_modules(tape.tape_modules, names), saved.active(), hooks.recording(), \
                    _quiet_fake_tensor_log(), RealTensorBranches() as branches:
                tape.tape_branches = branches
                before = _tensors_fingerprint(fmodel)
                inputs_gather_grads = any(isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
                                          for t in tree_leaves((fargs, fkwargs)))
                one_step(1)
                if steps == 2 and opt is not None:
                    opt_seg = trace.segments[-1]
                    # step 2 repeats step 1's forward and backward when the model kept its
                    # tensors and no input gathers a .grad (which step 2 would accumulate into)
                    if _tensors_fingerprint(fmodel) == before and not inputs_gather_grads \
                            and _self_contained(trace, opt_seg):
                        with phase(2, OPTIMIZER):
                            opt.step()
                        mark_grads_and_state()
                        zero_grad(2)
                        trace.step2 = "reused"
                    else:
                        zero_grad(1)
                        one_step(2)
                        zero_grad(2)
                        trace.step2 = "traced"
                else:
                    zero_grad(1)
        except TapescopeError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of user code becomes a message
            if _raised_by_tapescope(e):
                raise  # our bug, not the user's: keep the traceback
            raise from_trace_failure(e) from e
    return trace, facts


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ZOO_DIR = _PACKAGE_DIR + "zoo" + os.sep


def _raised_by_tapescope(e: BaseException) -> bool:
    """True if the innermost Python frame of the error is tapescope's own code (not the zoo)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return (last is not None and last.startswith(_PACKAGE_DIR) and not last.startswith(_ZOO_DIR)
            and getattr(e, "tapescope_op", None) is None)


@contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback when a meta kernel rejects its inputs (a shape mismatch in
    the user's model). We turn that error into a message; the log would only repeat it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _self_contained(trace: Trace, seg) -> bool:
    """True if a segment frees only storages it allocated itself (its temporaries)."""
    ops = seg.ops
    for i in seg.events:
        op, sid, delta = trace.events[i]
        if delta < 0:
            made = trace.storages[sid].created_by
            if made is None or made not in ops:
                return False
    return True


def _describe_optimizer(opt: torch.optim.Optimizer) -> dict:
    d = opt.defaults
    impl = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
    return {"name": type(opt).__name__, "implementation": impl}


def _name_forward_nodes(loss: torch.Tensor, trace: Trace) -> None:
    """Map seq_nr -> autograd node name for every node reachable from the loss."""
    fn = loss.grad_fn
    if fn is None:
        raise TapescopeError("the loss does not require grad: no parameter of the model took part in "
                             "computing it (are all parameters frozen, or is the forward under no_grad?)")
    seen, stack, names = set(), [fn], trace.node_names
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.setdefault(node._sequence_nr(), node.name())
        stack.extend(n for n, _ in node.next_functions)
