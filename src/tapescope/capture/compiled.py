"""The compiled step: torch.compile's own pipeline on fake tensors, its generated code run without
its kernels.

`torch.compile(model)` runs dynamo (Python bytecode -> FX graphs, graph breaks), AOTAutograd (the
joint forward+backward graph, functionalized, cut by the partitioner into a forward that returns
what the backward needs and a backward), and inductor (decomposition, fusion, scheduling, buffer
reuse, then a Python "wrapper" that allocates buffers, calls kernels and frees buffers). All of it
already works on fake tensors: dynamo and AOTAutograd trace with fake tensors by design, and inductor
only reads shapes. What needs real data is running the kernels.

So tapescope compiles for real, with the user's options, and then runs the generated wrapper on the
capture's fake tensors with its kernels replaced by no-ops. The step's memory then follows the
compiled code exactly as it runs: the wrapper's allocations (`empty_strided_*`), its buffer reuse
(`reinterpret_tensor(buf0, ...); del buf0  # reuse`), its `del`s, the extern kernels that allocate
their outputs (fallback aten ops run on fake tensors), the forward's outputs that AOTAutograd saves
for the backward (`ctx.save_for_backward`, through the capture's saved-tensor hooks), the compiled
backward's gradients, and everything eager around the compiled regions (the loss, graph breaks, the
optimizer), through the same Tape as an eager step.

What is replaced, and why each replacement changes no memory:
- kernel compilation (`AsyncCompile.cpp_pybinding` / `triton` / ...): a no-op callable per kernel.
  Generated kernels write into buffers the wrapper allocated; they allocate nothing the allocator
  sees (C++ kernels may use stack or thread-local scratch, triton kernels none).
- in the generated module only (a module inductor loads once per compile and never shares):
  `empty_strided_<device>` and `reinterpret_tensor` are C++ helpers that bypass the dispatcher, so
  a fake mode cannot see them; they become `torch.empty_strided` and `as_strided` with the same
  sizes, strides and offsets, which the Tape records like any allocation and view.
- caches: inductor's and AOTAutograd's caches are off while tapescope compiles, so a compiled
  artifact never crosses between a real and a fake compile.

Compiling is not the step's work: `compiling(..., unrecorded=...)` stops recording while dynamo
compiles (its compilation callbacks announce each compile, wherever it happens). What the runtime
around the generated code needs from the capture (saved tensors released by the compiled backward,
gradients handed over boxed, "the graph is not kept") lives in hooks.py and engine.py; see
docs/compile.md.

What is approximated is listed in `APPROXIMATIONS` (shown in reports).
"""

from __future__ import annotations

import re
import sys
import types
import uuid
from contextlib import ExitStack, contextmanager, redirect_stderr
from dataclasses import dataclass, field

import torch

from ..errors import DeviceError
from ..options import CompileOptions
from .gpu_less import NoDeviceGuard
from ..torch_compat import (INDUCTOR_KERNEL_COMPILERS, aot_autograd, compile_configs,
                            dynamo_callback_handler, dynamo_skip_frame, function_modes_suspended,
                            inductor_async_compile, inductor_compilers, inductor_mode_options,
                            patched)

__all__ = ["CompiledGraph", "CompileRecord", "GraphBreak", "compile_model", "compile_blocks",
           "compiling", "input_name", "trampoline", "user_compiles", "APPROXIMATIONS"]

APPROXIMATIONS = (
    "kernels are not run: a generated kernel allocates nothing the caching allocator sees",
    "max-autotune: autotuning benchmarks real kernels; tapescope keeps inductor's choices that need "
    "no benchmark (ATen/extern GEMMs), so a template GEMM chosen on real hardware is not shown",
    "pad_mm: a compute-bound matmul with unaligned sizes, which inductor pads when a benchmark on "
    "the device finds it faster, is left unpadded (its cheaper rules are inductor's own)",
    "reduce-overhead: CUDA graphs (their private memory pool, static input copies) are not modelled",
)


