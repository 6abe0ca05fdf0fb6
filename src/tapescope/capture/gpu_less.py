"""Inductor's CUDA path without a GPU: the device queries answered for a named GPU.

Inductor lowers, schedules and generates Triton kernels and a Python wrapper from shapes alone,
but it asks the CUDA runtime about the device as it goes: `torch.cuda.is_available()`, the
device's properties (SM count: how many ways a reduction splits; warp size; registers and
threads per SM; compute capability: which fp8 types, TMA, tensor cores) and, through Triton, the
compile target (`triton.runtime.driver.active.get_current_target()`). Without a GPU each of those
stops it ("Found no NVIDIA driver"). `cuda_answered(gpu)` answers them for the named GPU
(devices/gpus.py), for the duration of a block:

- `torch.cuda`'s queries (is_available, device_count, properties, capability, name, the current
  device and its guard) and the copies of them torch bound at import
  (dynamo's `device_interface.CudaInterface`, its worker caches);
- Triton's active driver: a `CudaDriver` that answers with `GPUTarget("cuda", <cc>, 32)` and
  the GPU's limits without loading libcuda (Triton's own driver builds a C helper against it);
- inductor's datasheet figures for the device (`get_device_tflops`, `get_gpu_dram_gbps`: torch
  looks the device's name up in its own table and falls back to Triton's estimate, which asks
  the driver through pynvml), answered from the catalogue's dense peak and bandwidth;
- the one decision inductor takes by running kernels on the device: `pad_mm` pads a
  compute-bound matmul with unaligned sizes when a benchmark of both says padding is >= 1.1x
  faster (fx_passes/pad_mm.py `_should_pad`). Its rules that need no benchmark stay inductor's
  (`force_shape_pad`, the bf16 large-K rule, "not compute-bound: no padding", by the named GPU's
  peak and bandwidth); where it would benchmark, tapescope answers "not padded" as if cached
  (`get_cached_should_pad`), since no measurement exists to decide (listed in the compiled
  profile's approximations);
- the functools caches of answers torch keeps process-wide (`DeviceProperties.create`,
  `has_triton`, ...), emptied on entry and on exit so that no answer given inside is seen
  outside and none cached outside (no GPU) is seen inside.

Nothing runs on a device: kernel compilation is replaced by no-ops (compiled.py), and the
wrapper's streams are the null stream. Everything is restored on exit.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from ..devices.gpus import GPU, sm_limits
from ..torch_compat import (DEVICE_CACHING_MODULES, SETUP_ONCE_CACHES, FakeTensorMode,
                            dynamo_device_interface, inductor_constant_folders, inductor_pad_mm,
                            inductor_utils, matmul_allows_tf32, patched)

__all__ = ["cuda_answered", "capability_answered", "cuda_tensors_on_meta", "device_properties",
           "NoDeviceGuard"]


def device_properties(gpu: GPU) -> SimpleNamespace:
    """What `torch.cuda.get_device_properties()` returns on `gpu` (the fields inductor and Triton
    read; `_CudaDeviceProperties` cannot be made from Python)."""
    major, minor = gpu.compute_capability
    lim = sm_limits(gpu.compute_capability)
    return SimpleNamespace(
        name=gpu.name, major=major, minor=minor,
        total_memory=gpu.reported_memory_bytes or gpu.memory_bytes,
        multi_processor_count=gpu.sms, L2_cache_size=gpu.l2_bytes, warp_size=32,
        max_threads_per_multi_processor=lim.threads_per_sm, max_threads_per_block=1024,
        regs_per_multiprocessor=lim.regs_per_sm,
        shared_memory_per_block=48 * 1024,
        shared_memory_per_block_optin=lim.smem_per_block_optin,
        shared_memory_per_multiprocessor=lim.smem_per_sm,
        is_integrated=0, is_multi_gpu_board=0, gcnArchName="NVIDIA",
        uuid="00000000-0000-0000-0000-000000000000", pci_bus_id=0, pci_device_id=0,
        pci_domain_id=0,
    )


def _triton_driver(gpu: GPU, props):
    """Triton's CUDA driver for `gpu`, made without loading libcuda."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    major, minor = gpu.compute_capability

    class _Utils:
        def get_device_properties(self, device):
            return {"max_shared_mem": props.shared_memory_per_block_optin,
                    "max_num_regs": props.regs_per_multiprocessor,
                    "multiprocessor_count": props.multi_processor_count,
                    "warpSize": 32, "sm_clock_rate": 0, "mem_clock_rate": 0,
                    "mem_bus_width": 0}

    class GPULessCudaDriver(CudaDriver):
        def __init__(self):  # CudaDriver's builds and loads a C helper against libcuda
            self.utils = _Utils()

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return (major, minor)

        def get_current_target(self):
            return GPUTarget("cuda", major * 10 + minor, 32)

    return GPULessCudaDriver()


