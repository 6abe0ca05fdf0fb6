"""Turning the user's model and inputs into fake ones, without touching the originals."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from ..errors import ModelBuildError, SpecError, TapescopeError
from ..options import check_device_build, resolve_device, resolve_dtype
from ..torch_compat import (checkpoint_wrapper_api, is_wrapper_subclass, patched,
                            post_accumulate_grad_hooks, tensor_backward_hooks, tree_map)
from .build_values import BuildValues, keep_build_value

__all__ = ["inside_checkpoint_wrapper",
           "spec", "Spec", "build_on_meta", "model_of", "built_for", "fake_copy", "fake_inputs", "resolve_dtype",
           "transformer_blocks"]

@dataclass(frozen=True)
class Spec:
    """The shape and dtype of an input, without its data.

    `high` bounds the values of an integer input when tapescope runs the step for real (validation):
    token ids must stay below the vocabulary size. Fake tracing never looks at values.
    `dims` names the dimensions that vary between runs ("batch", "seq"); a symbolic profile makes
    each named dimension one symbol, shared by every input. By default dim 0 is "batch".
    """

    shape: tuple
    dtype: torch.dtype = torch.float32
    device: str | None = None
    requires_grad: bool = False
    high: int | None = None
    dims: tuple | None = None

    def dim_names(self) -> tuple:
        if self.dims is not None:
            return self.dims
        return ("batch",) + (None,) * (len(self.shape) - 1) if self.shape else ()

    def __repr__(self) -> str:
        return f"spec({tuple(self.shape)}, dtype={self.dtype})"


def spec(shape, dtype=torch.float32, device=None, requires_grad=False, high=None,
         dims=None) -> Spec:
    """An input given by shape and dtype only: `tapescope.spec((8, 1024), dtype=torch.long)`.

    dims: a name per dimension for symbolic profiles, e.g. ("batch", "seq"); None for fixed ones.
    """
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise SpecError(f"an input shape is a tuple of whole numbers, not {shape!r}") from None
    if any(s < 0 for s in shape):
        raise SpecError(f"negative size in input shape {shape}")
    if dims is not None and len(dims) != len(shape):
        raise SpecError(f"dims {dims} must name each of the {len(shape)} dimensions (None for fixed)")
    try:
        dtype = resolve_dtype(dtype)
    except ValueError as e:
        raise SpecError(str(e)) from None
    if device is not None:
        device = str(resolve_device(device))
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise SpecError(f"an input of dtype {dtype} cannot require grad (only floating-point "
                        "and complex tensors can)")
    return Spec(shape, dtype, device, requires_grad, high, None if dims is None else tuple(dims))


def model_of(model) -> nn.Module:
    """The model a workload names: an nn.Module as it is; a function that builds one, built on meta
    (`build_on_meta`), once, by whoever traces it more than once."""
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TapescopeError(f"model must be an nn.Module or a function that builds one, "
                             f"got {type(model).__name__}")
    return build_on_meta(model)


def built_for(model, options) -> nn.Module:
    """`model_of` for a profile with these options: a builder of a CUDA profile runs with
    torch.cuda's device questions answered for the profiled GPU (gpu_less.capability_answered),
    as the user's code would run on it, and the tensors it then puts on "cuda" made on meta
    (gpu_less.cuda_tensors_on_meta)."""
    if isinstance(model, nn.Module) or options.device.type != "cuda" or options.gpu is None:
        return model_of(model)
    from .gpu_less import capability_answered, cuda_tensors_on_meta

    gpu = options.gpu
    try:
        with capability_answered(gpu), cuda_tensors_on_meta():
            return model_of(model)
    except ModelBuildError as e:
        major, minor = gpu.compute_capability
        raise ModelBuildError(f"{e}; its questions about the GPU were answered as on the profiled "
                              f"{gpu.name} (sm{major}{minor}): --gpu names another") from e


def build_on_meta(builder: Callable[[], nn.Module]) -> nn.Module:
    """Run a model builder with every new tensor on the meta device: no memory, no init compute.

    Small constants made during the build (a 0-dim int64 stride buffer) keep their values
    (build_values.py). Init code that reads tensor values (`x.item()` on a schedule tensor, say)
    cannot run on meta; for those builders the parameters are created on the CPU one module at a
    time and moved to meta as soon as they exist, so memory stays at one parameter's size (init
    compute is paid).
    """
    values = BuildValues()  # small constants keep their values (build_values.py)
    try:
        with torch.device("meta"), values:
            model = builder()
    except Exception as first:  # noqa: BLE001 - retried below, reported if that fails too
        try:
            with _params_to_meta():
                model = builder()
        except Exception as second:
            if type(second) is type(first) and str(second) == str(first):
                raise _refused_by_the_builder(second) from second
            raise ModelBuildError(
                f"could not build the model without allocating it: on the meta device it failed with "
                f"{type(first).__name__}: {first}; building parameter by parameter failed with "
                f"{type(second).__name__}: {second}. If its init reads tensor values (an .item(), "
                f"an allclose check), build the model yourself and pass the nn.Module to "
                f"profile(): tapescope copies it onto fake tensors and never changes it") from second
    if not isinstance(model, nn.Module):
        raise ModelBuildError(f"the model builder returned {type(model).__name__}, not an nn.Module")
    values.forget_unfollowed(model)
    return model


def _refused_by_the_builder(e: Exception) -> ModelBuildError:
    """The builder's own refusal, met the same way on meta and on the CPU: its message, where it
    was raised (a float8 converter refusing a GPU without float8, a config check), not a tensor
    value the meta device could not give."""
    from ..errors import user_frame_of

    where = user_frame_of(e)
    message = " ".join(str(e).split())  # one line
    return ModelBuildError(f"the model builder raised {type(e).__name__}: {message}"
                           + (f" (at {where})" if where else ""))


class _params_to_meta:
    """Move each parameter and buffer to meta the moment a module registers it (like accelerate's
    init_empty_weights, which we do not depend on for this one function)."""

    def __enter__(self):
        reg_p, reg_b = nn.Module.register_parameter, nn.Module.register_buffer

        def register_parameter(mod, name, param):
            reg_p(mod, name, param)
            if param is not None and param.device.type != "meta":
                p = mod._parameters[name]
                mod._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

        def register_buffer(mod, name, tensor, persistent=True):
            reg_b(mod, name, tensor if tensor is None else
                  keep_build_value(tensor.to("meta"), tensor), persistent)

        self._patch = patched(nn.Module, register_parameter=register_parameter,
                              register_buffer=register_buffer)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)


def fake_copy(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A private copy of `model` whose tensors are replaced by `make(t)` (capture.isolation: the
    state its attributes reach is copied too; the original model is never modified)."""
    from .isolation import Isolation

    return Isolation(make, make).copy_model(model)