@dataclass
class CompiledGraph:
    """One graph AOTAutograd handed to the compiler: a forward or a backward, after partitioning."""

    kind: str                     # "forward" | "backward" | "inference"
    region: int                   # which dynamo graph (graph breaks make several)
    graph: torch.fx.GraphModule   # the partitioned graph as the compiler received it
    wrapper_code: str | None = None  # inductor's generated Python (None for aot_eager)


@dataclass
class CompileRecord:
    """What compiling the step produced: graphs, graph breaks, and dynamo's counters."""

    options: CompileOptions
    graphs: list = field(default_factory=list)       # CompiledGraph, in compile order
    breaks: list = field(default_factory=list)       # GraphBreak
    regions: int = 0
    # per region: what each dynamo graph input is ("c1.weight", "input 0"), by input position
    inputs: list = field(default_factory=list)

    @property
    def approximations(self) -> tuple:
        """What the compiled profile does not model (inductor's kernels are not run)."""
        return APPROXIMATIONS if self.options.backend == "inductor" else ()


@dataclass(frozen=True)
class GraphBreak:
    reason: str
    where: str | None


# ---- the kernels that are not run --------------------------------------------------------------


class _NoKernel:
    """Stands for a generated kernel: called with the buffers it would read and write; does
    nothing but tell `launched(kernel, args, stream)` (the Tape, while a graph's code runs).

    What the kernel would do is read from its source as inductor wrote it: `kernel_num_gb` and
    `kernel_flop` of its inductor_meta (inductor's estimate of the bytes its arguments load and
    store and of its FLOPs, written under `benchmark_kernel`; torch/_inductor/metrics.py reads
    `kernel_num_gb` back from the source the same way) and, from its signature, which
    arguments it stores to (inductor names them out_ptrN / in_out_ptrN, or lists them in
    `mutated_arg_names`)."""

    __slots__ = ("name", "source", "num_bytes", "flops", "writes", "launched")

    def __init__(self, source: str = "", name: str | None = None):
        self.name, self.source, self.launched = name, source, None
        self.num_bytes, self.flops, self.writes = _kernel_figures(source)

    def __call__(self, *args, **kwargs):  # C++ kernels are called
        if self.launched is not None:
            self.launched(self, args, 0)

    def run(self, *args, stream=None, **kwargs):  # triton kernels are launched with .run(...)
        if self.launched is not None:
            self.launched(self, args, stream)


_META_FIGURE = re.compile(r"'(kernel_num_gb|kernel_flop)':\s*([-+0-9.eE]+)")
_MUTATED = re.compile(r"'mutated_arg_names':\s*\[([^\]]*)\]")
_SIGNATURE = re.compile(r"^def \w+\(([^)]*)\)", re.M)


def _kernel_figures(source: str) -> tuple:
    """(bytes, FLOPs, positions of the arguments it stores to) of a generated kernel's source;
    None for a figure it does not state."""
    figures = {k: float(v) for k, v in _META_FIGURE.findall(source)}
    num_bytes = round(figures["kernel_num_gb"] * 1e9) if "kernel_num_gb" in figures else None
    flops = int(figures["kernel_flop"]) if "kernel_flop" in figures else None
    m = _SIGNATURE.search(source)
    params = [p.split(":")[0].strip() for p in m.group(1).split(",")
              if p.strip() and "constexpr" not in p] if m else []
    listed = _MUTATED.search(source)
    mutated = set(re.findall(r"'(\w+)'", listed.group(1))) if listed else set()
    writes = tuple(i for i, p in enumerate(params)
                   if p.startswith(("out_ptr", "in_out_ptr")) or p in mutated)
    return num_bytes, flops, writes


def _no_kernel(self, *args, **kwargs):
    # AsyncCompile.triton(kernel_name, source_code, ...), cpp_pybinding(argtypes, source_code)
    texts = [a for a in (*args, *kwargs.values()) if isinstance(a, str)]
    source = max(texts, key=len, default="")
    name = args[0] if args and isinstance(args[0], str) and args[0].isidentifier() else None
    return _NoKernel(source, name)


@contextmanager
def _kernels_not_compiled():
    """AsyncCompile's kernel compilers return no-op kernels while tapescope compiles.

    A class attribute of torch's, replaced for the duration of the compile and restored after
    (inductor offers no hook between generating a wrapper and compiling its kernels). Only
    compiles made inside this block are affected.
    """
    AsyncCompile = inductor_async_compile()
    with patched(AsyncCompile, **{name: _no_kernel for name in INDUCTOR_KERNEL_COMPILERS
                                  if name in AsyncCompile.__dict__}):
        yield


