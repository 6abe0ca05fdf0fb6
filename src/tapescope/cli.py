"""The `tapescope` command: parse the flags, call the API, hand the result to a renderer.

Nothing here computes: options are checked by `Options.create` and the model spec by
`zoo.resolve`; output files are checked before the work starts (report/files.py). Torch is
imported only by the commands, so that `tapescope --help` answers at once. Every message from
user code (module names, error text) is printed as plain text, never read as rich markup.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from .errors import TapescopeError
from .option_table import OPTION

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="See a whole PyTorch training step before it runs.")
out = Console(width=None if Console().is_terminal else 120, emoji=False)  # "zoo:llama:" is no emoji
err = Console(stderr=True, emoji=False)

DEFAULT_SPEC = "zoo:gpt2"

_spec_help = ("Model: zoo:gpt2, zoo:llama, torchvision:NAME, timm:NAME, hf:CONFIG_CLASS, "
              "path/config.json, path/file.py:build_fn")


@contextmanager
def _progress(label: str, quiet: bool = False, delay: float = 1.0):
    """What a long command is doing, on stderr, once the work takes longer than `delay` seconds:
    on a terminal a spinner with the stage and the time spent; elsewhere (a pipe, a CI log) a
    plain line per stage and traced phase, with the time spent. Never with --quiet. Yields
    `update`: update(step, phase) from a trace, update(message) from longer work that says which
    stage it is in (a layout, a budget)."""
    state = {"stage": "", "detail": "", "bar": None, "task": None}
    done = threading.Event()
    lock = threading.Lock()
    t0 = time.perf_counter()
    plain = not quiet and not err.is_terminal

    def line():
        if plain and time.perf_counter() - t0 >= delay:
            state["printed"] = True
            err.print(Text(f"tapescope: {text()} ({time.perf_counter() - t0:.0f} s)"),
                      highlight=False, soft_wrap=True)

    def text():
        return Text(" - ".join(x for x in (label, state["stage"], state["detail"]) if x))

    def show():
        if done.wait(delay):
            return
        if plain:  # the first line, in case the first stage is long
            with lock:
                if not done.is_set() and not state.get("printed"):
                    line()
            return
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with lock:
            if done.is_set():
                return
            bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                           TimeElapsedColumn(), console=err, transient=True)
            state["task"] = bar.add_task(text(), total=None)
            bar.start()
            state["bar"] = bar

    def update(*args):
        if len(args) == 1:
            state["stage"], state["detail"] = str(args[0]), ""
        else:
            step, phase = args
            state["detail"] = f"step {step} {phase} done"
        with lock:
            if state["bar"] is not None:
                state["bar"].update(state["task"], description=text())
            line()

    t = None
    if not quiet:
        t = threading.Thread(target=show, daemon=True)
        t.start()
    try:
        yield update
    finally:
        done.set()
        if t is not None:
            t.join()
        with lock:
            if state["bar"] is not None:
                state["bar"].stop()


def _fail(e: Exception) -> None:
    err.print(Text.assemble(("error:", "bold red"), " ", str(e)), highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@contextmanager
def _user_errors():
    """A TapescopeError becomes its message and exit status 1 (no traceback)."""
    try:
        yield
    except TapescopeError as e:
        _fail(e)


def _workload(spec, batch, seq, inputs):
    from .options import Workload
    from .zoo import parse_input, resolve

    m = resolve(spec, batch=batch, seq=seq, inputs=[parse_input(i) for i in inputs or []])
    return Workload(m.build, tuple(m.inputs), dict(m.input_kwargs), m.name), m.loss_fn


def _options(model_loss, loss, optimizer, device, gpu, dtype, amp, steps=2, alloc_conf=None,
             symbolic=(), compile=None, threads=None, cpu_isa=None, parallel=None, routing=None,
             mask=None, accumulate=1, step=None, setup=None, pipeline=None, checkpointing=(),
             calibration=None, float8=None):
    from .options import Options

    mesh = parallelize = None
    if parallel is not None:
        from .distributed.presets import parallelization

        mesh, parallelize, amp = parallelization(**parallel, amp=amp)
    if step is not None:  # the step computes its own loss: a zoo model's is not used
        model_loss = None
    return Options.create(loss_fn=model_loss if loss is None else loss,
                          optimizer=None if optimizer == "none" else optimizer,
                          device=device, gpu=gpu, dtype=dtype, amp=amp, steps=steps,
                          alloc_conf=alloc_conf, symbolic=symbolic, compile=compile,
                          threads=threads, cpu_isa=cpu_isa, mesh=mesh, parallelize=parallelize,
                          sizes=_sizes(routing, mask), accumulate=accumulate, step=step,
                          setup=setup, pipeline=pipeline, checkpointing=checkpointing,
                          calibration=calibration, float8=float8)


def _sizes(routing, mask):
    """--routing balanced|worst|4,1,1,1 and --mask-fraction F as a sizes= value."""
    if routing is None and mask is None:
        return None
    if routing is not None and "," in routing:
        try:
            routing = tuple(float(x) for x in routing.split(","))
        except ValueError:
            raise TapescopeError(f"--routing {routing!r}: give balanced, worst or shares per "
                                 "expert such as 4,1,1,1") from None
    return {"routing": routing or "balanced", "mask": mask}


def _run_profile(spec, batch, seq, device, dtype, optimizer, steps, inputs, amp=None, gpu=None,
                 alloc_conf=None, loss=None, compile=None, threads=None, cpu_isa=None,
                 parallel=None, routing=None, mask=None, accumulate=1, step=None, setup=None,
                 checkpointing=(), quiet=False, pipeline=None, calibration=None, float8=None):
    from .api import profile_workload

    workload, model_loss = _workload(spec, batch, seq, inputs)
    wanted = (pipeline or {}).get("microbatches")
    first = workload.args[0] if workload.args else None
    if wanted and batch is None and not inputs and getattr(first, "shape", None) \
            and first.shape[0] < wanted:
        # a model's default batch (the zoo's 4) cannot make more micro-batches than samples:
        # give each micro-batch one sample, and say so
        err.print(f"batch {wanted} (one sample per micro-batch; {workload.name}'s default batch "
                  f"is {first.shape[0]}): give --batch to choose another", highlight=False,
                  markup=False)
        workload, model_loss = _workload(spec, wanted, seq, inputs)
    options = _options(model_loss, loss, optimizer, device, gpu, dtype, amp, steps, alloc_conf,
                       compile=compile, threads=threads, cpu_isa=cpu_isa, parallel=parallel,
                       routing=routing, mask=mask, accumulate=accumulate, step=step, setup=setup,
                       pipeline=pipeline, checkpointing=checkpointing,
                       calibration=calibration, float8=float8)
    what = "compiling and tracing" if compile else "tracing"
    with _progress(f"{what} {workload.name} on fake {options.device.type} tensors",
                   quiet) as progress:
        if options.compile is not None:
            progress = _compile_stages(progress, options.steps)
        return profile_workload(workload, options, progress)


def _compile_stages(progress, steps: int):
    """A compiled profile traces the eager step first, then compiles (long, and silent: dynamo,
    AOTAutograd, inductor) and traces the compiled one: say which is under way."""
    state = {"eager": True}
    progress("the eager step")

    def update(step, phase):
        progress(step, phase)
        if state["eager"] and step == steps and phase == "zero_grad":
            state["eager"] = False
            progress("compiling (dynamo, AOTAutograd, inductor), then the compiled step")
    return update


def _invocation(command, spec, batch, seq, inputs, loss, dtype, amp, optimizer, gpu=None,
                budget=None, param_dtype=None, float8=None):
    """How the user asked (report/advice.py), to write the next commands with the same model,
    sizes and precision. `float8` only where every next command takes --float8 (fit --gpus
    suggests fit and profile; profile's advice also suggests plan, which has no --float8)."""
    from .report.advice import Invocation

    flags = []
    for flag, value in (("--batch", batch), ("--seq", seq), ("--dtype", dtype), ("--amp", amp),
                        ("--loss", loss), ("--float8", float8)):
        if value is not None:
            flags += [flag, str(value)]
    for i in inputs or ():
        flags += ["--input", i]
    if optimizer and optimizer != "adamw":
        flags += ["--optimizer", optimizer]
    return Invocation(command, spec, tuple(flags), gpu=gpu, budget=budget, amp=amp is not None,
                      dtype_fp32=param_dtype in (None, "float32"), optimizer=optimizer)


def _compile_options(compile, mode, fullgraph, dynamic, budget, compile_optimizer, backend):
    """--compile and its companions as one CompileOptions (None: the step is not compiled); any
    companion implies --compile."""
    asked = (mode, fullgraph, dynamic, budget, compile_optimizer, backend)
    if not compile and all(x in (None, False) for x in asked):
        return None
    from .options import CompileOptions

    dyn = {None: None, "true": True, "false": False}.get(dynamic.lower() if dynamic else None, "?")
    if dyn == "?":
        raise TapescopeError(f"--dynamic takes true or false, got {dynamic!r}")
    return CompileOptions(mode=mode, fullgraph=fullgraph, dynamic=dyn, backend=backend or "inductor",
                          activation_memory_budget=budget, optimizer=compile_optimizer)


def _check_outputs(**paths) -> dict:
    """Fail now, not after the work, if an output file cannot be written."""
    from .report.files import check_writable, same_file_twice

    for flag, path in paths.items():
        if path:
            check_writable(path, "--" + flag.replace("_", "-"))
    twice = same_file_twice(paths)
    if twice is not None:
        a, b, path = twice
        raise TapescopeError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')} both name "
                             f"{path}: the second would overwrite the first; give two files")
    return paths


