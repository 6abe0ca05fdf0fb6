"""What to trace and how: one `Workload` (the model and its inputs) and one `Options` value.

The API (`tapescope.profile`) and the CLI both build these once, with every name resolved and every
value checked (a GPU name becomes its catalogue entry, "bf16" becomes torch.bfloat16, an unknown
device is refused with a message), and pass them on as single values: capture and analysis never
see raw keyword arguments. A new capability (checkpointing, a device mesh, compile, gradient
accumulation) adds its field here, its check in `Options.create`, and reads it where it acts.
"""

from __future__ import annotations

import importlib.util

import os
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from .errors import DeviceError, TapescopeError

# torchao float8 training recipes the presets apply (capture/float8.py)
FLOAT8_RECIPES = ("tensorwise", "rowwise")

if TYPE_CHECKING:  # the resolved values' types (imported where resolved: options stay light)
    from .devices.calibration import Calibration
    from .devices.cpu import CpuTarget
    from .devices.gpus import GPU
    from .values.allocator import AllocatorConfig
    from .values.checkpointing import UnitPolicy
    from .values.mesh import MeshSpec
    from .values.pipeline import PipelineSpec
    from .values.sizes import Sizes

__all__ = ["Workload", "Options", "CompileOptions", "ENGINES", "DEFAULT_GPU", "resolve_device",
           "resolve_dtype", "check_device_build", "unbuilt_device_types"]

ENGINES = ("python", "torch")
DEFAULT_GPU = "h100"     # device="cuda" without a named GPU traces what an H100 would run
_DEVICE_TYPES = ("cpu", "cuda", "meta")

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8,
}


def resolve_dtype(d) -> torch.dtype | None:
    """None, a torch.dtype, or a name such as "bf16" -> torch.dtype (ValueError if unknown)."""
    if d is None or isinstance(d, torch.dtype):
        return d
    try:
        return _DTYPES[str(d).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {d!r}; use one of {', '.join(sorted(_DTYPES))}") from None


def resolve_device(device, gpu=None) -> torch.device:
    """The one device policy of the API and the CLI: naming a GPU means tracing what it runs
    (device cuda) unless a device is given explicitly; else the CPU."""
    if device is None:
        device = "cuda" if gpu is not None else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"unknown device {device!r}; use cpu, cuda or meta") from None
    if dev.type not in _DEVICE_TYPES:
        raise DeviceError(f"unsupported device {dev}; use cpu, cuda or meta")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)  # what fake CUDA tensors report
    return dev


def unbuilt_device_types() -> frozenset:
    """Device types this torch build has no backend for (fake tensors of them abort the process
    as soon as autograd records an op on them)."""
    return frozenset() if torch.backends.cuda.is_built() else frozenset({"cuda"})


def check_device_build(device: torch.device, what: str = "device='cuda'") -> None:
    """Fail before tracing where torch itself would abort the process."""
    if device.type in unbuilt_device_types():
        # On a CPU-only build, any autograd op on a fake CUDA tensor aborts the process (SIGABRT
        # from AccumulateGrad): this check must come first.
        raise DeviceError(
            f"{what} needs a CUDA build of PyTorch, and this one ({torch.__version__}) is "
            "CPU-only. A GPU is not needed, only the CUDA build: install one, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu128`, "
            "or profile with --device cpu.")


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager")