class NoDeviceGuard:
    """`torch.cuda._DeviceGuard` where there is one device and nothing runs on it."""

    def __init__(self, index):
        self.index = index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check_index(device) -> int:
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        device = device.index
    index = 0 if device is None else int(device)
    if index != 0:
        raise RuntimeError(f"Invalid device id {index}: tapescope answers for one GPU, cuda:0")
    return index


def _cuda_answers(gpu: GPU, props) -> dict:
    cc = gpu.compute_capability

    def props_of(device=None):
        _check_index(device)
        return props

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_properties": props_of,
        "get_device_capability": lambda device=None: cc,
        "get_device_name": lambda device=None: gpu.name,
        "is_bf16_supported": lambda including_emulation=True: cc >= (8, 0),
        "synchronize": lambda device=None: None,
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
        "_DeviceGuard": NoDeviceGuard,
        # dynamo keeps the CUDA generator's state across a trace; there is no generator
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "set_rng_state": lambda new_state, device="cuda": None,
        "is_current_stream_capturing": lambda: False,
    }


# CudaInterface's copies of torch.cuda's functions, bound at import
_INTERFACE = {"current_device": "current_device", "set_device": "set_device",
              "device_count": "device_count", "get_device_properties": "get_device_properties",
              "synchronize": "synchronize", "is_bf16_supported": "is_bf16_supported",
              "exchange_device": "_exchange_device",
              "maybe_exchange_device": "_maybe_exchange_device"}

# modules whose functools caches hold answers about the device or what follows from them
# (DeviceProperties.create, has_triton, get_gpu_type, get_gpu_dram_gbps from the device's name,
# CacheBase.get_system, ...): every cache in them is emptied on entry and on exit
_CACHING_MODULES = DEVICE_CACHING_MODULES


def _is_cache(f) -> bool:
    return isinstance(f, _LRU_WRAPPER)


_LRU_WRAPPER = type(functools.cache(lambda: None))


def _cached_functions() -> list:
    """The functools caches defined in _CACHING_MODULES (module functions and class methods)."""
    out = []
    for name in _CACHING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in list(vars(module).values()):
            members = [obj]
            if isinstance(obj, type) and obj.__module__ == name:
                members += list(vars(obj).values())
            for f in members:
                if isinstance(f, (classmethod, staticmethod)):
                    f = f.__func__
                if _is_cache(f) and f not in out and \
                        f"{f.__module__}.{f.__qualname__}" not in SETUP_ONCE_CACHES:
                    out.append(f)
    return out


def _clear(caches) -> None:
    for fn in caches:
        fn.cache_clear()