def _empty_strided(device_type: str):
    def empty_strided(size, stride, dtype, *args, **kwargs):
        device = args[0] if args and isinstance(args[0], (str, torch.device, int)) else device_type
        if isinstance(device, int):
            device = torch.device(device_type, device)
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty_strided


def _reinterpret_tensor(t, size, stride, offset_increment=0):
    # torch/csrc/inductor/inductor_ops.cpp: as_strided with the offset added to t's own
    return t.as_strided(size, stride, t.storage_offset() + offset_increment)


class _Delegate:
    """`target` with some attributes answered otherwise (a module seen from one generated module)."""

    def __init__(self, target, **overrides):
        self.__dict__.update(overrides, _target=target)

    def __getattr__(self, name):
        return getattr(self._target, name)


# inductor's CUDA wrapper selects the device and asks for its current stream before launching
# kernels (`with torch.cuda._DeviceGuard(0): torch.cuda.set_device(0)`,
# `get_raw_stream(0)`); no kernel runs, so the null stream and no device switch
_TORCH_WITHOUT_DEVICE = _Delegate(torch, cuda=_Delegate(
    torch.cuda, _DeviceGuard=NoDeviceGuard, set_device=lambda device: None))

def _copy_if_misaligned(t):
    # torch/csrc/dynamo/guards.cpp: a clone with t's strides if t.data_ptr() is not
    # GPU_ALIGN_BYTES (16) aligned. The caching allocator's blocks are 512-byte aligned, so a
    # fake tensor's address is aligned unless its storage offset is not (it has no data_ptr)
    if t.storage_offset() * t.element_size() % 16 == 0:
        return t
    needed = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.as_strided((needed,), (1,)).clone().as_strided(t.shape, t.stride())


_FAKE_FRIENDLY = {
    "copy_if_misaligned": _copy_if_misaligned,
    "get_raw_stream": lambda index: 0,
    "empty_strided_cpu": _empty_strided("cpu"),
    "empty_strided_cpu_pinned": _empty_strided("cpu"),
    "empty_strided_cuda": _empty_strided("cuda"),
    "empty_strided_xpu": _empty_strided("xpu"),
    "reinterpret_tensor": _reinterpret_tensor,
}


def _fake_friendly_module(compiled, on_call=None) -> str | None:
    """Point the generated wrapper's C++ helpers at dispatcher ops; returns its source.
    `on_call()` is a context entered around each run of the wrapper; what it yields is told of
    each kernel the run launches (`_NoKernel.launched`)."""
    fn = getattr(compiled, "current_callable", None)
    f = getattr(fn, "__func__", fn)
    g = getattr(f, "__globals__", None)
    kernels = [v for v in g.values() if isinstance(v, _NoKernel)] if g is not None else []
    if on_call is not None and fn is not None:
        run = fn

        def call(args):
            with on_call() as launched:
                for k in kernels:  # this module's own kernels: no other module shares them
                    k.launched = launched
                try:
                    return run(args)
                finally:
                    for k in kernels:
                        k.launched = None

        compiled.current_callable = call
    if g is None:
        return None
    for name, f in _FAKE_FRIENDLY.items():
        if name in g:
            g[name] = f
    # every wrapper, not only those that launch a Triton kernel: one made of extern kernels
    # alone (a lone Linear: `extern_kernels.addmm`) still enters `torch.cuda._DeviceGuard(0)`,
    # and a CPU wrapper never names torch.cuda (the delegate answers all else as torch does)
    if g.get("torch") is torch:
        g["torch"] = _TORCH_WITHOUT_DEVICE
    for name, v in g.items():
        if isinstance(v, _NoKernel):
            v.name = v.name or name
    return getattr(compiled, "source_code", None)


# ---- compiling --------------------------------------------------------------------------------