def fake_tensor_like(t: torch.Tensor, device, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake tensor with t's shape, strides and autograd flags (call inside the fake mode).

    A tensor subclass that wraps inner tensors (torch's traceable wrapper subclasses: torchao's
    float8 weight `WeightWithDynamicFloat8CastTensor`, say) stays that subclass, its inner
    tensors made fake: the subclass decides what the real step runs (FSDP2 asks the parameter
    for `fsdp_pre_all_gather` and all-gathers float8 when it has one), so a plain tensor in its
    place would trace another step.
    """
    if is_wrapper_subclass(t):
        out = _wrapper_subclass_like(t, device, dtype)
    else:
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        out = torch.empty_strided(t.shape, t.stride(), dtype=dt, device=device)
    if isinstance(t, nn.Parameter):
        out = nn.Parameter(out, requires_grad=t.requires_grad)
    elif t.requires_grad:
        out.requires_grad_(True)
    # the user's gradient hooks on this tensor run in the real step, so they run in ours
    hooks = tensor_backward_hooks(t) if t.requires_grad else None
    if hooks:
        out._backward_hooks = type(hooks)(hooks)
    post = post_accumulate_grad_hooks(t) if t.requires_grad else None
    if post:
        out._post_accumulate_grad_hooks = type(post)(post)
    return out


def _wrapper_subclass_like(t: torch.Tensor, device, dtype: torch.dtype | None) -> torch.Tensor:
    """`t`'s subclass rebuilt around fake copies of its inner tensors (the subclass's own
    flatten/unflatten protocol, as FakeTensorMode.from_tensor and AOTAutograd rebuild one)."""
    names, context = t.__tensor_flatten__()
    inner = {name: fake_tensor_like(getattr(t, name), device, dtype) for name in names}
    return type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())


def fake_inputs(inputs: Any, device, dtype: torch.dtype | None, sizes: dict | None = None) -> Any:
    """Replace every tensor and Spec in a nest of inputs by a fake tensor on `device`.

    sizes: dimension name -> size (a SymInt in a symbolic profile) for the named dims of Specs.
    """
    sizes = sizes or {}

    def convert(x):
        if isinstance(x, Spec):
            dev = x.device or device
            check_device_build(torch.device(dev), f"the input {x!r} on {dev}")
            dt = dtype if (dtype is not None and x.dtype.is_floating_point) else x.dtype
            shape = [sizes.get(n, s) for s, n in zip(x.shape, x.dim_names())]
            t = torch.empty(shape, dtype=dt, device=dev)
            return t.requires_grad_(True) if x.requires_grad else t
        if isinstance(x, torch.Tensor):
            return fake_tensor_like(x, device, dtype)
        return x

    return tree_map(convert, inputs, is_leaf=lambda x: isinstance(x, Spec))


def real_inputs(inputs: Any, device, dtype: torch.dtype | None, generator: torch.Generator) -> Any:
    """Real tensors for a real run of the step (validation): specs get random or zero data."""

    def convert(x):
        if isinstance(x, Spec):
            dev = x.device or device
            dt = dtype if (dtype is not None and x.dtype.is_floating_point) else x.dtype
            if dt.is_floating_point:
                t = torch.randn(x.shape, dtype=dt, generator=generator).to(dev)
            elif dt == torch.bool:
                t = torch.ones(x.shape, dtype=dt, device=dev)
            else:
                t = torch.randint(0, x.high or 1, x.shape, dtype=dt, generator=generator).to(dev)
            return t.requires_grad_(True) if x.requires_grad else t
        if isinstance(x, torch.Tensor):
            t = x.detach().to(device=device, dtype=dtype if (dtype and x.is_floating_point()) else x.dtype,
                              copy=True)  # the step's own copy: made (and counted) with the step
            return t.requires_grad_(x.requires_grad)
        return x

    return tree_map(convert, inputs, is_leaf=lambda x: isinstance(x, Spec))


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the longest nn.ModuleList whose members share a class
    (Llama's `layers`, GPT-2's `h`, a ViT's encoder layers). A block in a checkpoint wrapper
    counts as the block it holds (a plan may wrap some blocks only), and is returned wrapped:
    FSDP shards the wrapper, as torchtitan's apply_fsdp does after apply_ac."""
    best: list = []
    for m in model.modules():
        held = [b for b in m if b is not None] if isinstance(m, nn.ModuleList) else []
        if len(held) > len(best) and len({type(inside_checkpoint_wrapper(b)) for b in held}) == 1:
            best = held  # (a pipeline stage's list holds None for other stages' blocks)
    return best


def inside_checkpoint_wrapper(module: nn.Module) -> nn.Module:
    """The module a checkpoint_wrapper holds (`_checkpoint_wrapped_module`), else `module`."""
    try:
        wrapper = checkpoint_wrapper_api()[2]   # ActivationWrapper
    except ImportError:  # a torch built without torch.distributed has no wrapper
        return module
    while isinstance(module, wrapper):
        module = module._checkpoint_wrapped_module
    return module
