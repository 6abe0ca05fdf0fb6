"""Ready-made parallelisations for the CLI's --fsdp / --tp / --hsdp / --dp-replicate, as torchtitan
applies them (torchtitan/models/llama3/infra/parallelize.py): tensor parallelism first, with the
architecture's Megatron-style plan, then FSDP2 on every block and on the root.

A `Layout` names the degrees; its mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
outermost first, dimensions of size 1 left out, as torchtitan's ParallelDims builds it:
- dp_shard (--fsdp N): FSDP2, parameters sharded over N ranks;
- dp_replicate (--hsdp R, or --dp-replicate R): with dp_shard, HSDP (fully_shard on the 2-D
  (dp_replicate, dp_shard) mesh: replicate across, shard within); alone, data parallelism with
  `replicate` (torch's FSDP2-based DDP);
- cp (--cp C): context parallelism: each rank takes 1/C of the sequence, and SDPA runs as
  torch's ring attention. As torchtitan does, FSDP2 shards over dp_shard x cp (the flattened
  "dp_shard_cp" mesh), and the step's forward and backward run inside torch's
  `context_parallel(cp_mesh, buffers=<the inputs>, buffer_seq_dims=<1 each>)`, which shards every
  input on its sequence dimension (head-tail load-balanced for causal attention, torch's default)
  and patches SDPA for the duration (`train_context` below). The inputs are the CP group's: one
  batch of the full sequence, as the trainer's data loader gives every rank of the group. Only
  inputs are sharded, no model buffer: a rotary table held as a buffer of the full sequence
  (torchtitan's `freqs_cis`) is not split; the zoo's models compute theirs from the shapes.
- tp (--tp M): tensor parallelism with the plan of the model's architecture (TP_PLANS), on the
  innermost dimension, so that a tensor-parallel group sits inside a node.

Mixed precision: with amp, FSDP2's MixedPrecisionPolicy gathers parameters in the amp dtype and
reduces gradients in fp32 (torchtitan's default), in place of autocast.

TP plans are registered by architecture, each a small function `plan(model, tp_mesh)` next to
a test of whether a model is of that architecture. A model without one gets a message that
says to pass its own `--parallelize file.py:fn`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..capture.model import inside_checkpoint_wrapper, transformer_blocks
from ..errors import TapescopeError

__all__ = ["Layout", "preset_parallelize", "TP_PLANS", "transformer_blocks"]


@dataclass(frozen=True)
class Layout:
    fsdp: int = 1
    tp: int = 1
    dp_replicate: int = 1
    pp: int = 1        # pipeline stages (fit --gpus; profile's --pp builds its mesh itself)
    cp: int = 1        # context parallel: the sequence split over cp ranks (ring attention)

    def __post_init__(self):
        for name in ("fsdp", "tp", "dp_replicate", "pp", "cp"):
            if getattr(self, name) < 1:
                raise TapescopeError(f"--{name.replace('_', '-')} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.fsdp * self.tp * self.dp_replicate * self.pp * self.cp

    @property
    def mesh(self) -> dict:
        """torchtitan's order, outermost first: pp, dp_replicate, dp_shard, cp, tp."""
        dims = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.fsdp,
                "cp": self.cp, "tp": self.tp}
        mesh = {k: v for k, v in dims.items() if v > 1}
        return mesh or {"dp_shard": 1}

    @property
    def shard_degree(self) -> int:
        """The ranks FSDP2 shards over: dp_shard x cp (torchtitan's "dp_shard_cp")."""
        return self.fsdp * self.cp

    @property
    def parallelised(self) -> bool:
        """Whether a preset parallelize has anything to do (pipeline stages alone need none)."""
        return self.fsdp * self.tp * self.dp_replicate * self.cp > 1

    def __str__(self) -> str:
        parts = [f"PP {self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"{'HSDP' if self.fsdp > 1 else 'DDP'} {self.dp_replicate}")
        if self.fsdp > 1:
            parts.append(f"FSDP {self.fsdp}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return " x ".join(parts) or "1 rank"


# ---- tensor-parallel plans, by architecture ----------------------------------------------------

TP_PLANS: list[tuple[str, Callable, Callable]] = []   # (name, matches(model), plan(model, mesh))


def register_tp_plan(name: str, matches: Callable):
    def decorate(plan):
        TP_PLANS.append((name, matches, plan))
        return plan
    return decorate


def apply_plan(module: nn.Module, tp_mesh, plan: dict) -> None:
    """torch's `parallelize_module(module, tp_mesh, plan)`, whose keys also reach the modules a
    checkpointing plan wrapped. A plan given with --gpus / --fsdp / --tp is applied before the
    preset (capture/session.py: a user's parallelize function cannot be split, so the plan comes
    first), and checkpoint_wrapper puts its module under `_checkpoint_wrapped_module`: torch
    resolves a key by the children's names only, so "attention.wq" under a wrapped block matched
    nothing and that block stayed unsharded (torch warns and skips the key). torchtitan applies TP
    before AC (parallelize_llama); the modules and hooks made are the same either way, only the
    names differ, so each key is resolved here through the wrappers and torch applies the style
    to every module it names."""
    from torch.distributed.tensor.parallel import parallelize_module

    for key, style in plan.items():
        for target in _plan_targets(module, key.split(".")):
            parallelize_module(target, tp_mesh, style)


def _plan_targets(module: nn.Module, tokens: list) -> list:
    """The modules a plan key names (fnmatch per dot-separated token, as torch matches them),
    stepping into a checkpoint wrapper's module wherever the key goes on below it."""
    from fnmatch import fnmatch

    if not tokens:
        return [module]
    module = inside_checkpoint_wrapper(module)
    return [t for name, child in module.named_children() if fnmatch(name, tokens[0])
            for t in _plan_targets(child, tokens[1:])]


def _is_zoo_llama(model) -> bool:
    from ..zoo.llama import Llama

    return isinstance(model, Llama)


@register_tp_plan("llama (torchtitan)", _is_zoo_llama)
def _llama_plan(model, tp_mesh) -> None:
    """torchtitan's Llama plan: vocabulary-parallel embedding and output, sequence-parallel norms,
    column-parallel q/k/v and w1/w3, row-parallel wo and w2."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    _check_heads(model.config.n_heads, model.config.n_kv_heads, tp_mesh.size())
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    # a pipeline stage holds some of them (the others are None)
    apply_plan(model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None})
    for block in transformer_blocks(model):
        apply_plan(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def _check_heads(heads: int, kv_heads: int | None, tp: int) -> None:
    """Column-parallel q/k/v split the heads: the degree must divide them (torchtitan asserts
    the same)."""
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n is not None and n % tp:
            raise TapescopeError(f"tensor parallel degree {tp} does not divide the model's {n} "
                                 f"{what}; use a degree that does")


def _hf_plan(model) -> dict | None:
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        plan = {f"{prefix}.{k}": v for k, v in plan.items()}
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


@register_tp_plan("transformers (the model's own base_model_tp_plan)",
                  lambda m: _hf_plan(m) is not None)
def _transformers_plan(model, tp_mesh) -> None:
    """The plan a transformers model ships (config.base_model_tp_plan, the model's _tp_plan),
    each style as the DTensor style with the layouts transformers gives it
    (transformers/distributed/tensor_parallel.py registers them)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)

    gathered = lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())  # noqa: E731
    split_in = lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())  # noqa: E731
    styles = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": gathered, "colwise_gather_output": gathered,
        "rowwise_rep": split_in, "rowwise_split_input": split_in,
        "embedding_rowwise": split_in, "sequence_parallel": SequenceParallel,
    }
    config = model.config
    _check_heads(getattr(config, "num_attention_heads", 1),
                 getattr(config, "num_key_value_heads", None), tp_mesh.size())
    plan = {}
    for pattern, style in _hf_plan(model).items():
        if style not in styles:
            raise TapescopeError(f"the model's tensor-parallel plan uses style {style!r} for "
                                 f"{pattern}, which tapescope's preset does not translate; pass "
                                 "your own --parallelize file.py:fn")
        plan[pattern] = styles[style]()
    apply_plan(model, tp_mesh, plan)


