"""Terminal views of a Profile, rendered with rich.

Names and messages come from user code (module names, file names, error text) and are put on the
screen as `Text`, never parsed as rich markup: a module called `[red]` or `[/]` prints as itself.
Long names wrap after their dots, not in the middle of a word.
"""

from __future__ import annotations

import re

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..analysis.modules import module_pattern
from ..capture.records import ALL_CATEGORIES
from .text import assumption_lines, fmt_bytes, fmt_count, fmt_flops, short_op

__all__ = ["render_summary", "render_ops", "render_diff", "render_fit", "render_compiled",
           "render_validation", "render_distributed", "render_layouts", "render_calibration"]


def _mod(m) -> str:
    return "(root)" if m == "" else ("-" if m is None else m)


class _Dotted:
    """A name (module fqn, op, file:line, a few words) that wraps after its dots, colons and
    spaces, never inside a word while the word fits: rich wraps at spaces only, and folds
    `h.0.attn.c_proj` anywhere."""

    def __init__(self, name):
        self.name = str(name)
        self.tokens = re.findall(r"[^.: ]*[.: ]+|[^.: ]+$", self.name) or [""]

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        longest = max(len(t.rstrip(" ")) for t in self.tokens)
        return Measurement(min(longest, options.max_width), min(len(self.name), options.max_width))

    def __rich_console__(self, console, options):
        width = max(1, options.max_width)
        lines, line = [], ""
        for t in self.tokens:
            if line and len(line) + len(t.rstrip(" ")) > width:
                lines.append(line.rstrip(" "))
                line = ""
            while len(t.rstrip(" ")) > width:  # one word wider than the column: no choice
                lines.append(t[:width])
                t = t[width:]
            line += t
        lines.append(line.rstrip(" "))
        yield Text("\n".join(lines), no_wrap=True, overflow="crop")

    def __str__(self):
        return self.name