def _write_json(path: str | None, data) -> None:
    if path:
        from .report.files import write_json

        write_json(path, data)
        out.print(Text(f"wrote {path}"))


def option_flag(name: str):
    """The typer option of an option set by one flag, from its declaration (option_table.py)."""
    o = OPTION[name]
    return typer.Option(o.default, *o.flags, help=o.help)


SpecArg = typer.Argument(DEFAULT_SPEC, help=_spec_help, show_default=True)
BatchOpt = typer.Option(None, "--batch", "-b", help="Batch size (default: the model's).")
SeqOpt = typer.Option(None, "--seq", "-s", help="Sequence length (image size for vision models).")
DeviceOpt = option_flag("device")
DtypeOpt = option_flag("dtype")
AmpOpt = option_flag("amp")
GpuOpt = option_flag("gpu")
OptimOpt = option_flag("optimizer")
StepsOpt = option_flag("steps")
InputOpt = typer.Option(None, "--input", "-i", help="An input shape, e.g. 4,128 or 4,128:int64; repeat for several.")
LossOpt = option_flag("loss_fn")
JsonOpt = typer.Option(None, "--json", help="Write the result as JSON to this file.")
ThreadsOpt = option_flag("threads")
CpuIsaOpt = option_flag("cpu_isa")
FsdpOpt = typer.Option(1, "--fsdp", help="FSDP2 over N ranks: every block and the root sharded (torchtitan's wrap).")
TpOpt = typer.Option(1, "--tp", help="Tensor parallel over M ranks, with the architecture's Megatron-style plan.")
HsdpOpt = typer.Option(1, "--hsdp", help="With --fsdp: replicate the shards R times (HSDP); alone, DDP over R ranks.")
DpReplicateOpt = typer.Option(1, "--dp-replicate", help="Data parallel replicas R (same as --hsdp).")
CpOpt = typer.Option(1, "--cp", help="Context parallel over C ranks: the sequence split, SDPA as torch's ring attention; FSDP shards over fsdp x cp.")
ParallelizeOpt = typer.Option(None, "--parallelize", help="file.py:fn, your parallelize(model, mesh); with --mesh dp=4,tp=2.")
MeshOpt = typer.Option(None, "--mesh", help="With --parallelize: the device mesh, names and sizes, e.g. dp=4,tp=2.")
QuietOpt = typer.Option(False, "--quiet", "-q",
                        help="No progress on stderr (shown only on a terminal, once the work "
                             "takes over a second).")