@dataclass(frozen=True)
class CompileOptions:
    """How the user compiles the step (`torch.compile` arguments and the partitioner's budget).

    backend: "inductor" (torch.compile's default) or "aot_eager" (AOTAutograd's joint graph and the
        default partitioner, no inductor: the graphs `aot_autograd(fw_compiler=...)` prints).
    activation_memory_budget: functorch's `activation_memory_budget` (0..1): the share of the
        activations the min-cut partitioner may save; less budget, more recomputation.
    optimizer: also compile `optimizer.step` (`torch.compile(opt.step)`); else it runs eagerly.
        Not modelled yet (refused with the reason): dynamo creates the state while compiling.
    """

    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str = "inductor"
    activation_memory_budget: float | None = None
    optimizer: bool = False

    def __post_init__(self):
        if self.mode not in COMPILE_MODES:
            raise TapescopeError(f"compile mode {self.mode!r} is not one of torch.compile's: "
                                 f"{', '.join(m for m in COMPILE_MODES if m)}")
        if self.backend not in COMPILE_BACKENDS:
            raise TapescopeError(f"compile backend {self.backend!r}: use one of {', '.join(COMPILE_BACKENDS)}")
        b = self.activation_memory_budget
        if b is not None and not 0 <= b <= 1:
            raise TapescopeError(f"activation_memory_budget must be in [0, 1], got {b}")

    @classmethod
    def of(cls, x) -> "CompileOptions | None":
        """None/False -> None; True -> defaults; a dict or CompileOptions -> CompileOptions."""
        if x is None or x is False:
            return None
        if x is True:
            return cls()
        if isinstance(x, cls):
            return x
        if isinstance(x, dict):
            unknown = set(x) - set(cls.__dataclass_fields__)
            if unknown:
                raise TapescopeError(f"unknown compile option(s) {', '.join(sorted(unknown))}; "
                                     f"known: {', '.join(cls.__dataclass_fields__)}")
            return cls(**x)
        raise TapescopeError(f"compile must be True, a dict of options or CompileOptions, got {x!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    """The model and its inputs, as the user gave them (never modified).

    model: an nn.Module on any device (meta included) or a function that builds one.
    args / kwargs: tensors (real or meta) or `tapescope.spec(...)`, in any nest of containers.
    """

    model: torch.nn.Module | Callable[[], torch.nn.Module]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    name: str | None = None

    @property
    def display_name(self) -> str:
        if self.name:
            return self.name
        if isinstance(self.model, torch.nn.Module):
            return type(self.model).__name__
        return getattr(self.model, "__name__", type(self.model).__name__)


@dataclass(frozen=True)
class Options:
    """How the step is run and traced. Build with `Options.create(...)`, which checks and resolves.

    loss_fn: `loss_fn(output, *inputs) -> scalar`, or a name (losses.py: "sum", "mean",
        "cross-entropy", "file.py:fn", "module:fn"); None: see losses.default_loss.
    optimizer: "sgd", "adam", "adamw", an Optimizer class, a function params -> optimizer, or None.
    device: the device whose kernels and autograd formulas are traced (cpu, cuda, meta).
    gpu: for cuda, the catalogue GPU (devices.gpus.GPU) whose kernel choices are followed.
    dtype: cast floating-point parameters and inputs; amp: autocast dtype for forward and loss.
    steps: 1 (first step) or 2 (steady state, optimizer state alive).
    accumulate: micro-batches per optimizer step (gradient accumulation; capture.step).
    engine: "python" (tapescope's autograd engine; no GPU needed) or "torch" (loss.backward()).
    symbolic: names of input dimensions to keep symbolic ("batch", "seq").
    sizes: what data-dependent sizes are assumed to be (capture.data_values.Sizes: the routing of
        a mixture of experts, the fraction a boolean mask keeps).
    alloc_conf: the CUDA caching allocator's settings (values.allocator.AllocatorConfig) for the
        predicted torch.cuda figures; by default read from the environment as torch reads it
        (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF).
    checkpointing: activation checkpointing applied to the traced copy of the model (a tuple of
        values.checkpointing.UnitPolicy: module fqn and mode), as a plan would apply it.
    compile: the step as `torch.compile(model, ...)` runs it (CompileOptions), or None (eager).
    cpu: the CPU whose kernels a cpu profile follows (devices.cpu.CpuTarget: the vector ISA
        oneDNN dispatches on and the intra-op threads it sizes per-thread buffers for); by
        default this machine's, or the `cpu_isa` / `threads` given to `create`.
    step: the user's own training step, `fn(model, batch, optimizer)`, run as written instead of
        the built-in one (capture/program.py); setup: `fn(model) -> state`, run once before step
        1, its result handed to `step` in place of the optimizer (several optimizers, a
        scheduler, an EMA's weights).
    mesh: a distributed job's device mesh (values.mesh.MeshSpec: dimension names and sizes);
        every rank is profiled. parallelize: `fn(model, device_mesh) -> model`, the user's
        torch.distributed code applied to each simulated rank's model (to each of its pipeline
        stages when pipelined).
    pipeline: pipeline parallelism over the mesh's "pp" dimension (values.pipeline.PipelineSpec:
        schedule, micro-batches, split); None without one.
    calibration: what `tapescope calibrate` measured on a GPU of the kind `gpu` names
        (devices.calibration.Calibration): the step time is priced from it. Given as a file, or
        read from TAPESCOPE_CALIBRATION for CUDA profiles; a given file with no GPU named makes
        the profile one of the file's GPU.
    float8: "tensorwise" or "rowwise": the model's Linears trained in float8 as torchtitan's
        converter swaps them (capture/float8.py); None without.
    """

    loss_fn: Callable | None = None
    optimizer: str | type | Callable | None = "adamw"
    device: torch.device = torch.device("cpu")
    gpu: GPU | None = None
    dtype: torch.dtype | None = None
    amp: torch.dtype | None = None
    steps: int = 2
    accumulate: int = 1
    engine: str = "python"
    symbolic: tuple[str, ...] = ()
    alloc_conf: AllocatorConfig | None = None
    checkpointing: tuple[UnitPolicy, ...] = ()
    compile: CompileOptions | None = None
    cpu: CpuTarget | None = None
    mesh: MeshSpec | None = None
    parallelize: Callable | None = None
    sizes: Sizes | None = None
    step: Callable | None = None
    setup: Callable | None = None
    pipeline: PipelineSpec | None = None
    calibration: Calibration | None = None
    float8: str | None = None

    @classmethod
    def create(cls, *, loss_fn: Callable | str | None = None,
               optimizer: str | type | Callable | None = "adamw",
               device: str | torch.device | None = None, gpu: str | GPU | None = None,
               dtype: str | torch.dtype | None = None, amp: str | torch.dtype | None = None,
               steps: int = 2, accumulate: int = 1, engine: str = "python",
               symbolic: str | tuple = (), alloc_conf: str | AllocatorConfig | None = None,
               checkpointing: list | tuple = (),
               compile: bool | dict | CompileOptions | None = None, threads: int | None = None,
               cpu_isa: str | None = None, mesh: dict | MeshSpec | None = None,
               parallelize: Callable | None = None, sizes: Sizes | dict | None = None,
               step: Callable | str | None = None, setup: Callable | str | None = None,
               pipeline: str | dict | PipelineSpec | None = None,
               calibration: str | Calibration | None = None,
               float8: str | None = None) -> "Options":
        """Check and resolve every option (declared in option_table.py); a bad one raises a
        TapescopeError that says why. The checks run in this order, the first failing one
        speaks: what runs the step (device, GPU, calibration), precision, the optimizer and
        the counts, compile, the CPU target, parallelism, the user's own step."""
        from .losses import resolve_loss
        from .values.sizes import Sizes

        loss_fn = resolve_loss(loss_fn)
        dev, gpu_entry, calibration = _resolve_target(device, gpu, calibration)
        dtype, amp = _resolve_precision(dtype, amp)
        _check_optimizer(optimizer)
        _check_counts(steps, accumulate, engine)
        symbolic = (symbolic,) if isinstance(symbolic, str) else tuple(symbolic or ())
        compile = _resolve_compile(compile, dev, symbolic)
        _check_cpu_target(cpu_isa, threads, dev)
        pipeline = _resolve_pipeline(pipeline, mesh, accumulate)
        mesh = _check_mesh(mesh, parallelize, dev, symbolic, engine,
                           pipelined=pipeline is not None)
        _check_pipelined(pipeline, checkpointing, compile)
        float8 = _check_float8(float8, dev, gpu_entry, parallelize)
        step, setup = _resolve_step(step, setup, loss_fn=loss_fn, accumulate=accumulate,
                                    amp=amp, compile=compile, pipeline=pipeline,
                                    symbolic=symbolic)
        return cls(loss_fn=loss_fn, optimizer=optimizer, device=dev, gpu=gpu_entry, dtype=dtype,
                   amp=amp, steps=steps, engine=engine, symbolic=symbolic,
                   alloc_conf=_resolve_alloc_conf(alloc_conf),
                   checkpointing=_resolve_checkpointing(checkpointing), compile=compile,
                   cpu=_resolve_cpu(cpu_isa, threads), mesh=mesh, parallelize=parallelize,
                   sizes=Sizes.create(sizes), accumulate=accumulate, step=step, setup=setup,
                   pipeline=pipeline, calibration=calibration, float8=float8)

    def but(self, **changes) -> "Options":
        """A copy with some fields changed (already resolved values)."""
        return replace(self, **changes)


def _resolve_target(device, gpu, calibration):
    """(device, GPU catalogue entry or None, Calibration or None): what runs the step. A
    calibration file given without a GPU names the GPU; a cuda step without one is an H100's."""
    calibration, given = _resolve_calibration(calibration)
    if given and gpu is None and (device is None or str(device).startswith("cuda")):
        gpu = _calibrated_gpu_key(calibration, "--calibration (calibration=)")  # the file's
    dev = resolve_device(device, gpu)
    check_device_build(dev)
    gpu_entry = None
    if dev.type == "cuda":
        gpu_entry = _resolve_gpu(gpu or DEFAULT_GPU)
    elif gpu is not None:
        gpu_entry = _resolve_gpu(gpu)  # a budget or a name for the report, kernels of `dev`
    return dev, gpu_entry, _check_calibration(calibration, given, dev, gpu_entry)


def _resolve_precision(dtype, amp) -> tuple:
    """(dtype, amp) as torch dtypes, each floating-point or None."""
    try:
        dtype, amp = resolve_dtype(dtype), resolve_dtype(amp)
    except ValueError as e:
        raise TapescopeError(str(e)) from None
    for what, d in (("dtype", dtype), ("amp", amp)):
        if d is not None and not d.is_floating_point:
            raise TapescopeError(f"{what} must be a floating-point type, got {d}")
    return dtype, amp


def _check_optimizer(optimizer) -> None:
    if optimizer is not None and not callable(optimizer):
        from .values.optimizers import OPTIMIZERS

        if not isinstance(optimizer, str) or optimizer.lower() not in (*OPTIMIZERS, "none"):
            raise TapescopeError(
                f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}, none, "
                "an Optimizer class or a function params -> optimizer")