class _ConstantsOnCPU(TorchFunctionMode):
    """Inductor's constant folding computes the values of constant subgraphs with real tensors on
    their device (`aten.full([1], v, device=cuda)`, then pointwise ops on them) to replace them by
    one `full(shape, value)`; only the value (`.item()`) and the node's own shape and device are
    kept. Without a device those tensors are made on the CPU: the same values, the same graph."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and func is not torch.device and torch.device(device).type == "cuda":
            kwargs["device"] = torch.device("cpu")
        args = tuple(torch.device("cpu") if isinstance(a, torch.device) and a.type == "cuda"
                     else a for a in args)
        return func(*args, **kwargs)


def _constants_on_cpu(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _ConstantsOnCPU():
            return fn(*args, **kwargs)

    return run


def _constant_folders() -> list:
    """(class, {method: wrapped}) for inductor's constant folders: ConstantFolder.run computes,
    UniformValueConstantFolder.__init__ makes the zeros of `x * 0` on the device."""
    ConstantFolder, UniformValueConstantFolder = inductor_constant_folders()
    return [(ConstantFolder, {"run": _constants_on_cpu(ConstantFolder.__dict__["run"])}),
            (UniformValueConstantFolder,
             {"__init__": _constants_on_cpu(UniformValueConstantFolder.__dict__["__init__"])})]


def _datasheet_answers(gpu: GPU) -> dict:
    """inductor's `get_device_tflops(dtype)` (TFLOP/s, dense; TF32 for fp32 where matmuls allow
    it, as inductor reads `torch.backends.cuda.matmul.fp32_precision`) and `get_gpu_dram_gbps()`
    (GB/s) for the named GPU."""
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
             torch.float64: "fp64"}

    def tflops(dtype) -> float:
        name = names.get(dtype, "fp32")
        if name == "fp32" and matmul_allows_tf32() and gpu.peak("tf32"):
            name = "tf32"
        return (gpu.peak(name) or gpu.peak("fp32")) / 1e12

    return {"get_device_tflops": tflops,
            "get_gpu_dram_gbps": lambda: gpu.memory_bandwidth / 1e9}


# pad_mm's benchmark, answered as a cached verdict: not padded (see the module docstring)
_PAD_MM_UNMEASURED = {"get_cached_should_pad": lambda key: False}


# FakeTensorMode asks torch.cuda.is_available() to decide whether it may run a device transfer of
# a constant for real (inductor's pattern tracing moves `torch.tensor` constants to the device):
# there is no device, whatever the answers above say
_NO_DEVICE = property(lambda self: True)


@contextmanager
def cuda_answered(gpu: GPU):
    """For the duration of the block, CUDA's device queries answer as on one `gpu` (device 0)."""
    from triton.runtime import driver as triton_driver

    device_interface = dynamo_device_interface()
    props = device_properties(gpu)
    answers = _cuda_answers(gpu, props)
    interface = {k: staticmethod(answers[v]) for k, v in _INTERFACE.items()}
    worker = (device_interface.caching_worker_device_properties,
              device_interface.caching_worker_current_devices)
    saved_worker = [dict(d) for d in worker]
    caches = _cached_functions()
    _clear(caches)
    try:
        with patched(torch.cuda, **answers), \
                patched(device_interface.CudaInterface, **interface), \
                patched(FakeTensorMode, avoid_device_init=_NO_DEVICE), \
                patched(inductor_utils(), **_datasheet_answers(gpu)), \
                patched(inductor_pad_mm(), **_PAD_MM_UNMEASURED), \
                ExitStack() as stack:
            for cls, methods in _constant_folders():
                stack.enter_context(patched(cls, **methods))
            worker[0]["cuda"] = [props]
            worker[1]["cuda"] = 0
            stack.enter_context(patched(triton_driver, _active=_triton_driver(gpu, props)))
            yield props
    finally:
        for d, before in zip(worker, saved_worker):
            d.clear()
            d.update(before)
        _clear(caches)


# What a library asks before it chooses a kernel path for the GPU (torchtitan's float8 and MX
# converters: `has_cuda_capability(8, 9)` = is_available() and get_device_capability() >= (8, 9);
# torchao's `is_sm_at_least_89`): the questions, not the driver calls behind a kernel launch
_CAPABILITY_QUERIES = ("is_available", "device_count", "current_device", "get_device_capability",
                       "get_device_properties", "get_device_name", "is_bf16_supported")


@contextmanager
def capability_answered(gpu: GPU):
    """For the duration of the block, torch.cuda's questions about the device (is there one, its
    compute capability, properties and name) answer as on `gpu`: the user's build and parallelize
    code run as on that GPU, where a float8 converter that asks for sm89+ swaps its layers on an
    H100 and refuses on an A100 with its own message. Nothing else of torch.cuda is replaced
    (no stream, no allocation), and FakeTensorMode still knows there is no device."""
    answers = _cuda_answers(gpu, device_properties(gpu))
    with patched(torch.cuda, **{name: answers[name] for name in _CAPABILITY_QUERIES}), \
            patched(FakeTensorMode, avoid_device_init=_NO_DEVICE):
        yield


def _on_meta(x):
    if isinstance(x, torch.device) and x.type == "cuda":
        return torch.device("meta")
    if isinstance(x, str) and x.split(":")[0] == "cuda":
        return "meta"
    return x


class cuda_tensors_on_meta(TorchFunctionMode):
    """While a CUDA profile's model is built: a tensor the builder puts on "cuda" (it asked
    `torch.cuda.is_available()` and the profiled GPU said yes) is made on the meta device, as
    every other tensor of the build is (model.build_on_meta); there is no driver to allocate it,
    and the fake copy puts the model's tensors on the traced device afterwards."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to("meta", non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs:
            kwargs["device"] = _on_meta(kwargs["device"])
        if func is torch.Tensor.to:  # t.to("cuda"), t.to(torch.device("cuda", 0), dtype)
            args = tuple(_on_meta(a) for a in args)
        return func(*args, **kwargs)
