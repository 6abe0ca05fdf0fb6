"""The `tapescope` command."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

import typer
from rich.console import Console

from .errors import TapescopeError

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="See a whole PyTorch training step before it runs.")
out = Console(width=None if Console().is_terminal else 120)
err = Console(stderr=True)

DEFAULT_SPEC = "zoo:gpt2"

_spec_help = ("Model: zoo:gpt2, zoo:llama, torchvision:NAME, timm:NAME, hf:CONFIG_CLASS, "
              "path/config.json, path/file.py:build_fn")


@contextmanager
def _progress(label: str, delay: float = 1.0):
    """A spinner that appears only when the work takes longer than `delay` seconds."""
    state = {"text": label, "status": None}
    done = threading.Event()

    def show():
        if not done.wait(delay) and err.is_terminal:
            state["status"] = err.status(state["text"])
            state["status"].start()

    t = threading.Thread(target=show, daemon=True)
    t.start()

    def update(step, phase):
        state["text"] = f"{label}: step {step} {phase} done"
        if state["status"] is not None:
            state["status"].update(state["text"])

    try:
        yield update
    finally:
        done.set()
        t.join()
        if state["status"] is not None:
            state["status"].stop()


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {e}", highlight=False)
    raise typer.Exit(1)


def _run_profile(spec, batch, seq, device, dtype, optimizer, steps, inputs):
    from . import profile
    from .zoo import parse_input, resolve

    m = resolve(spec, batch=batch, seq=seq, inputs=[parse_input(i) for i in inputs or []])
    with _progress(f"tracing {m.name} on fake {device} tensors") as progress:
        return profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                       optimizer=None if optimizer == "none" else optimizer, device=device,
                       dtype=dtype, steps=steps, name=m.name, progress=progress)


SpecArg = typer.Argument(DEFAULT_SPEC, help=_spec_help, show_default=True)
BatchOpt = typer.Option(None, "--batch", "-b", help="Batch size (default: the model's).")
SeqOpt = typer.Option(None, "--seq", "-s", help="Sequence length (image size for vision models).")
DeviceOpt = typer.Option("cpu", "--device", "-d", help="cpu, cuda or meta: whose kernels to trace.")
DtypeOpt = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: the model's).")
OptimOpt = typer.Option("adamw", "--optimizer", "-o", help="adamw, adam, sgd or none.")
StepsOpt = typer.Option(2, "--steps", help="2: steady state with optimizer state; 1: first step.")
InputOpt = typer.Option(None, "--input", "-i", help="An input shape, e.g. 4,128 or 4,128:int64; repeat for several.")


@app.command("profile")
def profile_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, optimizer: str = OptimOpt,
    steps: int = StepsOpt, input: Optional[List[str]] = InputOpt,
    json_file: Optional[str] = typer.Option(None, "--json", help="Write the whole profile as JSON."),
    graph_file: Optional[str] = typer.Option(None, "--graph", help="Write the step's FX graph (Python code with meta)."),
    top: int = typer.Option(8, "--top", help="Rows in each table."),
):
    """Peak memory and what causes it, FLOPs by phase, top modules, uncounted ops."""
    from .report.console import render_summary

    try:
        t0 = time.perf_counter()
        p = _run_profile(spec, batch, seq, device, dtype, optimizer, steps, input)
        elapsed = time.perf_counter() - t0
        render_summary(p, out, top=top)
        out.print(f"[dim]{len(p.ops)} ops traced in {elapsed:.2f} s; tapescope never allocated the model.[/]")
        if json_file:
            with open(json_file, "w") as f:
                json.dump(p.to_dict(), f, indent=1, default=str)
            out.print(f"wrote {json_file}")
        if graph_file:
            _write_graph(p, graph_file)
            out.print(f"wrote {graph_file}")
    except TapescopeError as e:
        _fail(e)


def _write_graph(p, path: str) -> None:
    gm = p.graph
    lines = [f"# tapescope: training step of {p.model} on {p.device}; one node per aten op",
             "# node meta: phase | seq_nr | module | FLOPs | saved-for-backward"]
    for n in gm.graph.nodes:
        if n.op == "call_function" and "phase" in n.meta:
            m = n.meta
            lines.append(f"#   {n.name}: {m['phase']} | {m['seq_nr']} | {m['nn_module']} | "
                         f"{m['flops']} | {'saved' if m['saved'] else ''}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n" + gm.code)


@app.command("ops")
def ops_cmd(
    spec: str = SpecArg, batch: Optional[int] = BatchOpt, seq: Optional[int] = SeqOpt,
    device: str = DeviceOpt, dtype: Optional[str] = DtypeOpt, input: Optional[List[str]] = InputOpt,
    optimizer: bool = typer.Option(False, "--with-optimizer", help="Also list the optimizer's ops."),
):
    """The forward<->backward op table: seq_nr | aten op | module, forward rows then backward."""
    from .report.console import render_ops

    try:
        p = _run_profile(spec, batch, seq, device, dtype, "adamw" if optimizer else "none", 1, input)
        render_ops(p, out, phases=("forward", "backward", "optimizer") if optimizer else ("forward", "backward"))
    except TapescopeError as e:
        _fail(e)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