def _check_counts(steps, accumulate, engine) -> None:
    if steps not in (1, 2):
        raise TapescopeError(f"steps must be 1 (first step only) or 2 (steady state), got {steps}")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise TapescopeError(f"accumulate must be a whole number of micro-batches >= 1, "
                             f"got {accumulate!r}")
    if engine not in ENGINES:
        raise TapescopeError(f"engine must be one of {ENGINES}, got {engine!r}")


def _resolve_compile(compile, dev: torch.device, symbolic: tuple) -> CompileOptions | None:
    """The CompileOptions of a compiled profile, refused where it cannot be traced."""
    compile = CompileOptions.of(compile)
    if compile is None:
        return None
    if compile.backend == "inductor" and dev.type == "cuda" \
            and importlib.util.find_spec("triton") is None:
        raise TapescopeError(
            "compiling a CUDA step with inductor generates Triton kernels: install triton "
            "(pip install triton), or use --compile-backend aot_eager "
            "(compile={'backend': 'aot_eager'}) for AOTAutograd's graphs run op by op")
    if compile.optimizer:
        raise TapescopeError(
            "compile optimizer=True is not modelled yet: when dynamo compiles optimizer.step it "
            "creates the optimizer's state while compiling (OptimizerVariable runs _init_group "
            "at trace time), outside the ops tapescope records, so the steady state would miss "
            "it; profile the compiled model with the optimizer run eagerly (the default)")
    if symbolic:
        raise TapescopeError("a compiled profile is for concrete sizes: drop symbolic=... (or "
                             "compile with dynamic=True to see the graphs torch.compile makes)")
    return compile