def _mode_patches(options: CompileOptions) -> dict:
    patches = dict(inductor_mode_options(options.mode, options.dynamic)) if options.mode else {}
    # CUDA graphs need a real device (and their pool is not modelled, see APPROXIMATIONS)
    patches["triton.cudagraphs"] = False
    if patches.get("max_autotune"):
        # autotuning times each GEMM/conv choice on the device (select_algorithm's benchmark);
        # with ATen as the only backend there is one choice and nothing to time: inductor keeps
        # the extern kernel, as it does when no template beats it (see APPROXIMATIONS)
        patches["max_autotune_gemm_backends"] = "ATEN"
        patches["max_autotune_conv_backends"] = "ATEN"
    # inductor's own estimate of each generated kernel's bytes and FLOPs (`kernel_num_gb`,
    # `kernel_flop` in the kernel's inductor_meta), which the compiled step's time is built from
    # (analysis/compiled_time.py); it adds benchmark code to kernel sources, never compiled here
    patches["benchmark_kernel"] = True
    return patches


def _make_backend(options: CompileOptions, record: CompileRecord, on_call=None, fqns=None):
    """A torch.compile backend: inductor (or AOTAutograd + default partitioner for aot_eager)
    recording the partitioned graphs and making the generated code fake-friendly.
    `on_call(label)` gives a context entered around each run of a compiled graph; `fqns` names
    the model's parameters and buffers by id (input_name).

    Each dynamo graph (a region) gets compilers of its own: AOTAutograd compiles a backward
    lazily, at its first run, when later regions may exist; the compilers it kept know which
    region the backward belongs to."""

    def note(kind, region, gm, code=None):
        g = CompiledGraph(kind, region, gm, code)
        record.graphs.append(g)
        return g

    def running(kind, region):
        if on_call is None:
            return None
        label = f"{kind} {region}"
        return lambda: on_call(label)

    def boxed(kind, region, gm):
        from functorch.compile import make_boxed_func

        note(kind, region, gm)
        fn = make_boxed_func(gm.forward)
        ctx = running(kind, region)
        if ctx is None:
            return fn

        def call(args):
            with ctx():
                return fn(args)

        call._boxed_call = True
        return call

    def new_region(gm) -> int:
        record.regions += 1
        record.inputs.append([input_name(n, fqns) for n in gm.graph.nodes
                              if n.op == "placeholder"])
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False):
            record.breaks.append(GraphBreak(str(reason.reason), _where(reason.user_stack)))
        return record.regions - 1

    if options.backend == "aot_eager":
        def backend(gm, example_inputs):
            region = new_region(gm)
            inner = aot_autograd(
                fw_compiler=lambda gm, ex: boxed("forward", region, gm),
                bw_compiler=lambda gm, ex: boxed("backward", region, gm),
                inference_compiler=lambda gm, ex: boxed("inference", region, gm))
            return inner(gm, example_inputs)

        return backend

    compile_fx, compile_fx_inner = inductor_compilers()
    BackendCompilerFailed, SkipFrame = dynamo_skip_frame()
    patches = _mode_patches(options)

    def backend(gm, example_inputs):
        region = new_region(gm)

        def inner_compile(gm, example_inputs, **kwargs):
            kind = "backward" if kwargs.get("is_backward") else (
                "inference" if kwargs.get("is_inference") else "forward")
            try:
                compiled = compile_fx_inner(gm, example_inputs, **kwargs)
            except BackendCompilerFailed as e:
                # inductor asks dynamo to run a frame eagerly with SkipFrame ("BF16 is not
                # supported" on a GPU before sm80, which Triton cannot compile bf16 for). The
                # user's compile then runs that frame, and each frame it calls, eagerly; the
                # eager profile is that step, so it is said rather than traced again here
                if isinstance(getattr(e, "inner_exception", None), SkipFrame):
                    raise DeviceError(
                        f"torch.compile cannot compile this step's {kind} graph for the named GPU "
                        f"(inductor: {e.inner_exception}) and runs it eagerly instead, with a "
                        "warning. Fix: profile without --compile (that is the step the GPU "
                        "runs), or use a dtype inductor compiles there (--amp fp16 below "
                        "sm80).") from None
                raise
            code = _fake_friendly_module(compiled, running(kind, region))
            note(kind, region, gm, code)
            return compiled

        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)

    return backend