PpOpt = typer.Option(1, "--pp", help="Pipeline parallel over N ranks (torch.distributed.pipelining), outermost.")
PpScheduleOpt = typer.Option(None, "--pp-schedule",
                             help="With --pp: gpipe, 1f1b (default), interleaved-1f1b, looped-bfs, "
                                  "interleaved-zb, zbv, dualpipev.")
MicrobatchesOpt = typer.Option(None, "--microbatches",
                               help="With --pp: micro-batches per step (default: one per sample).")
PpSplitOpt = typer.Option(None, "--pp-split",
                          help="With --pp: FILE.py:FN, FN(model, stage, num_stages) -> the stage's "
                               "module (default: the block list split evenly).")


def _parallel(fsdp, tp, hsdp, dp_replicate, parallelize, mesh, pp=1, cp=1) -> dict:
    return dict(fsdp=fsdp, tp=tp, hsdp=hsdp, dp_replicate=dp_replicate, parallelize=parallelize,
                mesh=mesh, pp=pp, cp=cp)


def _pipeline(schedule, microbatches, split) -> dict | None:
    """profile(pipeline=...) from --pp-schedule / --microbatches / --pp-split (None when none is
    given: a "pp" mesh dimension alone runs 1F1B with one micro-batch per sample)."""
    if schedule is None and microbatches is None and split is None:
        return None
    out = {"schedule": schedule or "1f1b", "microbatches": microbatches}
    if split is not None:
        from .loading import load_function

        out["split"] = load_function(split, "--pp-split")
    return out


StepOpt = option_flag("step")
SetupOpt = option_flag("setup")
AccumulateOpt = option_flag("accumulate")
RoutingOpt = typer.Option(None, "--routing",
                          help="Mixture-of-experts routing to assume: balanced (default: tokens x "
                               "top-k / experts each), worst (every token to one expert) or shares "
                               "per expert, e.g. 4,1,1,1.")
MaskOpt = typer.Option(None, "--mask-fraction",
                       help="Fraction of elements a boolean mask keeps (x[x > 0], nonzero) where "
                            "no routing decides it.")
AllocConfOpt = option_flag("alloc_conf")
CalibrationOpt = option_flag("calibration")
Float8Opt = option_flag("float8")
CheckpointOpt = typer.Option(
    None, "--checkpoint",
    help="Checkpoint a module (repeat): MODULE (full), MODULE:selective:OP,OP (keep those aten "
         "ops' outputs, e.g. aten.mm.default), or a `tapescope plan --json` file.")


def _checkpointing(values) -> list:
    """--checkpoint values as UnitPolicy sources: fqns, (fqn, mode, save_ops), a plan's JSON."""
    policies = []
    for v in values or ():
        if v.endswith(".json"):
            import json

            try:
                with open(v) as f:
                    plan = json.load(f)
            except (OSError, ValueError, RecursionError) as e:
                why = "nested too deeply" if isinstance(e, RecursionError) else e
                raise TapescopeError(f"--checkpoint {v}: cannot read it as JSON ({why})") from None
            if not isinstance(plan, dict) or not isinstance(plan.get("policies"), list):
                raise TapescopeError(f"--checkpoint {v}: not a checkpointing plan, whose "
                                     "\"policies\" is a list (write one with `tapescope plan "
                                     "SPEC --budget B --json FILE.json`)")
            policies += plan["policies"]
            continue
        fqn, _, rest = v.partition(":")
        mode, _, ops = rest.partition(":")
        policies.append((fqn, mode or "full", tuple(o for o in ops.split(",") if o)))
    return policies


CompileOpt = typer.Option(False, "--compile", help="Profile the step as torch.compile runs it, beside eager.")
ModeOpt = typer.Option(None, "--compile-mode", help="torch.compile mode: default, max-autotune, ... (implies --compile).")
FullgraphOpt = typer.Option(False, "--fullgraph", help="torch.compile(fullgraph=True): a graph break is an error.")
DynamicOpt = typer.Option(None, "--dynamic", help="torch.compile(dynamic=true|false).")
BudgetOpt = typer.Option(None, "--activation-memory-budget",
                         help="functorch's partitioner budget, 0..1 (implies --compile).")
CompileOptimOpt = typer.Option(False, "--compile-optimizer", help="Also torch.compile optimizer.step.")
BackendOpt = typer.Option(None, "--compile-backend", help="inductor (default) or aot_eager.")