def _check_cpu_target(cpu_isa, threads, dev: torch.device) -> None:
    """cpu_isa and threads describe a CPU's kernels: refused for a step that runs none."""
    if (cpu_isa is not None or threads is not None) and dev.type != "cpu":
        given = " and ".join(f for f, v in (("--cpu-isa (cpu_isa=)", cpu_isa),
                                            ("--threads (threads=)", threads)) if v is not None)
        verb = "describe" if " and " in given else "describes"
        raise TapescopeError(f"{given} {verb} the CPU whose kernels a cpu step runs; a "
                             f"{dev.type} step runs none of them: drop {given.split(' (')[0]}"
                             ", or trace with --device cpu")


def _check_pipelined(pipeline, checkpointing, compile) -> None:
    """What a pipelined profile does not support yet."""
    if pipeline is not None and checkpointing:
        raise TapescopeError("a pipelined profile with a checkpointing plan is not "
                             "supported yet; apply checkpointing to each stage in your "
                             "parallelize function, as torchtitan does")
    if pipeline is not None and compile is not None:
        raise TapescopeError("a pipelined profile with compile= is not supported yet; "
                             "profile the pipeline eagerly (drop --compile)")


def _resolve_step(step, setup, *, loss_fn, accumulate, amp, compile, pipeline, symbolic):
    """The user's step and setup functions (callables, or FILE.py:FN / MODULE:FN), checked
    against the options that only the built-in step has."""
    from .loading import load_function

    if step is None:
        if setup is not None:
            raise TapescopeError("setup= goes with step=: it makes what your step function gets "
                                 "as its third argument")
        return None, None
    step = load_function(step, "step") if isinstance(step, str) else step
    setup = load_function(setup, "setup") if isinstance(setup, str) else setup
    for what, fn, signature in (("step", step, "fn(model, batch, optimizer)"),
                                ("setup", setup, "fn(model) -> state")):
        if fn is not None and not callable(fn):
            raise TapescopeError(f"{what} must be a function {signature}, got "
                                 f"{type(fn).__name__}")
    refused = [(loss_fn is not None, "loss_fn (--loss): your step computes its own loss"),
               (accumulate != 1, "accumulate (--accumulate): accumulate in your step's own loop"),
               (amp is not None, "amp (--amp): open torch.autocast in your step"),
               (pipeline is not None, "pipeline (--pipeline): a pipeline schedule runs its own "
                                      "step"),
               (bool(symbolic), "symbolic sizes: not supported with a step yet")]
    for bad, why in refused:
        if bad:
            raise TapescopeError(f"step= runs your own training step as written, so drop {why}")
    return step, setup


