"""Every option of a profile, declared once: its keyword, annotation, default, description and the
`tapescope profile` flags that set it.

`tapescope.profile(...)` and `Options.create(...)` write their keywords by hand (typer, editors
and readers need real signatures), `profile()`'s docstring describes the options from `doc`
here, and `tapescope profile`'s one-to-one flags (--device, --steps, ...) are built from `flags`
and `help` here. tests/test_options.py fails when a signature, an `Options` field or the CLI
differs from this table: adding an option is one row here, then the keyword where the test
points. No torch here: the CLI reads it before any command imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Option", "OPTIONS", "OPTION", "WORKLOAD_KEYWORDS", "profile_options_doc"]


@dataclass(frozen=True)
class Option:
    """One option.

    annotation: the keyword's annotation as `profile()` and `Options.create` write it.
    doc: its paragraph of `profile()`'s docstring.
    flags: the `tapescope profile` flags that set it. With `help`, the first is its one flag
        (and the rest that flag's aliases), built from this row (cli.option_flag); without,
        flags cli.py declares itself because several of them make one value (--fsdp and --tp
        make `mesh`).
    field: the `Options` field holding the resolved value; "" is `name`, None is none of its own
        (threads and cpu_isa are resolved into `cpu`).
    """

    name: str
    annotation: str
    default: object
    doc: str
    flags: tuple = ()
    help: str | None = None
    field: str | None = ""

    @property
    def field_name(self) -> str | None:
        return self.name if self.field == "" else self.field


OPTIONS = (
    Option("loss_fn", "Callable | str | None", None,
           "`loss_fn(output, *inputs) -> scalar`, or a name (\"sum\", \"mean\", "
           "\"cross-entropy\", \"file.py:fn\", \"module:fn\"). Default: a scalar output is the "
           "loss; else an output's scalar `.loss`; else the sum of the floating-point outputs.",
           ("--loss",),
           "sum, mean, cross-entropy (of the model's logits) or FILE.py:FN / MODULE:FN called as "
           "FN(output, *inputs) (default: the model's own loss, else the sum of its outputs)."),
    Option("optimizer", "str | type | Callable | None", "adamw",
           "\"sgd\", \"adam\", \"adamw\" (torch defaults, with the foreach/fused choice torch "
           "makes on `device`), an Optimizer class, a function params -> optimizer, or None (no "
           "optimizer step).",
           ("--optimizer", "-o"), "adamw, adam, sgd or none."),
    Option("device", "str | torch.device | None", None,
           "\"cpu\", \"cuda\" or \"meta\" - the device whose kernels and autograd formulas are "
           "traced. Default: \"cuda\" when a `gpu` is named, else \"cpu\".",
           ("--device", "-d"),
           "cpu, cuda or meta: whose kernels to trace (default: cuda with --gpu, else cpu)."),
    Option("gpu", "str | GPU | None", None,
           "for device=\"cuda\", the GPU whose kernel choices to follow (\"h100\", \"a100\", "
           "\"l4\", ...; default H100): attention backends depend on its compute capability.",
           ("--gpu",),
           "With --device cuda: the GPU whose kernels to follow (h100, a100, l4, ...)."),
    Option("dtype", "str | torch.dtype | None", None,
           "cast floating-point parameters and inputs (e.g. torch.bfloat16 or \"bf16\").",
           ("--dtype",), "fp32, bf16 or fp16: cast the model (default: the model's)."),
    Option("amp", "str | torch.dtype | None", None,
           "run forward and loss under torch.autocast with this dtype (\"bf16\", \"fp16\"): "
           "mixed precision with fp32 parameters (works for device=\"cuda\" without a GPU).",
           ("--amp",), "bf16 or fp16: mixed precision (torch.autocast), fp32 weights."),
    Option("steps", "int", 2,
           "2 (default) reports the steady state, with optimizer state alive; 1 the first step.",
           ("--steps",), "2: steady state with optimizer state; 1: first step."),
    Option("accumulate", "int", 1,
           "gradient accumulation over this many micro-batches per optimizer step: forward, "
           "`loss / accumulate` and backward each time (the same inputs), then one optimizer "
           "step and zero_grad, as a training loop runs them.",
           ("--accumulate",),
           "Gradient accumulation: micro-batches per optimizer step (each runs forward, loss / N "
           "and backward on the given inputs)."),
    Option("engine", "str", "python",
           "\"python\" (default) runs backward with tapescope's own engine, which needs no GPU; "
           "\"torch\" calls loss.backward() (needs a GPU for device=\"cuda\")."),
    Option("symbolic", "str | tuple", (),
           "names of input dimensions to keep symbolic, e.g. (\"batch\", \"seq\"): one trace "
           "then gives memory and FLOPs as formulas (`p.symbolic`) and `p.at(batch=..., "
           "seq=...)`. The report itself is for the sizes the inputs have. Name dimensions with "
           "spec(..., dims=...)."),
    Option("alloc_conf", "str | AllocatorConfig | None", None,
           "CUDA caching-allocator settings for the predicted torch.cuda figures, written as "
           "PYTORCH_ALLOC_CONF is (\"expandable_segments:True,max_split_size_mb:512\"); "
           "default: the environment's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF.",
           ("--alloc-conf",),
           "CUDA caching-allocator settings as PYTORCH_ALLOC_CONF writes them, e.g. "
           "expandable_segments:True (default: the environment's)."),
    Option("checkpointing", "list | tuple", (),
           "activation checkpointing to apply to the traced copy of the model: a plan from "
           "`tapescope.plan_checkpointing`, or module names / (name, \"full\" | \"selective\") "
           "pairs / checkpointing.UnitPolicy values. The model itself is not modified.",
           ("--checkpoint",)),
    Option("compile", "bool | dict | CompileOptions | None", None,
           "profile the step as `torch.compile(model, ...)` runs it: True, or a dict / "
           "`tapescope.CompileOptions` (mode, fullgraph, dynamic, backend, "
           "activation_memory_budget, optimizer). torch.compile's own pipeline runs on fake "
           "tensors (capture/compiled.py); the Profile is the compiled step's, `p.eager` the "
           "same step run eagerly, `p.compiled` what the compiler did (saved and recomputed "
           "tensors, graph breaks, FLOPs with recompute).",
           ("--compile", "--compile-mode", "--fullgraph", "--dynamic",
            "--activation-memory-budget", "--compile-optimizer", "--compile-backend")),
    Option("threads", "int | None", None,
           "the intra-op threads a cpu profile's kernel workspaces are sized for; default: this "
           "machine's (`p.run.cpu` says which).",
           ("--threads",),
           "CPU: the intra-op threads kernels size per-thread scratch for (default: this "
           "machine's).", field="cpu"),
    Option("cpu_isa", "str | None", None,
           "the CPU ISA (\"avx2\", \"avx512\") a cpu profile's kernels are chosen for; default: "
           "this machine's.",
           ("--cpu-isa",),
           "CPU: avx2 or avx512, the ISA oneDNN picks kernels for (default: this machine's).",
           field="cpu"),
    Option("mesh", "dict | MeshSpec | None", None,
           "{\"dp\": 8, \"tp\": 8}: profile every rank of a job on this device mesh (names and "
           "sizes, outermost first, as init_device_mesh takes them; world size = their "
           "product), in this process, with torch's fake process group. `p.peak_bytes` is the "
           "highest rank's, `p.ranks` every rank's; ranks whose shards have the same shapes "
           "are traced once. Inputs are one rank's.",
           ("--fsdp", "--tp", "--hsdp", "--dp-replicate", "--mesh", "--pp", "--cp")),
    Option("parallelize", "Callable | None", None,
           "`parallelize(model, mesh)` applies your torch.distributed code (fully_shard, "
           "parallelize_module, replicate, HSDP ...) to the model and returns it, as your "
           "training script does (with `mesh`).",
           ("--parallelize",)),
    Option("sizes", "Sizes | dict | None", None,
           "what sizes that depend on tensor values are assumed to be (`tapescope.Sizes`): a "
           "mixture of experts' routing, \"balanced\" (default: tokens x top-k / experts per "
           "expert), \"worst\" (every token to one expert) or shares per expert; and "
           "{\"mask\": fraction} for boolean masks no routing decides. Such sizes stay symbols: "
           "`p.symbolic` has the memory as a formula of them, `p.at(name=...)` evaluates it, "
           "and `p.trace.assumptions` / the report name every assumption used.",
           ("--routing", "--mask-fraction")),
    Option("step", "Callable | str | None", None,
           "your own training step, `step(model, batch, optimizer)`, run as written on the fake "
           "model instead of the built-in one (README \"Your own training step\"): `batch` is "
           "the inputs (a tuple; the input_kwargs dict when only those are given), `optimizer` "
           "the one `optimizer=` names (or None). Every op it runs is traced: phases forward "
           "(the model's modules), backward (`loss.backward()`, `torch.autograd.backward` / "
           "`grad`, run by tapescope's engine), optimizer (any optimizer's `step()`, also "
           "inside a backward hook) and other (the rest: the loss, clipping, an EMA). Both "
           "steps are traced in full.",
           ("--step",),
           "FILE.py:FN / MODULE:FN, your own training step FN(model, batch, optimizer), run as "
           "written in place of the built-in one."),
    Option("setup", "Callable | str | None", None,
           "`setup(model) -> state`, run once before step 1 (recorded as setup); its result is "
           "what `step` gets as `optimizer`: several optimizers, a scheduler, an EMA's weights. "
           "Tensors it holds outside optimizers count as optimizer state.",
           ("--setup",),
           "With --step: FILE.py:FN / MODULE:FN, FN(model) -> what the step gets as its "
           "optimizer (several optimizers, a scheduler, an EMA)."),
    Option("pipeline", "str | dict | PipelineSpec | None", None,
           "pipeline parallelism over the mesh's \"pp\" dimension (mesh={\"pp\": 4, ...}): a "
           "schedule name (\"gpipe\", \"1f1b\", \"interleaved-1f1b\", ...) or {\"schedule\": "
           "..., \"microbatches\": M, \"stages_per_rank\": V, \"split\": fn}. "
           "torch.distributed.pipelining's own stages and schedule run on each rank "
           "(docs/distributed.md); the inputs are the first stage's, then the target of the "
           "last stage's `loss_fn(output, target)`. `split(model, stage, num_stages) -> module` "
           "makes a stage; default: the model's block list split evenly, embeddings on the "
           "first stage, norm and output on the last.",
           ("--pp-schedule", "--microbatches", "--pp-split")),
    Option("calibration", "str | Calibration | None", None,
           "a file `tapescope calibrate` wrote on a GPU of this kind (or its Calibration): the "
           "step time is priced from its measurements (README \"Calibrate on your own GPU\"); "
           "default: the file TAPESCOPE_CALIBRATION names, for CUDA profiles. Given without "
           "gpu= or device=, the profile is of the file's GPU.",
           ("--calibration",),
           "A file `tapescope calibrate` wrote on a GPU of this kind: price the step time from "
           "its measurements (default: $TAPESCOPE_CALIBRATION; without --gpu, the file's GPU)."),
    Option("float8", "str | None", None,
           "\"tensorwise\" or \"rowwise\": train the Linears in float8 with torchao's "
           "`convert_to_float8_training`, as torchtitan's float8 converter applies it (dims "
           "multiples of 16, the output head left out; tensorwise under FSDP gathers float8 "
           "weights and precomputes their scales after each optimizer step), on the traced "
           "copy before the preset parallelisation. Needs a GPU of compute capability 8.9+ and "
           "torchao; with your own `parallelize`, convert there instead.",
           ("--float8",),
           "tensorwise or rowwise: float8 Linears (torchao, as torchtitan converts them); GPU "
           "sm89+ only."),
)

OPTION = {o.name: o for o in OPTIONS}

# profile()'s keywords that describe the workload or the call, not how the step runs (Workload,
# the progress callback): not options
WORKLOAD_KEYWORDS = ("model", "inputs", "input_kwargs", "name", "progress")


def profile_options_doc(indent: str = "    ", width: int = 100) -> str:
    """The options' paragraphs of `profile()`'s docstring, in the table's order."""
    import textwrap

    out = []
    for o in OPTIONS:
        out.append(textwrap.fill(f"{o.name}: {o.doc}", width=width, initial_indent=indent,
                                 subsequent_indent=indent + "    "))
    return "\n".join(out)