def tp_plan_for(model) -> tuple[str, Callable]:
    for name, matches, plan in TP_PLANS:
        if matches(model):
            return name, plan
    raise TapescopeError(
        f"no tensor-parallel plan for {type(model).__name__} (known: "
        f"{', '.join(n for n, _, _ in TP_PLANS)}); profile it with --fsdp only, or pass your own "
        "--parallelize file.py:fn")


# ---- the preset -------------------------------------------------------------------------------

def _check_shards(model: nn.Module, fsdp: int) -> None:
    """FSDP2 splits every parameter along dim 0 into one shard per rank (torch.chunk, padded with
    empty shards: _fsdp_common._chunk_with_empty). With more ranks than the largest parameter has
    rows, the ranks past it hold no shard of anything, and making the empty shards (one per rank,
    per parameter, on every rank) is all the work: --fsdp 100000 gave no answer in 91 s."""
    rows = max((p.shape[0] for p in model.parameters() if p.dim()), default=0)
    if fsdp > rows:
        raise TapescopeError(
            f"--fsdp {fsdp}: FSDP2 shards each parameter along its first dimension, and the "
            f"largest parameter of {type(model).__name__} has {rows} rows, so ranks "
            f"{rows + 1}..{fsdp} would hold no shard of any parameter; use --fsdp {rows} or fewer "
            "(or --dp-replicate for more data parallelism)")