def _resolve_checkpointing(checkpointing) -> tuple:
    """UnitPolicy values from a Plan, or a list of fqns / (fqn, mode) / UnitPolicy."""
    from .values.checkpointing import UnitPolicy

    if checkpointing is None:
        return ()
    policies = getattr(checkpointing, "policies", checkpointing)  # a checkpointing Plan
    if isinstance(policies, (str, UnitPolicy)):
        policies = (policies,)
    if isinstance(policies, dict) and "module" in policies:
        policies = (policies,)  # one policy written as a dict
    if not isinstance(policies, (list, tuple)):
        raise TapescopeError(f"checkpointing= takes a list of policies (module names, (name, "
                             f"mode) pairs or dicts) or a Plan, not a {type(policies).__name__}")
    return tuple(UnitPolicy.of(p) for p in policies)


def _resolve_pipeline(pipeline, mesh, accumulate):
    """The PipelineSpec of a pipelined profile: given, or the default schedule when the mesh has
    a "pp" dimension; None without pipeline parallelism."""
    from .values.pipeline import PipelineSpec, pipeline_spec

    has_pp = isinstance(mesh, dict) and "pp" in mesh or \
        getattr(mesh, "names", None) is not None and "pp" in mesh.names
    spec = pipeline_spec(pipeline)
    if spec is None and not has_pp:
        return None
    if not has_pp:
        raise TapescopeError("pipeline= needs a mesh with a 'pp' dimension, the pipeline's ranks "
                             "(e.g. mesh={'pp': 4}, CLI --pp 4)")
    if accumulate != 1:
        raise TapescopeError("a pipelined step accumulates over its micro-batches: drop "
                             "accumulate (--accumulate) and set the micro-batches "
                             "(pipeline={'microbatches': M}, CLI --microbatches M)")
    return spec or PipelineSpec()