@contextmanager
def compiling(options: CompileOptions, unrecorded=None):
    """The configuration a tapescope compile runs under: no caches, no compile workers, the
    partitioner's budget, and kernels that are generated but never compiled.

    unrecorded: a context (the Tape's) entered while torch.compile compiles, wherever that
    happens (a first call, the lazily compiled backward, a recompile): compiling is not the
    step's work. Dynamo announces each compile to its compilation callbacks."""
    functorch_config, inductor_config = compile_configs()

    # AOTAutograd checks on a compiled function's first call that custom ops do not alias their
    # inputs, under a dispatch mode that re-dispatches every op of the call; it allocates nothing
    # and would put a second mode around the Tape for that call
    functorch = {"check_custom_op_aliasing": False}
    if options.activation_memory_budget is not None:
        functorch["activation_memory_budget"] = options.activation_memory_budget
    with ExitStack() as stack:
        stack.enter_context(_quiet_compiler())
        stack.enter_context(patched(inductor_config, force_disable_caches=True,
                                    compile_threads=1))
        stack.enter_context(patched(functorch_config, **functorch))
        stack.enter_context(_kernels_not_compiled())
        if unrecorded is not None:
            stack.enter_context(_unrecorded_while_compiling(unrecorded))
        yield


def user_compiles(options: CompileOptions, record: CompileRecord, on_call=None):
    """The user's own `torch.compile` calls outside the model (a compiled loss: torchtitan's
    `--compile.components loss`) compiled by tapescope's backend too, as regions of `record`.

    Left to themselves they compile with inductor for real: the generated wrapper allocates its
    buffers with `empty_strided_cpu`, which bypasses the fake mode, so the loss came back a real
    tensor and backward stopped at "Please convert all Tensors to FakeTensors". torch.compile's
    default backend calls `torch._inductor.compile_fx.compile_fx` by name at each compile
    (`_TorchCompileInductorWrapper`), so that name answers with tapescope's backend while the
    step runs. Only such a call is taken: torch.compile's wrapper never passes `inner_compile`,
    and every other caller does (inductor's recursion through config patches, tapescope's own
    backend for the model), so those go to inductor's function as before. The user's mode
    options are the profile's (`options`): the backend applies those. Another backend a user
    names (aot_eager, eager) runs no kernel and needs nothing."""
    from ..torch_compat import inductor_compile_fx_module

    module = inductor_compile_fx_module()
    original = module.compile_fx
    backend = _make_backend(options, record, on_call)

    def compile_fx(model_, example_inputs_, *args, **kwargs):
        if args or "inner_compile" in kwargs:
            return original(model_, example_inputs_, *args, **kwargs)
        return backend(model_, example_inputs_)

    return patched(module, compile_fx=compile_fx)


@contextmanager
def _quiet_compiler():
    """What torch.compile says about tapescope's own settings (caches off, hence no profile-guided
    dynamic shapes) or its probing of the machine (no CUDA runtime) is not the user's business."""
    import logging
    import warnings

    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    stderr = _LinesDropped(sys.stderr, _COMPILER_CHATTER)
    try:
        with warnings.catch_warnings(), redirect_stderr(stderr):
            warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
            yield
    finally:
        stderr.flush()  # a last line without its newline yet
        log.setLevel(level)


# printed by inductor for each graph under `benchmark_kernel` (graph.py), which tapescope sets
_COMPILER_CHATTER = ("Compiled module path: ",)


class _LinesDropped:
    """A text stream that passes on every whole line but those starting with `prefixes`."""

    def __init__(self, stream, prefixes: tuple):
        self._stream, self._prefixes, self._line = stream, prefixes, ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            if not line.startswith(self._prefixes):
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._line and not self._line.startswith(self._prefixes):
            self._stream.write(self._line)
            self._line = ""
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def _unrecorded_while_compiling(unrecorded):
    callback_handler = dynamo_callback_handler()
    open_contexts: list = []

    def start(_args):
        ctx = unrecorded()
        ctx.__enter__()
        open_contexts.append(ctx)

    def end(_args):
        if open_contexts:
            open_contexts.pop().__exit__(None, None, None)

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)