def _shard_mesh(layout: Layout, mesh):
    """The mesh FSDP2 shards over: dp_shard, or dp_shard x cp flattened (torchtitan's
    "dp_shard_cp": FSDP on a 2-D mesh would replicate over the first dimension), with the
    replicas outermost for HSDP."""
    import warnings

    shard = [d for d in ("dp_shard", "cp") if d in mesh.mesh_dim_names]
    if len(shard) == 1:
        return mesh["dp_replicate", shard[0]] if layout.dp_replicate > 1 else mesh[shard[0]]
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if layout.dp_replicate == 1:
        return flat
    with warnings.catch_warnings():
        # torch's notice that slicing a flattened dimension from the root mesh will change;
        # torchtitan 0.3.0 builds a second view of the world instead, which needs the world mesh
        warnings.simplefilter("ignore", UserWarning)
        return mesh["dp_replicate", "dp_shard_cp"]


def preset_parallelize(layout: Layout, mp_dtype: torch.dtype | None = None) -> Callable:
    """parallelize(model, mesh) for a Layout: TP plan, then FSDP2 per block and at the root (or
    replicate for data parallelism without sharding). With CP, `parallelize.train_context(args,
    kwargs)` is the context the step's forward and backward run in (the module docstring)."""
    cp_mesh: list = []  # this preset's "cp" mesh, once parallelize has seen the mesh

    def parallelize(model: nn.Module, mesh) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if layout.tp > 1:
            _, plan = tp_plan_for(model)
            plan(model, mesh["tp"])
        if layout.cp > 1:
            cp_mesh[:] = [mesh["cp"]]
        mp = MixedPrecisionPolicy() if mp_dtype is None else \
            MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
        if layout.shard_degree > 1:
            _check_shards(model, layout.shard_degree)
            dp = _shard_mesh(layout, mesh)
            blocks = transformer_blocks(model)
            for i, block in enumerate(blocks):
                # torchtitan: the last block stays unsharded after forward (backward needs it next)
                fully_shard(block, mesh=dp, mp_policy=mp,
                            reshard_after_forward=i < len(blocks) - 1)
            fully_shard(model, mesh=dp, mp_policy=mp)
        elif layout.dp_replicate > 1:
            from ..torch_compat import replicate_with_fsdp

            replicate_with_fsdp()(model, mesh=mesh["dp_replicate"], mp_policy=mp)
        return model

    mixed = mp_dtype is not None and (layout.shard_degree > 1 or layout.dp_replicate > 1)
    parallelize.layout = layout  # what the session's float8 conversion asks (capture/float8.py)
    parallelize.param_dtype = str(mp_dtype).replace("torch.", "") if mixed else None
    parallelize.__name__ = f"the {layout} preset" + (
        f" with FSDP2 mixed precision {str(mp_dtype).replace('torch.', '')}" if mixed else "")
    if layout.cp > 1:
        parallelize.train_context = lambda args, kwargs: context_parallel_inputs(
            cp_mesh[0], layout.cp, args, kwargs)
    return parallelize


def context_parallel_inputs(cp_mesh, cp: int, args: tuple, kwargs: dict):
    """torch's `context_parallel` over the step's inputs: every input tensor with the first
    input's sequence length at dim 1 is sharded there (token ids, targets, a position or mask
    row), in place, for the duration. A sequence the degree does not divide is refused: torch
    would shard it unevenly and the ring's key/value blocks would differ between ranks."""
    from torch.distributed.tensor.experimental import context_parallel

    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() < 2:
        raise TapescopeError("context parallelism shards the inputs on their sequence "
                             "dimension (dim 1): give the model a (batch, seq, ...) input first")
    seq = tensors[0].shape[1]
    if seq % cp:
        raise TapescopeError(f"--cp {cp} does not divide the sequence of {seq} tokens: each rank "
                             f"takes seq / cp of them; use a sequence that is a multiple of {cp}")
    buffers = [t for t in tensors if t.dim() >= 2 and t.shape[1] == seq]
    return context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers))


# ---- what the CLI flags ask for ----------------------------------------------------------------