def _table(title: str | None, headers, rows, width: int) -> Table:
    """A table whose columns get their widths from their names' words: every column at least
    as wide as its longest word (when the console allows it), the rest shared by how much more
    each column would use. Rich's own collapse shrinks the widest columns first, mid-word."""
    cells = [[_Dotted(c) for c in row] for row in rows]
    heads = [_Dotted(h) for h in headers]
    n = len(headers)
    lo = [max(len(t.rstrip(" ")) for c in [heads[i], *(r[i] for r in cells)] for t in c.tokens)
          for i in range(n)]
    hi = [max(len(c.name) for c in [heads[i], *(r[i] for r in cells)]) for i in range(n)]
    room = max(n, width - 2 * (n - 1))  # one space between columns (no edge padding)
    if sum(hi) <= room:
        widths = hi
    elif sum(lo) >= room:
        widths = [max(1, room * w // sum(lo)) for w in lo]
    else:
        spare, want = room - sum(lo), sum(h - l for h, l in zip(hi, lo))
        widths = [l + (h - l) * spare // want for h, l in zip(hi, lo)]
    table = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for h, w in zip(headers, widths):
        table.add_column(h, width=w, no_wrap=True)
    for row in cells:
        table.add_row(*row)
    return table


def _line(*parts) -> Text:
    """Text from (text, style) pairs and plain strings; nothing is read as markup."""
    return Text.assemble(*parts)


def _header(p) -> Text:
    run, d = p.run, p.distributed
    opt, step = run.optimizer, run.step or {}
    precision = p.dtype or "-"
    if run.amp:
        precision += f" + autocast {run.amp}"
    if d is not None and d.fsdp_param_dtype:
        precision += f" + FSDP2 mixed precision {d.fsdp_param_dtype}"
    bits = [p.model, p.device + (f" ({p.gpu.name})" if p.gpu is not None else ""), precision,
            " × ".join("x".join(str(s) for s in i["shape"]) for i in p.inputs if isinstance(i, dict)) or "-",
            f"{opt['name']} ({opt['implementation']})" if opt else "no optimizer",
            *([f"{step['optimizers']} optimizers"] if step.get("optimizers", 0) > 1 else []),
            *([f"your step {step['fn']}"] if step.get("fn") else []),
            *([f"{run.accumulate} micro-batches per step"] if run.accumulate else []),
            f"{fmt_count(run.parameters or 0)} parameters" + (
                f" on this rank's stages of {fmt_count(d.model_parameters)}"
                if d is not None and d.model_parameters else "")]
    return Text(" · ".join(bits), style="bold")


def _render_kernel_facts(p, console: Console) -> None:
    """Which CPU the kernel workspaces are sized for, and which of them are estimates."""
    cpu = p.run.cpu
    if cpu:
        how = "this machine" if cpu.get("detected") else "the target given"
        console.print(_line(("Kernel workspaces", "bold"),
                            f" sized for {cpu['isa'].upper()}, {cpu['threads']} "
                            f"thread{'s' * (cpu['threads'] != 1)} ({how})"))
    for topic, texts in p.run.heuristics.items():
        for text in texts:
            console.print(_line("  ", ("estimate", "yellow"), f" {topic}: {text}"))


def render_summary(p, console: Console, top: int = 8, invocation=None) -> None:
    """The profile's summary; `invocation` (report.advice.Invocation): how the user asked, for
    the next commands when the step does not fit its GPU."""
    mem = p.memory
    console.print(_header(p))
    if p.run.loss:  # the step's loss decides part of the peak: never left implicit
        console.print(_line(("Loss", "bold"), f" {p.run.loss}"))
    traced, n = p.run.accumulate_traced, p.run.accumulate
    if traced:
        console.print(f"  micro-batches {traced + 1}-{n} repeat micro-batch {traced} op for op "
                      f"(it repeated micro-batch {traced - 1} from the same memory): counted "
                      "in FLOPs and time, not traced; the peak is the traced ones'",
                      highlight=False, markup=False)
    which = "steady state (step 2, optimizer state alive)" if p.steps == 2 else "first step"
    console.print(_line(("Peak memory", "bold"), " ", (fmt_bytes(mem.peak_bytes), "bold cyan"),
                        f" — {which}; first step {fmt_bytes(p.first_step_peak_bytes)}"))
    if p.ops:
        op = p.ops[mem.peak_op]
        where = f" at {op.source.filename.rsplit('/', 1)[-1]}:{op.source.lineno}" if op.source else ""
        # an op outside every module (the optimizer's, a compiled graph's) names no module
        inside = "" if op.module is None else f" in module {_mod(op.module)}"
        console.print(_line(f"  reached at op {op.index} ", (op.name, "bold"),
                            f" ({op.phase}){inside}{where}"))
    for line in assumption_lines(p):
        console.print("  " + line, highlight=False, markup=False)
    cats = Table(box=None, show_header=False, pad_edge=False)
    for c in ALL_CATEGORIES:
        b = mem.at_peak.get(c, 0)
        if b:
            share = b / mem.peak_bytes if mem.peak_bytes else 0
            cats.add_row(f"  {c}", fmt_bytes(b), f"{share:6.1%}")
    console.print(cats)

    rows = []
    for g in mem.live_groups[:top]:
        t = g.first
        size = fmt_bytes(t.nbytes) + (f" ×{g.count}" if g.count > 1 else "")
        if t.op is None:  # a parameter, its gradient or state, an input: no op made it here
            made, module, src = "before the step", g.owner or t.owner or "-", ""
        else:
            made, module = f"#{t.op} {short_op(t.op_name)}", _mod(g.module)
            src = t.source.rsplit("/", 1)[-1] if t.source else ""
        rows.append((size, t.category, made, module, src))
    live = _table("Largest tensors alive at the peak",
                  ("bytes", "category", "made by", "module", "source"), rows, console.width)
    console.print(live)

    _render_kernel_facts(p, console)
    fl = p.flops
    console.print(_line(("FLOPs", "bold"), " " + " | ".join(
        f"{k} {fmt_flops(fl[k])}" for k in ("forward", "backward", "optimizer", "other", "total")
        if k in fl)))
    from .sections import checkpointing_sections

    for section in checkpointing_sections(p):
        _print_section(section, console)
    if p.cuda_memory is not None:
        _render_cuda(p, console, invocation)

    shown = [m for m in mem.modules if m.module not in ("",)][:top]
    mods = _table("Top modules by memory", ("module", "peak while running", "saved for backward"),
                  # a compiled graph's saved tensors belong to no module: not "0 B"
                  [(_mod(m.module), fmt_bytes(m.peak_bytes),
                    "-" if p.compiled is not None else fmt_bytes(m.saved_bytes))
                   for m in shown], console.width)
    total = fl["total"] or 1
    own: dict = {}  # pattern -> {instance fqn -> FLOPs of its own ops}
    for fqn, v in p.module_own_flops.items():
        own.setdefault(module_pattern(fqn), {})[fqn] = v
    ranked = sorted(own.items(), key=lambda kv: -sum(kv[1].values()))
    by_flops = _table("Top modules by FLOPs (their own ops; repeated blocks summed)",
                      ("module", "instances", "FLOPs (fwd+bwd+opt)", "share"),
                      [(_mod(pattern), str(len(per)), fmt_flops(sum(per.values())),
                        f"{sum(per.values()) / total:.1%}") for pattern, per in ranked[:top]],
                      console.width)
    console.print(Group(mods, by_flops))

    if p.distributed is not None:
        render_distributed(p, console, top=top)

    if p.uncounted_ops:
        console.print(_line(("Ops without a FLOP formula", "yellow"), " (not in the totals): " +
                            ", ".join(f"{k} ×{v}" for k, v in sorted(p.uncounted_ops.items()))))
    else:
        console.print("Every op has a FLOP formula.")
    for note in p.run.isolation_notes or ():
        console.print(_line(("note: ", "yellow"), note))


def _render_cuda(p, console: Console, invocation=None) -> None:
    """What torch.cuda would report on the named GPU, and why it differs from the tensor peak;
    for a step that does not fit, why and what to try next."""
    cm, t = p.cuda_memory, p.time
    if cm.oom:
        _render_oom(p, console, invocation)
    else:
        console.print(_line((f"On {p.gpu.name}", "bold"),
                            f": max_memory_allocated {fmt_bytes(cm.max_allocated)}, "
                            f"max_memory_reserved {fmt_bytes(cm.max_reserved)}, nvidia-smi about "
                            f"{fmt_bytes(cm.nvidia_smi)} of {fmt_bytes(cm.capacity)}: fits"))
    extra = cm.max_allocated - max(p.peak_bytes, p.first_step_peak_bytes)
    if extra > 0 and not cm.oom:
        from ..analysis.gpu_memory import cublas_workspace_bytes

        ws = cublas_workspace_bytes(p.gpu.compute_capability)
        console.print(f"  max_memory_allocated is {fmt_bytes(extra)} above the tensor peak: the "
                      "caching allocator rounds every block up to a multiple of 512 bytes, and "
                      f"cuBLAS keeps a {fmt_bytes(ws)} workspace from the first matmul on",
                      highlight=False, markup=False)
    if cm.stream_cached > 0 and not cm.oom:
        console.print(f"  max_memory_reserved holds {fmt_bytes(cm.stream_cached)} more than one "
                      "stream would: the caching allocator reuses a freed block only on the stream "
                      "that allocated it, and FSDP2's copy-in and reduce-scatter streams keep the "
                      "buffers they free for their own next collectives", highlight=False,
                      markup=False)
    if t is None:  # an inductor-compiled step: its fused kernels are not timed
        console.print("  step time not estimated: the compiled step's fused Triton kernels are "
                      "not ops the per-op roofline sees", highlight=False, markup=False)
        return
    phases = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.by_phase.items())
    host_bound = (f", host-bound in {', '.join(t.host_bound_phases)}"
                  if t.host_bound_phases and t.bound != "host" else "")
    console.print(_line(f"  step time {t.seconds * 1e3:.1f} ms ({phases}; {t.bound}-bound"
                        f"{host_bound}), MFU {t.mfu:.0%}", (_calibration_note(t), "dim")))
    if t.band is not None:
        console.print(f"  step time error: {t.band.text()}", highlight=False, markup=False)


def _calibration_note(t) -> str:
    """Where the step time's constants come from: a calibration file, or the priors."""
    if t.calibration is None:
        return "" if t.calibrated else " (timing constants not yet calibrated on a GPU)"
    rest = "" if t.calibrated else "; kernels of kinds it did not measure on the priors"
    return f" (calibrated: {t.calibration}{rest})"


def render_calibration(cal, console: Console) -> None:
    """What `tapescope calibrate` measured, in a few lines: the best of each kind and the
    launch overheads (the file holds every point)."""
    d = cal.device
    board = ", ".join(f"{label} {d[key]:g} {unit}" for key, label, unit in (
        ("sm_clock_max_mhz", "SM clock max", "MHz"), ("power_limit_w", "power limit", "W"))
        if isinstance(d.get(key), (int, float)))
    console.print(_line((cal.gpu_name, "bold"), f": torch {cal.torch}, CUDA {d.get('cuda', '?')}, "
                        f"driver {d.get('driver', '?')}" + (f", {board}" if board else "")))
    console.print(f"  launch: {cal.kernel_overhead_s * 1e6:.2f} us per kernel on the GPU, "
                  f"{cal.host_op_s * 1e6:.2f} us per eager op on the host", highlight=False,
                  markup=False)
    for dtype in sorted({g.dtype for g in cal.gemm}):
        best = max((g for g in cal.gemm if g.dtype == dtype), key=lambda g: g.flops / g.seconds)
        console.print(f"  GEMM {dtype}: {len([g for g in cal.gemm if g.dtype == dtype])} shapes, "
                      f"best {best.flops / best.seconds / 1e12:.0f} TFLOP/s at "
                      f"{best.m}x{best.n}x{best.k}", highlight=False, markup=False)
    for backend in sorted({a.backend for a in cal.attention}):
        mine = [a for a in cal.attention if a.backend == backend]
        best = max(mine, key=lambda a: a.flops / a.seconds)
        console.print(f"  attention {backend}: {len(mine)} shapes, best "
                      f"{best.flops / best.seconds / 1e12:.0f} TFLOP/s ({best.direction}, seq "
                      f"{best.seq_q}, head dim {best.head_dim})", highlight=False, markup=False)
    for kind in sorted({b.kind for b in cal.bandwidth}):
        best = max((b for b in cal.bandwidth if b.kind == kind), key=lambda b: b.bytes / b.seconds)
        console.print(f"  {kind}: best {best.bytes / best.seconds / 1e9:.0f} GB/s at "
                      f"{fmt_bytes(best.bytes)}", highlight=False, markup=False)
    for coll in sorted({c.collective for c in cal.nccl}):
        best = max((c for c in cal.nccl if c.collective == coll), key=lambda c: c.bus_bandwidth)
        console.print(f"  NCCL {coll} over {best.ranks} GPUs: bus bandwidth up to "
                      f"{best.bus_bandwidth / 1e9:.0f} GB/s", highlight=False, markup=False)
    if d.get("skipped") or d.get("failed"):
        console.print(f"  not measured: {d.get('skipped', 0)} skipped at the deadline, "
                      f"{len(d.get('failed', ()))} failed (listed in the file)", highlight=False,
                      markup=False)


def _render_oom(p, console: Console, invocation=None) -> None:
    """A step the GPU cannot hold: what it needs against what the allocator has, the replayed
    counters labelled as a replay cut short, then why and the next commands."""
    from ..analysis.shortfall import shortfall
    from ..devices.gpus import usable_memory_bytes

    cm = p.cuda_memory
    usable = usable_memory_bytes(p.gpu)
    need = max(p.peak_bytes, p.first_step_peak_bytes)
    at = f": runs out of memory at {cm.oom_at}" if cm.oom_at else ""
    console.print(_line((f"On {p.gpu.name}", "bold"), ": ", ("does not fit", "bold red"), at))
    console.print(f"  the step needs {fmt_bytes(need)} of tensors at its peak; the caching allocator "
                  f"has {fmt_bytes(usable)} ({fmt_bytes(cm.capacity)} less "
                  f"{fmt_bytes(cm.context_bytes)} of CUDA context)", highlight=False, markup=False)
    console.print(f"  max_memory_allocated {fmt_bytes(cm.max_allocated)}, max_memory_reserved "
                  f"{fmt_bytes(cm.max_reserved)}, nvidia-smi about {fmt_bytes(cm.nvidia_smi)}: "
                  "the replay up to the point of OOM (what torch.cuda reports when the step "
                  "fails), not what the step needs", highlight=False, markup=False)
    s = shortfall(p.memory.at_peak, usable)
    if s is None:  # the tensors fit; the allocator's rounded, segmented blocks do not
        render_next_steps(console, f"the tensors fit ({fmt_bytes(need)} of {fmt_bytes(usable)}) "
                          "but the caching allocator's rounded blocks and segments do not",
                          [("this command with --alloc-conf expandable_segments:True",
                            "segments that grow in place instead of new 2/20 MiB ones")])
        return
    from .advice import next_steps, why

    what = "the GPU's memory"  # the next commands need to know how the user asked
    render_next_steps(console, why(s, what),
                      next_steps(s, invocation, what=what) if invocation is not None else [])


def render_next_steps(console: Console, reason: str, steps) -> None:
    """`why: ...` and the next commands, each with what it changes."""
    console.print(_line(("  why: ", "bold"), reason), soft_wrap=True)
    if steps:
        console.print(_line(("  next:", "bold")))
    for command, because in steps:
        console.print(Text(f"    {command}"), highlight=False, soft_wrap=True)
        console.print(Text(f"        {because}", style="dim"), highlight=False, soft_wrap=True)


def _print_section(section, console: Console, title_line: bool = False) -> None:
    """A report.sections.Section: its prose, its table, its closing prose; nothing it holds is
    read as markup. `title_line`: the title as a bold line above the table, not the table's."""
    if title_line:
        console.print(Text(section.title, style="bold"), highlight=False)
    for line in section.lines:
        head, _, rest = line.partition(" ")
        console.print(_line((head, "bold"), " " + rest) if head == "Mesh" else Text(line),
                      highlight=False)
    if section.columns:
        t = Table(title=None if title_line else section.title, title_justify="left", box=None,
                  pad_edge=False)
        for col in section.columns:
            t.add_column(col)
        for row in section.rows:
            t.add_row(*(Text(cell) for cell in row))
        console.print(t)
    for line in section.after:
        console.print(Text("  " + line), highlight=False)


def render_distributed(p, console: Console, top: int = 8) -> None:
    """Every rank's memory, the collectives and the step time of a distributed profile."""
    from .sections import distributed_sections

    for section in distributed_sections(p, top):
        _print_section(section, console)


def render_layouts(rows, name: str, gpus: int, options, console: Console,
                   budget: int | None = None, best=None, invocation=None,
                   inputs: str = "") -> None:
    """fit --gpus: one row per (FSDP, TP) layout; `best` (layouts.best_layout) named below; when
    none fits, why (the lowest peak per rank, or the one failure every layout met) and what next
    (`invocation`: how the user asked)."""
    piped = any(r.layout.pp > 1 for r in rows)
    console.print(_line((name, "bold"), f" on {gpus} x {options.gpu.name}: "
                        f"({'PP, ' if piped else ''}FSDP, TP) layouts, "
                        "each data-parallel rank taking the batch given"
                        + (f" (inputs {inputs})" if inputs else "")), highlight=False)
    if piped:
        console.print("  pipelined layouts: 1F1B over one micro-batch per sample; their step is "
                      "the schedule's, bubble included", highlight=False, markup=False)
    console.print("  global batch = batch per rank x FSDP x replicas (the TP ranks of a group "
                  "share a batch, the CP ranks one batch of the whole sequence), so it differs "
                  "between layouts: compare throughput, not step time", highlight=False,
                  markup=False)
    if budget is not None:
        console.print(f"  fits: the peak per rank within the budget, {fmt_bytes(budget)}",
                      highlight=False, markup=False)
    if options.calibration is not None:
        console.print(f"  step times calibrated: {options.calibration.label}", highlight=False,
                      markup=False)
    if options.checkpointing:
        units = ", ".join(f"{p.module} ({p.mode})" for p in options.checkpointing)
        console.print(f"  activation checkpointing in every layout: {units}, applied before the "
                      "preset parallelisation", highlight=False, markup=False)
    if options.float8 is not None:  # capture/float8.py: what each layout's trace converted
        gather = ("; FSDP layouts gather those weights in float8" if options.float8 ==
                  "tensorwise" else "")
        tp = ("; TP layouts keep plain TP styles, as torchtitan 0.3.0 does (activations cross "
              "them unquantised)" if any(r.layout.tp > 1 for r in rows) else "")
        console.print(f"  float8 {options.float8} in every layout: the Linears torchtitan's "
                      f"converter swaps are torchao's Float8Linear{gather}{tp}",
                      highlight=False, markup=False)
    tokens = any(r.tokens_per_second for r in rows)
    t = Table(box=None)
    for col in ("layout", "batch/rank", "global batch", "peak per rank", "nvidia-smi", "fits",
                "step", "MFU", "tokens/s" if tokens else "samples/s"):
        t.add_column(col)
    for r in rows:
        batches = (str(r.batch_per_rank or "-"), str(r.global_batch or "-"))
        if r.peak_bytes is None:  # why is said below the table, not inside a figure's column
            t.add_row(str(r.layout), *batches, Text("not run", style="dim"), "-", "-", "-", "-", "-")
            continue
        fits = Text("-") if r.fits is None else (Text("yes") if r.fits else Text("no", style="red"))
        rate = r.tokens_per_second if tokens else r.samples_per_second
        t.add_row(str(r.layout), *batches, fmt_bytes(r.peak_bytes),
                  Text("out of memory", style="red") if r.oom else
                  fmt_bytes(r.reserved_bytes) if r.reserved_bytes else "-", fits,
                  f"{r.step_seconds * 1e3:.0f} ms" if r.step_seconds else "-",
                  f"{r.mfu:.0%}" if r.mfu is not None else "-",
                  f"{rate:,.0f}" if rate else "-")
    console.print(t)
    for band in dict.fromkeys(r.error_band for r in rows if r.error_band):
        console.print(f"  {'tokens' if tokens else 'samples'}/s error: {band}", highlight=False,
                      markup=False)
    for r in rows:
        if r.peak_bytes is None:
            console.print(Text(f"  {r.layout} not run: {r.note}"), highlight=False)
    if best is not None:  # layouts.best_layout(rows)
        rate = (f"{best.tokens_per_second:,.0f} tokens/s" if best.tokens_per_second
                else f"{best.samples_per_second:,.1f} samples/s")
        console.print(_line(("Best layout", "bold"), f": {best.layout}, {rate} at a global "
                            f"batch of {best.global_batch} ({best.batch_per_rank} per rank), "
                            f"{fmt_bytes(best.peak_bytes)} per rank"), highlight=False)
    else:
        console.print(_line(("No layout fits", "bold red"),
                            f" {gpus} x {options.gpu.name}" + (f" within {fmt_bytes(budget)}"
                                                              if budget is not None else "")),
                      highlight=False)
        _render_no_layout(rows, gpus, options, console, budget, invocation)


def _render_no_layout(rows, gpus, options, console, budget, invocation) -> None:
    ran = [r for r in rows if r.peak_bytes is not None]
    notes = {r.note for r in rows if r.peak_bytes is None}
    if not ran:
        reason = (f"no layout ran; every one failed the same way: {notes.pop()}" if len(notes) == 1
                  else "no layout ran (the reasons are above)")
        render_next_steps(console, reason, [])
        return
    low = min(ran, key=lambda r: r.peak_bytes)
    target = (f"the budget of {fmt_bytes(budget)}" if budget is not None
              else f"the {options.gpu.name}'s memory")
    reason = (f"the lowest peak per rank, {fmt_bytes(low.peak_bytes)} with {low.layout}, is over "
              f"{target}")
    steps = []
    if invocation is not None:
        where = invocation.where() or ("--gpu", options.gpu.key)
        steps.append((invocation.cmd("fit", "--gpus", str(gpus * 2), *where),
                      f"twice the GPUs: FSDP shards the model state over twice the ranks (the "
                      f"{fmt_bytes(low.peak_bytes)} per rank includes the unsharded activations, "
                      f"which do not shrink)"))
        if low.layout.pp == 1 and low.layout.tp == 1:
            steps.append((invocation.cmd("profile", "--fsdp", str(gpus), "--gpu", options.gpu.key),
                          f"the per-rank categories of {low.layout}: which part is over, and the "
                          f"checkpointing or optimizer changes that act on it"))
    render_next_steps(console, reason, steps)


def render_ops(p, console: Console, phases=("forward", "backward")) -> None:
    """The forward<->backward table of the AOTAutograd seq_nr commit: SeqNr|OrigAten|SrcFn, forward
    rows then backward rows, plus the autograd node, FLOPs (in units, as the other tables: the exact
    counts are in --json) and whether autograd saved the output."""
    console.print("SeqNr|OrigAten|SrcFn|Node|FLOPs|Saved", highlight=False, soft_wrap=True,
                  markup=False)
    for op in p.ops:
        if op.phase not in phases:
            continue
        seq = "" if op.seq_nr is None else str(op.seq_nr)
        module = "" if op.module is None else _mod(op.module)
        flags = "saved" if op.saved else ""
        if op.recompute:  # a forward op checkpointing runs again, in the backward rows
            flags = "recompute" + (",saved" if op.saved else "")
        console.print(f"{seq}|{op.name}|{module}|{op.autograd_node or ''}|"
                      f"{_op_flops(op.flops)}|{flags}",
                      highlight=False, soft_wrap=True, markup=False)


def _op_flops(n) -> str:
    if n is None:
        return "?"  # no formula: never shown as 0
    return "0" if n == 0 else fmt_flops(n)


def render_diff(a, b, d, console: Console, top: int = 12) -> None:
    """Two profiles of one step on two devices (analysis.diff.StepDiff d between them)."""
    da, db = a.trace.device.type, b.trace.device.type
    console.print(_line((f"{a.model}: {da} vs {db}", "bold"),
                        f"  ({len(a.ops)} vs {len(b.ops)} ops, {d.same_ops} forward/backward ops "
                        "identical)"))
    console.print(f"peak      {fmt_bytes(a.peak_bytes):>12} vs {fmt_bytes(b.peak_bytes):>12}   "
                  f"delta {fmt_bytes(b.peak_bytes - a.peak_bytes)}", markup=False)
    for cat in a.memory.at_peak:
        x, y = a.memory.at_peak[cat], b.memory.at_peak[cat]
        if x or y:
            console.print(f"  {cat:<18} {fmt_bytes(x):>12} vs {fmt_bytes(y):>12}", markup=False)
    for ph in ("forward", "backward", "optimizer", "total"):
        console.print(f"FLOPs {ph:<9} {fmt_flops(a.flops[ph]):>12} vs {fmt_flops(b.flops[ph]):>12}",
                      markup=False)
    groups: dict = {}
    for h in d.hunks:
        groups.setdefault((h.phase, tuple(h.a_ops), tuple(h.b_ops)), []).append(h)
    console.print(_line("\n", (f"{len(d.hunks)} differences", "bold"), f" ({len(groups)} distinct):"))
    for (phase, a_ops, b_ops), hs in list(groups.items())[:top]:
        h = hs[0]
        mods = sorted({m for x in hs for m in x.modules})
        where = ", ".join(mods[:3]) + (f" and {len(mods) - 3} more" if len(mods) > 3 else "")
        console.print(_line("\n", (phase, "bold"), f" x{len(hs)} in {where or '-'}"), highlight=False)
        console.print(f"  {da}: {', '.join(a_ops) or '(nothing)'}", highlight=False, markup=False)
        console.print(f"  {db}: {', '.join(b_ops) or '(nothing)'}", highlight=False, markup=False)
        for r in h.reasons:
            console.print(f"  why: {r}", highlight=False, markup=False)
        console.print(f"  FLOPs {fmt_flops(h.a_flops)} vs {fmt_flops(h.b_flops)}; saved for backward "
                      f"{fmt_bytes(h.a_saved)} vs {fmt_bytes(h.b_saved)} (each)", highlight=False,
                      markup=False)


def render_fit(r, name: str, options, console: Console, sweep_rows=None,
               invocation=None) -> None:
    """A fit.FitResult: the formula, its guards, the largest size that fits, and a sweep; when
    nothing fits, why (the categories at the smallest size's peak) and the next commands."""
    sp, dim = r.profile.symbolic, r.dim
    shapes = " × ".join("x".join(str(s) for s in i["shape"]) for i in r.profile.inputs
                        if isinstance(i, dict))
    gpu = f" ({options.gpu.name})" if options.gpu is not None else ""
    console.print(_line((name, "bold"), f" on {options.device.type}{gpu}, inputs {shapes} with "
                        f"{dim} varying"), highlight=False)
    console.print(f"budget {fmt_bytes(r.budget)}" + (f" ({r.budget_note})" if r.budget_note else ""),
                  highlight=False, markup=False)
    if options.checkpointing:
        console.print("activation checkpointing: " + ", ".join(
            f"{p.module} ({p.mode})" for p in options.checkpointing), highlight=False, markup=False)
    pieces = len(sp.pieces)
    console.print(f"peak memory = {sp.large_size_peak_expr(dim)} bytes for large {dim} (the "
                  f"largest of {pieces} piece{'s' if pieces > 1 else ''}; formulas hold for {dim} in "
                  f"[{sp.ranges[dim][0]}, {sp.ranges[dim][1] or 'inf'}])", highlight=False,
                  markup=False)
    for g in sp.guards:
        console.print(f"  guard: {g.expr} at {g.where}" + (f" pins {g.pins}" if g.pins else ""),
                      highlight=False, markup=False)
    if sp.fitted:
        f = sp.fitted
        console.print(f"  {', '.join(f['dims'])} pinned by a guard: traced at {len(f['traced_at'])} "
                      f"sizes, fitted polynomials, {'verified' if f['verified'] else 'NOT verified'} "
                      f"at {len(f['checked_at'])} more" +
                      ("" if f["verified"] else "; tracing each size instead"), highlight=False,
                      markup=False)
    if r.value is None:
        console.print(_line(("nothing fits", "red"), f": {dim} {r.probes[0][0]} already needs "
                            f"{fmt_bytes(r.next_peak)}"))
        from ..analysis.shortfall import Shortfall

        from .advice import next_steps, why

        s = Shortfall(r.budget, r.profile.at(**{dim: r.probes[0][0]}).at_peak)
        render_next_steps(console, why(s), next_steps(s, invocation) if invocation else [])
    else:
        console.print(_line((f"largest {dim} that fits: {r.value}", "bold green"),
                            f" — peak {fmt_bytes(r.peak_bytes)}, headroom {fmt_bytes(r.headroom)}"))
        if r.reached_search_limit:
            console.print(f"  every {dim} up to {r.search_limit} fits: the peak does not grow "
                          f"enough with {dim} to reach the budget", highlight=False)
        elif r.next_peak is not None:
            console.print(f"  {dim} {r.value + 1} would need {fmt_bytes(r.next_peak)}",
                          highlight=False)
        elif r.limit is not None:
            console.print(f"  the model accepts {dim} up to {r.limit}", highlight=False)
    if sweep_rows:
        top = max(v for _, v in sweep_rows) or 1
        for n, v in sweep_rows:
            bar = "#" * max(1, int(40 * v / top))
            mark = "fits" if v <= r.budget else "OOM "
            console.print(f"  {dim} {n:>7}  {fmt_bytes(v):>12}  {mark}  {bar}", highlight=False,
                          markup=False)


def render_validation(v, console: Console) -> None:
    """A validate.harness.Validation: predicted vs measured, per quantity, in its unit."""
    console.print(_line((v.model, "bold"), f" on {v.device}" + (f" ({v.gpu})" if v.gpu else "") +
                        f", torch {v.torch_version}"))
    for q, pred, meas in v.rows:
        fmt = (lambda x: f"{x * 1e3:.2f} ms") if q.startswith("step time") else fmt_bytes
        err = "" if pred is None or not meas else f"{(pred - meas) / meas:+.2%}"
        console.print(f"  {q:<32} predicted {fmt(pred) if pred is not None else '-':>12}   "
                      f"measured {fmt(meas) if meas is not None else '-':>12}   {err}",
                      highlight=False, markup=False)
    console.print(f"  op sequence: {'identical' if v.ops_match else 'differs'}", markup=False)
    for d in v.ops_diff[:10]:
        console.print(f"    {d}", highlight=False, markup=False)


def render_compiled(p, console: Console, top: int = 8) -> None:
    """A compiled step beside the eager one: peaks, saved activations, FLOPs, time; what the
    partitioner saved and recomputed; graph breaks."""
    from .sections import compiled_sections

    side, saved = compiled_sections(p, top)
    _print_section(side, console, title_line=True)
    _print_section(saved, console)


def render_plan(plan, name: str, options, console: Console, invocation=None) -> None:
    """A checkpointing.Plan: the verdict, the units and their modes, the Pareto table, the code;
    for a budget no plan meets, why and the next commands (`invocation`: how the user asked)."""
    from ..values.checkpointing import FULL

    gpu = f" ({options.gpu.name})" if options.gpu is not None else ""
    console.print(_line((name, "bold"), f" on {options.device.type}{gpu}: activation "
                        f"checkpointing for a budget of {fmt_bytes(plan.budget)}"), highlight=False)
    verdict = "[bold green]meets the budget[/]" if plan.meets_budget else \
        "[bold red]cannot meet the budget[/] (the lowest peak found)"
    console.print(f"peak {fmt_bytes(plan.peak_bytes)} {verdict} — the step re-traced with the plan "
                  f"(first step {fmt_bytes(plan.first_step_peak_bytes)}, steady "
                  f"{fmt_bytes(plan.steady_peak_bytes)}); without checkpointing "
                  f"{fmt_bytes(plan.baseline_peak_bytes)}; the planner estimated "
                  f"{fmt_bytes(plan.estimated_peak_bytes)}", highlight=False)
    console.print(f"recompute {fmt_flops(plan.recompute_flops)}, {plan.recompute_seconds * 1e3:.3g} ms "
                  f"({plan.cost_model}); {plan.traces} traces in {plan.seconds:.1f} s",
                  highlight=False)
    full = [p.module for p in plan.policies if p.mode == FULL]
    sel = [p for p in plan.policies if p.mode != FULL]
    rest = len(plan.units) - len(plan.policies)
    console.print(f"  checkpointed whole ({len(full)}): {_fqn_runs(full) or '-'}", highlight=False,
                  markup=False)
    console.print(f"  selective ({len(sel)}): {_fqn_runs([p.module for p in sel]) or '-'}"
                  + (f"; keeping the outputs of {', '.join(sorted({o for p in sel for o in p.save_ops}))}"
                     if sel else ""), highlight=False, markup=False)
    console.print(f"  not checkpointed: {rest} of the {len(plan.units)} units considered",
                  highlight=False)
    for r in plan.refused:
        console.print(Text(f"  not proposed: {r.describe()}"), highlight=False, soft_wrap=True)
    if plan.pareto:
        t = Table(title="Budget -> re-traced peak -> recompute cost", title_justify="left", box=None)
        for col in ("budget", "peak (re-traced)", "recompute", "FLOPs", "whole", "selective"):
            t.add_column(col, justify="right")
        for r in plan.pareto:
            t.add_row(fmt_bytes(r.budget), fmt_bytes(r.peak_bytes),
                      f"{r.recompute_seconds * 1e3:.3g} ms", fmt_flops(r.recompute_flops),
                      str(r.full), str(r.selective))
        console.print(t)
    if plan.meets_budget or plan.policies:  # over the budget: the plan of the lowest peak
        console.print("[bold]Paste into the training script[/] (then `apply_checkpointing(model)`):")
        console.print(plan.code(), highlight=False, markup=False, soft_wrap=True)
    if not plan.meets_budget:
        _render_plan_shortfall(plan, console, invocation)


def _render_plan_shortfall(plan, console: Console, invocation) -> None:
    from ..analysis.shortfall import Shortfall

    from .advice import next_steps, why

    p = plan.profile  # the lowest peak found, re-traced: its categories say what is left
    memory = p.first_step_memory if p.first_step_peak_bytes > p.peak_bytes else p.memory
    s = Shortfall(plan.budget, memory.at_peak)

    reason = (why(s) + "; activation checkpointing reduces only the saved activations"
              if s.state_exceeds else "with the plan of the lowest peak, " + why(s))
    render_next_steps(console, reason,
                      next_steps(s, invocation, checkpointed=True) if invocation else [])


def _fqn_runs(names: list) -> str:
    """'h.0, h.1, h.2, h.5' -> 'h.0-2, h.5'."""
    out, i = [], 0
    while i < len(names):
        prefix, _, last = names[i].rpartition(".")
        j = i
        if last.isdigit():
            while j + 1 < len(names) and names[j + 1] == f"{prefix}.{int(last) + j + 1 - i}":
                j += 1
        out.append(names[i] if j == i else f"{names[i]}-{int(last) + j - i}")
        i = j + 1
    return ", ".join(out)