def _float8_recipe(recipe: str | None, device, gpu) -> str | None:
    """The recipe, or one clear refusal: an unknown recipe, the CPU, a GPU without float8."""
    if recipe is None:
        return None
    if recipe not in FLOAT8_RECIPES:
        raise TapescopeError(f"--float8 {recipe!r}: choose one of {', '.join(FLOAT8_RECIPES)}")
    if device.type != "cuda" or gpu is None:
        raise TapescopeError(f"--float8 {recipe} profiles float8 training on a GPU: add --gpu "
                             "h100 (or another GPU of compute capability 8.9 or newer); the CPU "
                             "runs float8 matmuls only as an fp32 emulation")
    if tuple(gpu.compute_capability) < (8, 9):
        major, minor = gpu.compute_capability
        raise TapescopeError(f"--float8 {recipe}: the {gpu.name} (sm{major}{minor}) has no float8 "
                             "matmul (torch's _scaled_mm needs sm89 or newer, as torchtitan's "
                             "float8 converter checks); use an Ada, Hopper or Blackwell GPU, or "
                             "drop --float8")
    return recipe



def _check_float8(float8, device, gpu, parallelize):
    """The float8 recipe (capture/float8.py) for the built-in presets; a user's parallelize
    applies its own converter, as torchtitan's does (tests/test_float8.py)."""
    recipe = _float8_recipe(float8, device, gpu)
    if recipe is not None and parallelize is not None and \
            getattr(parallelize, "layout", None) is None:
        raise TapescopeError(f"--float8 {recipe} converts the model for tapescope's presets "
                             "(--fsdp/--tp/--cp, fit --gpus); with your own --parallelize, call "
                             "torchao's convert_to_float8_training in it, as torchtitan does")
    return recipe


def _check_mesh(mesh, parallelize, device, symbolic, engine, pipelined: bool = False):
    """The MeshSpec of a distributed profile (None without one); mesh and parallelize go together
    (a pipelined mesh may have no parallelize: the stages are the parallelisation)."""
    if mesh is None and parallelize is None:
        return None
    if mesh is None:
        raise TapescopeError("parallelize= needs mesh=, the device mesh to run it on "
                             "(e.g. mesh={'dp': 4, 'tp': 2})")
    if parallelize is not None and not callable(parallelize) or \
            parallelize is None and not pipelined:
        raise TapescopeError("mesh= needs parallelize=fn, where fn(model, mesh) applies your "
                             "torch.distributed code (fully_shard, parallelize_module, ...) to the "
                             "model and returns it (CLI: --fsdp/--tp or --parallelize file.py:fn)")
    if device.type not in ("cpu", "cuda"):
        raise TapescopeError(f"a distributed profile traces device cpu or cuda, not {device}")
    if symbolic:
        raise TapescopeError("symbolic sizes are not supported with mesh= yet; profile concrete sizes")
    if engine != "python":
        raise TapescopeError("a distributed profile runs the backward with tapescope's engine "
                             "(engine='python'): FSDP2's hooks need its graph task")
    from .values.mesh import mesh_spec

    return mesh_spec(mesh)