@app.command("profile")
def profile_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt,
    gpu: Optional[str] = GpuOpt,
    optimizer: str = OptimOpt, steps: int = StepsOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt, alloc_conf: Optional[str] = AllocConfOpt,
    threads: Optional[int] = ThreadsOpt, cpu_isa: Optional[str] = CpuIsaOpt,
    fsdp: int = FsdpOpt, tp: int = TpOpt, hsdp: int = HsdpOpt, dp_replicate: int = DpReplicateOpt,
    parallelize: Optional[str] = ParallelizeOpt, mesh: Optional[str] = MeshOpt,
    routing: Optional[str] = RoutingOpt, mask_fraction: Optional[float] = MaskOpt,
    accumulate: int = AccumulateOpt, step: Optional[str] = StepOpt,
    setup: Optional[str] = SetupOpt,
    pp: int = PpOpt, pp_schedule: Optional[str] = PpScheduleOpt,
    microbatches: Optional[int] = MicrobatchesOpt, pp_split: Optional[str] = PpSplitOpt,
    cp: int = CpOpt,
    json_file: Optional[str] = typer.Option(None, "--json", help="Write the whole profile as JSON."),
    graph_file: Optional[str] = typer.Option(None, "--graph", help="Write the step's FX graph (Python code with meta)."),
    html_file: Optional[str] = typer.Option(None, "--html", help="Write an interactive, self-contained HTML report."),
    png_file: Optional[str] = typer.Option(None, "--png", help="Write the memory timeline as a PNG figure."),
    top: int = typer.Option(8, "--top", help="Rows in each table."),
    compile: bool = CompileOpt, compile_mode: Optional[str] = ModeOpt, fullgraph: bool = FullgraphOpt,
    dynamic: Optional[str] = DynamicOpt, activation_memory_budget: Optional[float] = BudgetOpt,
    compile_optimizer: bool = CompileOptimOpt, compile_backend: Optional[str] = BackendOpt,
    checkpoint: Optional[List[str]] = CheckpointOpt, quiet: bool = QuietOpt,
    calibration: Optional[str] = CalibrationOpt, float8: Optional[str] = Float8Opt,
):
    """Peak memory and what causes it, FLOPs by phase, top modules, uncounted ops; with --compile,
    the step as torch.compile runs it beside the eager one."""
    with _user_errors():
        _check_outputs(json=json_file, graph=graph_file, html=html_file, png=png_file)
        if png_file:
            from .report.png import require_matplotlib

            require_matplotlib()
        t0 = time.perf_counter()
        compile_options = _compile_options(compile, compile_mode, fullgraph, dynamic,
                                           activation_memory_budget, compile_optimizer,
                                           compile_backend)
        p = _run_profile(spec, batch, seq, device, dtype, optimizer, steps, input, amp, gpu,
                         alloc_conf, loss, compile=compile_options, threads=threads,
                         cpu_isa=cpu_isa,
                         parallel=_parallel(fsdp, tp, hsdp, dp_replicate, parallelize, mesh,
                                            pp, cp),
                         routing=routing, mask=mask_fraction, accumulate=accumulate,
                         step=step, setup=setup, checkpointing=_checkpointing(checkpoint),
                         quiet=quiet, pipeline=_pipeline(pp_schedule, microbatches, pp_split),
                         calibration=calibration, float8=float8)
        elapsed = time.perf_counter() - t0
        from .report.console import render_compiled, render_summary

        gpu_name = gpu or (p.gpu.key if p.gpu is not None else None)
        # the next commands start from one device; a parallelised step's are not written yet
        invocation = None if p.distributed is not None else _invocation(
            "profile", spec, batch, seq, input, loss, dtype, amp, optimizer, gpu=gpu_name,
            param_dtype=p.run.param_dtype)
        render_summary(p, out, top=top, invocation=invocation)
        if p.compiled is not None:
            render_compiled(p, out, top=top)
        out.print(Text(f"{len(p.ops)} ops traced in {elapsed:.2f} s; tapescope never allocated "
                       "the model.", style="dim"))
        _write_json(json_file, p.to_dict())
        if graph_file:
            from .report.files import write_text
            from .report.graph_file import graph_file_text

            write_text(graph_file, graph_file_text(p))
            out.print(Text(f"wrote {graph_file}"))
        if html_file:
            from .report.html import write_html

            write_html(p, html_file)
            out.print(Text(f"wrote {html_file}"))
        if png_file:
            from .report.png import write_png

            write_png(p, png_file)
            out.print(Text(f"wrote {png_file}"))


@app.command("budget-sweep")
def budget_sweep_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt,
    optimizer: str = OptimOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt,
    budgets: str = typer.Option("0,0.1,0.25,0.5,0.75,1", "--budgets",
                                help="activation_memory_budget values, comma-separated."),
    compile_mode: Optional[str] = ModeOpt, dynamic: Optional[str] = DynamicOpt,
    json_file: Optional[str] = typer.Option(None, "--json", help="Write the table as JSON."),
    quiet: bool = QuietOpt,
):
    """The compiled step's physical peak for each functorch activation_memory_budget."""
    with _user_errors():
        _check_outputs(json=json_file)
        try:
            values = [float(b) for b in budgets.split(",") if b.strip()]
        except ValueError as e:
            raise TapescopeError(f"--budgets: {e}") from None
        wrong = [b for b in values if not 0 <= b <= 1]  # before the first (slow) compile
        if wrong or not values:
            raise TapescopeError(f"--budgets: each activation_memory_budget must be in [0, 1], got "
                                 f"{', '.join(f'{b:g}' for b in wrong) or 'none'}; e.g. "
                                 "--budgets 0.1,0.5,1")
        from .report.text import fmt_bytes, fmt_flops
        from .sweeps import budget_sweep, sweep_notes

        workload, model_loss = _workload(spec, batch, seq, input)
        compile = _compile_options(True, compile_mode, False, dynamic, None, False, None)
        options = _options(model_loss, loss, optimizer, device, None, dtype, amp, compile=compile)
        points = []
        with _progress(f"compiling {workload.name} at {len(values)} budgets", quiet) as progress:
            for i, b in enumerate(values):
                progress(f"budget {b:g} ({i + 1} of {len(values)})")
                points += budget_sweep(workload, options, [b], progress)
        out.print(Text.assemble((workload.name, "bold"), f" compiled ({options.device.type}): "
                                "physical peak per activation_memory_budget"))
        out.print(f"  {'budget':>6}  {'peak':>12}  {'first step':>12}  {'saved':>12}  "
                  f"{'recomputed':>10}  {'recompute':>12}", highlight=False, markup=False)
        for pt in points:
            out.print(f"  {pt.budget:>6.2f}  {fmt_bytes(pt.peak_bytes):>12}  "
                      f"{fmt_bytes(pt.first_step_peak_bytes):>12}  {fmt_bytes(pt.saved_bytes):>12}  "
                      f"{pt.recomputed_ops:>10}  {fmt_flops(pt.recompute_flops):>12}",
                      highlight=False, markup=False)
        notes = sweep_notes(points)
        for note in notes:
            out.print(Text.assemble(("note: ", "yellow"), note), highlight=False)
        _write_json(json_file, {"model": workload.name, "points": [p.to_dict() for p in points],
                                "notes": notes})