def trampoline():
    """The function dynamo compiles: `model(*args, **kwargs)`, with a code object of its own.

    Dynamo keeps compiled code on the code object it entered, and remembers the sizes each code
    (by file, line and name) saw to make them dynamic on the next compile ("automatic dynamic").
    A fresh code object with a unique name per profile keeps two profiles (and the user's own
    compiles) from seeing each other's."""

    def run(model, *args, **kwargs):
        return model(*args, **kwargs)

    name = f"tapescope_step_{uuid.uuid4().hex[:12]}"
    code = run.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, run.__globals__, name)


_SOURCE_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_]\w*)")


def input_name(node: torch.fx.Node, fqns: dict | None = None) -> str:
    """What a dynamo graph input is: a parameter or buffer by its fully qualified name
    ("h.0.attn.c_attn.weight"), a step input by position ("input 0").

    fqns: id(tensor) -> name, the model's `named_parameters`/`named_buffers`: the names the
    user knows, also where a wrapper module sits on the path (checkpoint_wrapper's
    `_checkpoint_wrapped_module`, reached through its `__dict__`); else read from the source."""
    arg = node.meta.get("grapharg")
    known = (fqns or {}).get(id(getattr(arg, "example", None)))
    if known is not None:
        return known
    name = getattr(getattr(arg, "source", None), "name", None)
    if name is None:
        return node.name
    if callable(name):
        name = name()
    m = re.match(r"L\['args'\]\[(\d+)\]$", name)
    if m:
        return f"input {m.group(1)}"
    m = re.match(r"L\['(\w+)'\]$", name)  # a block's own argument (compile_blocks): by name
    if m and m.group(1) not in ("model", "self", "fn"):
        return f"input {m.group(1)}"
    m = re.match(r"L\['(model|self)'\]", name)
    if m:
        parts = [a or b for a, b in _SOURCE_PART.findall(name[m.end():])]
        return ".".join(parts)
    return name


def _where(user_stack) -> str | None:
    if not user_stack:
        return None
    f = user_stack[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def compile_model(model: torch.nn.Module, options: CompileOptions, record: CompileRecord,
                  on_call=None, fqns: dict | None = None):
    """`model` as `torch.compile(model, ...)` would run it, compiled by tapescope's backend.
    `on_call(label)`: a context entered around each run of a compiled graph ("forward 0");
    `fqns`: id(parameter or buffer) -> its name (default: the model's named_parameters/buffers)."""
    if fqns is None:
        fqns = {id(t): name for named in (model.named_parameters(remove_duplicate=False),
                                          model.named_buffers(remove_duplicate=False))
                for name, t in named}
    backend = _make_backend(options, record, on_call, fqns)
    fn = torch.compile(trampoline(), backend=backend, fullgraph=options.fullgraph,
                       dynamic=options.dynamic)

    def forward(*args, **kwargs):
        with function_modes_suspended():
            return fn(model, *args, **kwargs)

    return forward


def compile_blocks(blocks, options: CompileOptions, record: CompileRecord, on_call=None,
                   fqns: dict | None = None) -> None:
    """Each module of `blocks` compiled on its own, in place, as torchtitan's `apply_compile`
    does inside a parallelize function (`block.compile(fullgraph=True)`, every transformer
    block, after tensor parallelism and checkpointing, before FSDP2 wraps it).

    `Module.compile` routes the module's calls through `torch.compile(self._call_impl)`; here
    the call goes through one fresh trampoline per profile (see `trampoline`), so the blocks
    share one compiled graph as they share one `_call_impl` in torch (their parameters are graph
    inputs), and nothing is shared with another profile. FSDP2's hooks around a block are not
    traced (dynamo's `skip_fsdp_hooks`): they run eagerly, with their collectives recorded."""
    backend = _make_backend(options, record, on_call, fqns)
    fn = torch.compile(trampoline(), backend=backend, fullgraph=options.fullgraph,
                       dynamic=options.dynamic)
    for block in blocks:
        def call(*args, _impl=block._call_impl, **kwargs):
            with function_modes_suspended():
                return fn(_impl, *args, **kwargs)

        block._compiled_call_impl = call