def _resolve_gpu(gpu):
    from .devices.gpus import GPU, get_gpu

    if isinstance(gpu, GPU):
        return gpu
    try:
        return get_gpu(str(gpu))
    except ValueError as e:  # an unknown name: the message lists the ones we know
        raise TapescopeError(str(e)) from None


def _resolve_cpu(isa, threads):
    from .devices.cpu import cpu_target

    try:
        return cpu_target(None if isa is None else str(isa).lower(), threads)
    except ValueError as e:
        raise TapescopeError(str(e)) from None


def _resolve_calibration(calibration):
    """(Calibration, True) for a Calibration or a file to read; (None, False) when none is
    given (the environment's is read by _check_calibration, for a CUDA profile only)."""
    from .devices.calibration import Calibration, load_calibration

    if isinstance(calibration, Calibration):
        return calibration, True
    if calibration is not None:
        return load_calibration(str(calibration)), True
    return None, False


def _calibrated_gpu_key(calibration, where: str) -> str:
    """The catalogue key of the GPU a calibration file measured."""
    from .devices.gpus import resolve_gpu_key

    try:
        return resolve_gpu_key(calibration.gpu_name)
    except ValueError:
        raise TapescopeError(f"{where} {calibration.source}: its GPU {calibration.gpu_name!r} is "
                             "not in tapescope's GPU catalogue (devices/gpus.py), so no profile "
                             "can follow its kernels") from None


def _check_calibration(calibration, given: bool, device: torch.device, gpu):
    """The calibration to price the step with: only on the GPU it was measured on. One given
    for a profile that runs no GPU kernels is refused; one from the environment is not used."""
    from .devices.calibration import ENV_VAR, load_calibration

    if not given:   # TAPESCOPE_CALIBRATION: read only for a profile that runs GPU kernels
        path = os.environ.get(ENV_VAR)
        if not path or device.type != "cuda":
            return None
        calibration = load_calibration(path)
    where = "--calibration (calibration=)" if given else ENV_VAR
    if device.type != "cuda":
        raise TapescopeError(f"{where} {calibration.source or ''} prices a GPU's kernels, and "
                             f"a {device.type} profile runs none: profile with --device cuda "
                             "(or no --device), or drop --calibration")
    measured = _calibrated_gpu_key(calibration, where)
    if measured != gpu.key:
        raise TapescopeError(f"{where} {calibration.source} was measured on "
                             f"{calibration.gpu_name} ({measured}), and this profile is of "
                             f"{gpu.name} ({gpu.key}): profile with --gpu {measured}, or "
                             "calibrate on that GPU" +
                             ("" if given else f", or unset {ENV_VAR}"))
    return calibration


def _resolve_alloc_conf(conf):
    """An AllocatorConfig from an object, a PYTORCH_CUDA_ALLOC_CONF-style string, or the
    environment: PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.cpp,
    AcceleratorAllocatorConfig::instance reads them in that order)."""
    from .values.allocator import AllocatorConfig

    if isinstance(conf, AllocatorConfig):
        return conf
    source = "--alloc-conf"
    if conf is None:
        for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            if os.environ.get(var):
                conf, source = os.environ[var], var
                break
    if not conf:
        return AllocatorConfig()
    try:
        return AllocatorConfig.from_env(str(conf))
    except ValueError as e:
        raise TapescopeError(f"cannot read the allocator settings {conf!r} ({source}): {e}") from None