@app.command("ops")
def ops_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt,
    gpu: Optional[str] = GpuOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt,
    optimizer: bool = typer.Option(False, "--with-optimizer", help="Also list the optimizer's ops."),
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
):
    """The forward<->backward op table: seq_nr | aten op | module, forward rows then backward."""
    with _user_errors():
        _check_outputs(json=json_file)
        phases = ("forward", "backward", "optimizer") if optimizer else ("forward", "backward")
        p = _run_profile(spec, batch, seq, device, dtype, "adamw" if optimizer else "none", 1,
                         input, amp=amp, gpu=gpu, loss=loss, quiet=quiet)
        from .report.console import render_ops
        from .report.json import ops_dict

        render_ops(p, out, phases=phases)
        _write_json(json_file, ops_dict(p, phases))


@app.command("explain")
def explain_cmd(
    op: Optional[str] = typer.Argument(None, help="An op: aten::rms_norm, aten.add.Tensor, ..."),
    device: str = DeviceOpt, dtype: Optional[str] = typer.Option("fp32", "--dtype"),
    model: Optional[str] = typer.Option(None, "--model", help="Explain every op of this model's step."),
    batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
):
    """How the dispatcher handles an op on a device, what autograd records and what its backward runs."""
    with _user_errors():
        _check_outputs(json=json_file)
        from .analysis.explain import describe_kernel, explain_op, explain_profile, render
        from .options import resolve_device, resolve_dtype
        from .report.json import to_jsonable

        if model is None:
            if op is None:
                raise TapescopeError("give an op (tapescope explain aten::rms_norm) or --model SPEC")
            dev = resolve_device(device or "cpu")
            try:
                dt = resolve_dtype(dtype)
            except ValueError as exc:
                raise TapescopeError(str(exc)) from None
            try:
                e = explain_op(op, dev.type, dt)
            except ValueError as exc:
                raise TapescopeError(f"{exc}; to explain an op in context use --model SPEC") from None
            out.print(render(e), highlight=False, markup=False)
            _write_json(json_file, to_jsonable(e))
            return
        p = _run_profile(model, batch, seq, device, dtype if dtype != "fp32" else None, "none", 1, None,
                         quiet=quiet)
        rows = []
        for name, autograd, backend, node, bwd in explain_profile(p.ops, p.trace.device.type):
            if op and op not in name:
                continue
            rows.append({"op": name, "autograd_kernel": describe_kernel(autograd),
                         "backend_kernel": describe_kernel(backend), "autograd_node": node,
                         "backward_ops": list(bwd)})
            out.print(Text(name, style="bold"), highlight=False)
            out.print(f"  Autograd key: {describe_kernel(autograd)}", highlight=False, markup=False)
            out.print(f"  backend key:  {describe_kernel(backend)}", highlight=False, markup=False)
            if node:
                out.print(f"  autograd records {node}; its backward runs: {', '.join(bwd) or 'nothing'}",
                          highlight=False, markup=False)
        _write_json(json_file, {"model": p.model, "device": p.device, "ops": rows})


@app.command("diff")
def diff_cmd(
    spec: str = SpecArg, device: str = typer.Option("meta", "--device", help="First device."),
    vs: str = typer.Option("cuda", "--vs", help="Second device."),
    batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt, dtype: Optional[str] = DtypeOpt,
    amp: Optional[str] = AmpOpt, optimizer: str = OptimOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt,
    top: int = typer.Option(12, "--top", help="Differences to show."),
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
):
    """The same step traced on two devices: aligned op sequences, each difference explained."""
    with _user_errors():
        _check_outputs(json=json_file)
        a = _run_profile(spec, batch, seq, device, dtype, optimizer, 2, input, amp, loss=loss,
                         quiet=quiet)
        b = _run_profile(spec, batch, seq, vs, dtype, optimizer, 2, input, amp, loss=loss,
                         quiet=quiet)
        from .analysis.diff import diff_steps
        from .report.console import render_diff
        from .report.json import diff_dict

        d = diff_steps(a.ops, b.ops, a.trace.device.type, b.trace.device.type)
        render_diff(a, b, d, out, top=top)
        _write_json(json_file, diff_dict(a, b, d))