def parse_mesh(text: str) -> dict:
    """'dp=4,tp=2' -> {'dp': 4, 'tp': 2} (outermost first). A name given twice or a size below 1
    is refused: the mesh would otherwise be settled silently."""
    mesh = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, size = (x.strip() for x in item.partition("="))
        try:
            n = int(size)
        except ValueError:
            n = None
        if not name or not eq or n is None:
            raise TapescopeError(f"cannot read --mesh {text!r}: write names and sizes like "
                                 "dp=4,tp=2")
        if name in mesh:
            raise TapescopeError(f"--mesh {text!r} names {name!r} twice; give each dimension "
                                 "once, e.g. dp=4,tp=2")
        if n < 1:
            raise TapescopeError(f"--mesh {text!r}: {name}={n}, a size must be at least 1")
        mesh[name] = n
    if not mesh:
        raise TapescopeError(f"cannot read --mesh {text!r}: write names and sizes like dp=4,tp=2")
    return mesh


def load_function(text: str) -> Callable:
    """'path/to/file.py:fn' (or 'package.module:fn') -> that function, the file imported as
    model files and --loss are (loading.py: sibling imports, dataclasses, a sys.exit on import
    named)."""
    from ..loading import load_function as load

    return load(text, "--parallelize")


def parallelization(fsdp: int = 1, tp: int = 1, hsdp: int = 1, dp_replicate: int = 1,
                    parallelize: str | None = None, mesh: str | None = None, amp=None,
                    pp: int = 1, cp: int = 1):
    """(mesh dict, parallelize fn, amp for autocast) from the CLI's flags; (None, None, amp)
    when none asks for more than one rank. With a preset and amp, FSDP2's MixedPrecisionPolicy
    takes the place of autocast. --pp N puts a "pp" dimension outermost (torchtitan's order):
    the presets then parallelise each pipeline stage over the other dimensions."""
    if pp < 1:
        raise TapescopeError(f"--pp {pp}: a degree must be at least 1")
    if pp > 1 and cp > 1:
        raise TapescopeError(f"--pp {pp} with --cp {cp} is not supported yet: the preset opens "
                             "torch's context_parallel around the built-in step, which a pipeline "
                             "schedule does not run; drop one of them")
    if pp > 1:
        if mesh is not None:
            raise TapescopeError("--mesh gives the whole layout: put the pipeline in it "
                                 f"(--mesh pp={pp},...) instead of --pp {pp}")
        inner, fn, amp = parallelization(fsdp, tp, hsdp, dp_replicate, parallelize, None, amp)
        return {"pp": pp, **(inner or {})}, fn, amp
    return _parallelization(fsdp, tp, hsdp, dp_replicate, parallelize, mesh, amp, cp)


def _parallelization(fsdp, tp, hsdp, dp_replicate, parallelize, mesh, amp, cp=1):
    from ..options import resolve_dtype

    degrees = {"--fsdp": fsdp, "--tp": tp, "--hsdp": hsdp, "--dp-replicate": dp_replicate,
               "--cp": cp}
    for flag, n in degrees.items():
        if n < 1:
            raise TapescopeError(f"{flag} {n}: a degree must be at least 1 (1, the default, "
                                 "means not parallelised that way)")
    if hsdp > 1 and dp_replicate > 1 and hsdp != dp_replicate:
        raise TapescopeError(f"--hsdp {hsdp} and --dp-replicate {dp_replicate} name the same "
                             "degree (the replicas); give one of them")
    replicate = max(hsdp, dp_replicate)
    given = " ".join(f"{flag} {n}" for flag, n in degrees.items() if n > 1)
    if mesh is not None and given:
        raise TapescopeError(f"--mesh {mesh} gives the whole layout; {given} cannot be added to "
                             "it: put every dimension in --mesh (e.g. --mesh dp=4,tp=2), or drop "
                             "--mesh")
    if parallelize is not None:
        mesh_dims = parse_mesh(mesh) if mesh is not None else None
        fn = load_function(parallelize)
        if mesh_dims is not None:
            return mesh_dims, fn, amp
        layout = Layout(fsdp=fsdp, tp=tp, dp_replicate=replicate, cp=cp)
        if layout.world_size == 1:
            raise TapescopeError("--parallelize needs the mesh it runs on: --mesh dp=4,tp=2 (or "
                                 "--fsdp/--tp/--hsdp/--cp, which name it dp_replicate, dp_shard, "
                                 "cp, tp)")
        return layout.mesh, fn, amp
    if mesh is not None:
        raise TapescopeError("--mesh goes with --parallelize file.py:fn (the presets --fsdp/--tp "
                             "name their own mesh)")
    layout = Layout(fsdp=fsdp, tp=tp, dp_replicate=replicate, cp=cp)
    if layout.world_size == 1:
        return None, None, amp
    mp = None
    if amp is not None and (layout.shard_degree > 1 or layout.dp_replicate > 1):
        try:
            mp, amp = resolve_dtype(amp), None
        except ValueError as e:
            raise TapescopeError(str(e)) from None
    return layout.mesh, preset_parallelize(layout, mp), amp