@app.command("fit")
def fit_cmd(
    spec: str = SpecArg, gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU whose memory to fill (h100, a100, ...)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget, e.g. 24GiB (default: the GPU's memory less a reserve)."),
    seq: Optional[int] = SeqOpt, batch: Optional[int] = typer.Option(None, "--batch", "-b", help="Fix the batch and find the longest sequence."),
    device: Optional[str] = typer.Option(None, "--device", "-d", help="Default: cuda with --gpu, else cpu."),
    dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt, optimizer: str = OptimOpt,
    input: Optional[List[str]] = InputOpt, loss: Optional[str] = LossOpt,
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Also print the peak for sizes A..B, e.g. 1..4096."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Compare the (FSDP, TP) layouts of this many GPUs of --gpu."),
    pp: Optional[str] = typer.Option(None, "--pp", help="With --gpus: pipeline degrees to try too, e.g. 1,2,4 (1F1B, one micro-batch per sample)."),
    cp: Optional[str] = typer.Option(None, "--cp", help="With --gpus: context-parallel degrees to try too, e.g. 1,2,4 (the sequence split; without a pipeline)."),
    checkpoint: Optional[List[str]] = CheckpointOpt,
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
    calibration: Optional[str] = CalibrationOpt, float8: Optional[str] = Float8Opt,
):
    """The largest batch (or, with --batch, sequence length) whose step fits the memory budget.

    Exits 1 when not even the smallest size fits."""
    with _user_errors():
        _check_outputs(json=json_file)
        from .fit import fit_workload, parse_bytes, parse_sweep, sweep as sweep_sizes

        if gpus is not None:
            if device not in (None, "cuda"):
                raise TapescopeError(f"fit --gpus compares layouts of GPUs, traced as CUDA runs "
                                     f"them; --device {device} cannot be used with --gpus (drop "
                                     f"--device, or profile --fsdp {gpus} --device {device})")
            if sweep is not None:
                raise TapescopeError("--sweep cannot be used with --gpus (each layout is profiled "
                                     "at one batch); drop --sweep, or run fit without --gpus")
            return _fit_layouts(spec, gpus, gpu, batch, seq, input, loss, dtype, amp, optimizer,
                                json_file, parse_bytes(budget) if budget is not None else None,
                                quiet, _pp_degrees(pp), calibration, _checkpointing(checkpoint),
                                _pp_degrees(cp, "--cp"), float8)
        if pp is not None or cp is not None:
            flag = "--pp" if pp is not None else "--cp"
            raise TapescopeError(f"{flag} goes with --gpus (the degrees to compare); to profile "
                                 f"one such layout, run profile {flag} N")
        dim = "seq" if batch is not None else "batch"
        sweep_range = parse_sweep(sweep) if sweep else None
        budget_bytes = parse_bytes(budget) if budget is not None else None
        workload, model_loss = _workload(spec, batch, seq, input)
        options = _options(model_loss, loss, optimizer, device, gpu, dtype, amp,
                           calibration=calibration, checkpointing=_checkpointing(checkpoint),
                           float8=float8)
        with _progress(f"tracing {workload.name} with a symbolic {dim}", quiet) as progress:
            r = fit_workload(workload, options, budget=budget_bytes, dim=dim, progress=progress)
        rows = sweep_sizes(r, *sweep_range) if sweep_range else None
        from .report.console import render_fit
        from .report.json import fit_dict

        render_fit(r, workload.name, options, out, rows, invocation=_invocation(
            "fit", spec, batch, seq, input, loss, dtype, amp, optimizer, gpu=gpu, budget=budget,
            param_dtype=r.profile.run.param_dtype))
        _write_json(json_file, fit_dict(r, workload.name, options, rows))
    if r.value is None:
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(
    spec: str = SpecArg,
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget, e.g. 40GiB (default with --gpu: its memory less a reserve)."),
    gpu: Optional[str] = GpuOpt, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt,
    optimizer: str = OptimOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt,
    unit: Optional[List[str]] = typer.Option(None, "--unit", "-u", help="A module to consider checkpointing (repeat; default: the layers of the model's stacks)."),
    pareto: int = typer.Option(0, "--pareto", help="Also trace this many budgets: budget -> re-traced peak -> recompute cost."),
    max_traces: int = typer.Option(4, "--max-traces", help="Re-traces the search may spend correcting its estimate."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Write the plan as JSON (policies, peaks, costs, code)."),
    code_file: Optional[str] = typer.Option(None, "--code", help="Write the plan as Python (apply_checkpointing(model))."),
    quiet: bool = QuietOpt, calibration: Optional[str] = CalibrationOpt,
):
    """What to recompute (activation checkpointing) so that the step fits the budget; the plan's
    peak is the step re-traced with the plan applied.

    Exits 1 when no plan meets the budget, saying why and what to try next."""
    with _user_errors():
        _check_outputs(json=json_file, code=code_file)
        from .checkpointing import plan_workload
        from .report.console import render_plan

        workload, model_loss = _workload(spec, batch, seq, input)
        options = _options(model_loss, loss, optimizer, device, gpu, dtype, amp,
                           calibration=calibration)
        with _progress(f"planning checkpointing for {workload.name}", quiet) as progress:
            plan = plan_workload(workload, options, budget=budget, units=unit or None,
                                 max_traces=max_traces, pareto=pareto,
                                 progress=progress)
        render_plan(plan, workload.name, options, out, invocation=_invocation(
            "plan", spec, batch, seq, input, loss, dtype, amp, optimizer,
            gpu=gpu or (options.gpu.key if options.gpu is not None else None), budget=budget,
            param_dtype=plan.profile.run.param_dtype if plan.profile else None))
        _write_json(json_file, plan.to_dict())
        if code_file:
            from .report.files import write_text

            write_text(code_file, plan.code())
            out.print(Text(f"wrote {code_file}"))
    if not plan.meets_budget:
        raise typer.Exit(1)


def _pp_degrees(text, flag: str = "--pp") -> tuple:
    """--pp 1,2,4 (or --cp) -> (1, 2, 4); default (1,): not parallelised that way."""
    if text is None:
        return (1,)
    try:
        degrees = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        degrees = ()
    if not degrees or any(d < 1 for d in degrees):
        raise TapescopeError(f"cannot read {flag} {text!r}: give degrees >= 1, e.g. 1,2,4")
    return tuple(dict.fromkeys(degrees))


def _fit_layouts(spec, gpus, gpu, batch, seq, inputs, loss, dtype, amp, optimizer,
                 json_file, budget=None, quiet=False, pp_degrees=(1,),
                 calibration=None, checkpointing=(), cp_degrees=(1,), float8=None) -> None:
    """fit --gpus: every (FSDP, TP) layout of this many GPUs, profiled per rank; with a budget, a
    layout fits when its peak per rank is within it; a checkpointing plan applied in each.
    Exits 1 when none fits."""
    from .layouts import best_layout, fit_layouts
    from .report.console import render_layouts

    workload, model_loss = _workload(spec, batch, seq, inputs)
    options = _options(model_loss, loss, optimizer, "cuda", gpu, dtype, amp,
                       calibration=calibration, checkpointing=checkpointing, float8=float8)
    with _progress(f"profiling the layouts of {gpus} GPUs for {workload.name}",
                   quiet) as progress:
        rows = fit_layouts(workload, options, gpus, budget=budget, progress=progress,
                           stage=progress, pp_degrees=pp_degrees, cp_degrees=cp_degrees)
    best = best_layout(rows)
    shapes = " × ".join("x".join(str(n) for n in a.shape) for a in workload.args
                        if getattr(a, "shape", None) is not None)
    render_layouts(rows, workload.name, gpus, options, out, budget=budget, best=best, inputs=shapes,
                   invocation=_invocation("fit", spec, batch, seq, inputs, loss, dtype, amp,
                                          optimizer, gpu=options.gpu.key,
                                          budget=None if budget is None else f"{budget}B",
                                          float8=float8))
    _write_json(json_file, {"model": workload.name, "gpus": gpus, "gpu": options.gpu.key,
                            "budget_bytes": budget, "layouts": [r.to_dict() for r in rows],
                            "checkpointing": [p.to_dict() for p in options.checkpointing],
                            "float8": options.float8,
                            "best": None if best is None else str(best.layout)})
    if not any(r.fits for r in rows):
        raise typer.Exit(1)


@app.command("calibrate")
def calibrate_cmd(
    spec: Optional[str] = typer.Argument(None, help="The model whose GEMM and attention shapes "
                                         "to measure (as profile takes it); default: "
                                         "transformer-sized shapes."),
    batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt, dtype: Optional[str] = DtypeOpt,
    amp: Optional[str] = AmpOpt, input: Optional[List[str]] = InputOpt,
    loss: Optional[str] = LossOpt, optimizer: str = OptimOpt,
    fsdp: int = FsdpOpt, tp: int = TpOpt, hsdp: int = HsdpOpt,
    out_file: str = typer.Option("calibration.json", "--out", "--json",
                                 help="The calibration file to write."),
    deadline: float = typer.Option(540.0, "--deadline",
                                   help="Seconds after which no new measurement starts."),
    quiet: bool = QuietOpt,
):
    """Measure this machine's GPU (GEMMs at your step's shapes, attention, bandwidth, launch
    overhead) and write a calibration file for --calibration on any machine. Needs a GPU."""
    with _user_errors():
        _check_outputs(out=out_file)
        from .calibration import calibrate
        from .calibration.measure import require_gpu

        device = require_gpu()           # before any tracing: one line when there is none
        profile = None
        if spec is not None:
            import torch

            workload, model_loss = _workload(spec, batch, seq, input)
            # a rank's shapes: tensor parallelism shards its GEMMs, FSDP its batch
            parallel = None if (fsdp, tp, hsdp) == (1, 1, 1) else _parallel(
                fsdp, tp, hsdp, 1, None, None)
            options = _options(model_loss, loss, optimizer, "cuda",
                               torch.cuda.get_device_name(device), dtype, amp,
                               parallel=parallel)
            with _progress(f"tracing {workload.name} for its kernel shapes", quiet) as progress:
                from .api import profile_workload

                profile = profile_workload(workload, options, progress)
        with _progress("measuring the GPU", quiet) as progress:
            cal = calibrate(profile, out=out_file, deadline_s=deadline, progress=progress)
        from .report.console import render_calibration

        render_calibration(cal, out)
        out.print(Text(f"wrote {out_file}"))


def _ints(text, flag) -> tuple | None:
    """'1,2,4' -> (1, 2, 4); None stays None (the search's default)."""
    if text is None:
        return None
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise TapescopeError(f"cannot read {flag} {text!r}: give degrees >= 1, e.g. 1,2,4")
    return values


@app.command("search")
def search_cmd(
    spec: str = SpecArg,
    gpus: int = typer.Option(..., "--gpus", help="GPUs of the job."),
    gpu: str = typer.Option("h100", "--gpu", help="Their kind (h100, a100, ...)."),
    global_batch: int = typer.Option(..., "--global-batch", help="Samples per optimizer step of the whole job."),
    seq: Optional[int] = SeqOpt,
    amp: str = typer.Option("bf16", "--amp", help="FSDP2 mixed precision (torchtitan's default bf16); none for fp32."),
    dtype: Optional[str] = DtypeOpt, optimizer: str = OptimOpt,
    pp: Optional[str] = typer.Option(None, "--pp", help="Pipeline degrees to try, e.g. 1,2,4 (default: powers of two up to 8)."),
    tp: Optional[str] = typer.Option(None, "--tp", help="Tensor-parallel degrees to try (default: powers of two within a node)."),
    cp: Optional[str] = typer.Option(None, "--cp", help="Context-parallel degrees to try (default: those leaving each rank 8k tokens or more of --seq)."),
    hsdp: bool = typer.Option(True, "--hsdp/--no-hsdp", help="Also HSDP, shard groups of one and two nodes."),
    checkpointing: str = typer.Option("none,selective,full", "--checkpointing", help="Activation checkpointing modes to try on every block."),
    schedule: str = typer.Option("1f1b", "--pp-schedule", help="Pipeline schedules to try, e.g. 1f1b,gpipe."),
    compile: bool = typer.Option(False, "--compile", help="Also try each candidate compiled."),
    float8: Optional[str] = typer.Option(None, "--float8", help="Also try each candidate with float8 Linears of this recipe (tensorwise or rowwise; GPU sm89+)."),
    max_steps: int = typer.Option(16, "--max-steps", help="Most micro-batches per step a candidate may trace."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Local worker processes (default: the CPU cores)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Run candidates on this Ray cluster (local: start one here)."),
    cache: Optional[str] = typer.Option(None, "--cache", help="A file of finished candidates: an interrupted search resumes from it."),
    brute_force: bool = typer.Option(False, "--brute-force", help="Trace every candidate (no pruning)."),
    top: int = typer.Option(10, "--top", help="Rows of the table, kept exact: a candidate that provably cannot enter them is not traced."),
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
    time_limit: Optional[float] = typer.Option(None, "--time-limit", metavar="MIN", help="Stop after this many minutes and report the best traced so far (marked partial)."),
):
    """The layout, micro-batch split and activation checkpointing that train fastest on N GPUs,
    each candidate traced on every rank class; the winner as commands to run.

    Exits 1 when no candidate fits. Stopped by --time-limit, it prints and writes what it
    traced, marked partial, and exits as a complete search would (0, or 1 when no traced
    candidate fits); stopped by Ctrl-C or SIGTERM, it prints and writes the same, then exits
    130 or 143."""
    import os

    with _user_errors():
        _check_outputs(json=json_file)
        if time_limit is not None and not time_limit > 0:
            raise TapescopeError(f"cannot read --time-limit {time_limit:g}: give minutes above "
                                 "0, e.g. 15")
        from .layout_search import (SearchInterrupted, SearchTerminated, result_dict, search,
                                    winner_commands)
        from .report.search import progress_line, render_search

        modes = tuple(m.strip() for m in checkpointing.split(",") if m.strip())
        try:
            with _progress(f"searching the layouts of {gpus} x {gpu} for {spec}",
                           quiet) as update:
                def show(p):
                    if err.is_terminal:  # the spinner's line: done / pruned / left, the best
                        update(progress_line(p))
                    elif not quiet:      # a log: one plain line per candidate
                        err.print(Text(progress_line(p)), highlight=False, soft_wrap=True)
                r = search(spec, gpus=gpus, gpu=gpu, global_batch=global_batch, seq=seq,
                           amp=None if amp.lower() in ("none", "fp32") else amp, dtype=dtype,
                           optimizer=optimizer, pp=_ints(pp, "--pp"), tp=_ints(tp, "--tp"),
                           cp=_ints(cp, "--cp"),
                           hsdp=hsdp, checkpointing=modes,
                           schedules=tuple(x.strip() for x in schedule.split(",") if x.strip()),
                           compile=(False, True) if compile else (False,), max_steps=max_steps,
                           float8=(None, float8) if float8 else (None,),
                           workers=workers if workers is not None else (os.cpu_count() or 1),
                           ray=ray, cache=cache, brute_force=brute_force, top=top,
                           progress=show,
                           time_limit=None if time_limit is None else time_limit * 60)
            status = 0 if r.winner is not None else 1
        except (SearchInterrupted, SearchTerminated) as e:  # what it traced, then 130 / 143
            r, status = e.result, e.status
        render_search(r, out, top=top, commands=winner_commands(r))
        _write_json(json_file, result_dict(r))
    if status:
        raise typer.Exit(status)


@app.command("validate")
def validate_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: Optional[str] = typer.Option(None, "--device", "-d",
                                         help="The device to run on for real (default: a GPU if present)."),
    dtype: Optional[str] = DtypeOpt, amp: Optional[str] = AmpOpt, optimizer: str = OptimOpt,
    input: Optional[List[str]] = InputOpt, loss: Optional[str] = LossOpt,
    warmup: int = typer.Option(2, "--warmup", help="Real steps run before the timed ones (not timed)."),
    steps: int = typer.Option(5, "--steps", help="Real steps timed after the warm-up (the median is reported)."),
    accumulate: int = AccumulateOpt, step: Optional[str] = StepOpt,
    setup: Optional[str] = SetupOpt,
    json_file: Optional[str] = JsonOpt, quiet: bool = QuietOpt,
):
    """Predict the step, run it for real on this machine's device, and compare."""
    with _user_errors():
        _check_outputs(json=json_file)
        from .report.console import render_validation
        from .report.json import to_jsonable
        from .validate.harness import validate
        from .zoo import parse_input, resolve

        m = resolve(spec, batch=batch, seq=seq, inputs=[parse_input(i) for i in input or []])
        with _progress(f"validating {m.name}", quiet) as progress:
            v = validate(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                         # a step computes its own loss: a zoo model's is not used
                         loss_fn=loss if step is not None else m.loss_fn if loss is None else loss,
                         optimizer=None if optimizer == "none" else optimizer, device=device,
                         dtype=dtype, amp=amp, warmup=warmup, steps=steps, name=m.name,
                         accumulate=accumulate, progress=progress, stage=progress, step=step,
                         setup=setup)
        render_validation(v, out)
        _write_json(json_file, to_jsonable(v))


def _check_alloc_conf_env() -> None:
    """PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF, read before anything imports torch: torch
    parses both when it is imported and aborts the process on a malformed one (SIGABRT, no
    message tapescope could give after). tapescope's own tokenizer of that syntax
    (analysis/allocator.py, torch-free) is stricter than torch's at import, so a value it flags
    is confirmed by importing torch in a child process (only then: nothing is paid when the
    variables are well formed); keys and values are checked later, by Options.create."""
    import os
    import subprocess

    from .analysis.allocator import config_syntax_error

    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        value = os.environ.get(var)
        e = config_syntax_error(value) if value else None
        if e is None:
            continue
        child = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
        if child.returncode >= 0 and b"ConfigTokenizer" not in child.stderr:
            continue  # torch imports with it: Options.create says what it makes of it
        err.print(Text.assemble(
            ("error:", "bold red"), f" cannot read the allocator settings {value!r} in {var}: "
            f"{e}; fix it (e.g. expandable_segments:True) or unset {var} - torch aborts on "
            "import with it"), highlight=False, soft_wrap=True)
        sys.exit(1)


def main() -> None:
    if "--help" not in sys.argv[1:]:
        _check_alloc_conf_env()
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    finally:
        # The process ends next, and the interpreter's teardown would walk and free every object
        # of the traces (millions for a large distributed profile: 6-9 s of CPU after a 70B
        # pipelined profile had printed) for the OS to reclaim anyway. Frozen, the collector's
        # last passes skip them; atexit handlers and output flushing run as usual. Only here, in
        # the console script: `app` run in-process (tests, notebooks) keeps its collector.
        gc.freeze()


if __name__ == "__main__":
    main()
