"""Where a profile's time goes, per stage (issue 25): exclusive wall time of each stage of
`tapescope.profile` + the console summary, measured by wrapping the functions that begin each
stage (a stage's time excludes the stages nested inside it), then cProfile's top functions.

    python benchmarks/stage_profile.py [--repeat 5] [--cprofile]

Stages:
  fake        FakeTensorMode.__torch_dispatch__ (its cache, meta kernels, fake outputs)
  replay      the replay front (capture/replay.py: key, replay, learn, literal, constant_op)
  tape        Tape.__torch_dispatch__ / _dispatch itself: rules, view tracking, data values
  recording   Tape._record and the workspace / literal records
  engine      the Python engine (PythonEngine._run and what it calls, less the ops it dispatches)
  analysis    analyse(): steps, op table, FLOPs, memory timeline, categories
  lazy        the lazy Profile / MemoryReport properties the summary reads, module roll-ups
  report      render_summary (rich) less the lazy analyses
  capture     the rest of capture(): fake copy of the model, the model's and optimizer's Python,
              module hooks, the torch-function mode (what a bare fake step also runs)
The wrappers add a few microseconds per op: compare shares, and the total against an unwrapped run
(printed as "unwrapped").
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import time
from functools import cached_property

from rich.console import Console
from torch._subclasses.fake_tensor import FakeTensorMode

import tapescope
import tapescope.api as api
import tapescope.report.console as rconsole
from tapescope.capture.engine import PythonEngine
from tapescope.capture.model import build_on_meta
from tapescope.capture.replay import DispatchReplay
from tapescope.capture.tape import Tape
from tapescope.zoo import resolve

STAGES = ("fake", "replay", "tape", "recording", "engine", "analysis", "lazy", "report", "capture")
_stack: list = []  # [stage, started]
_acc: dict = {}


def _enter(stage):
    now = time.perf_counter()
    if _stack:
        top = _stack[-1]
        _acc[top[0]] = _acc.get(top[0], 0.0) + now - top[1]
    _stack.append([stage, now])


def _leave():
    now = time.perf_counter()
    stage, t = _stack.pop()
    _acc[stage] = _acc.get(stage, 0.0) + now - t
    if _stack:
        _stack[-1][1] = now


def _wrap(fn, stage):
    def w(*a, **k):
        _enter(stage)
        try:
            return fn(*a, **k)
        finally:
            _leave()
    w.__wrapped__ = fn
    return w


def instrument():
    undo = []

    def patch(owner, name, stage):
        raw = owner.__dict__[name]
        if isinstance(raw, staticmethod):
            new = staticmethod(_wrap(raw.__func__, stage))
        elif isinstance(raw, cached_property):
            new = cached_property(_wrap(raw.func, stage))
            new.attrname = raw.attrname
        else:
            new = _wrap(raw, stage)
        setattr(owner, name, new)
        undo.append((owner, name, raw))

    patch(FakeTensorMode, "__torch_dispatch__", "fake")
    for n in ("find", "replay", "learn", "literal", "constant_op"):
        patch(DispatchReplay, n, "replay")
    patch(Tape, "__torch_dispatch__", "tape")
    for n in ("_record", "_record_workspace", "_record_tensor_literal"):
        patch(Tape, n, "recording")
    patch(PythonEngine, "_run", "engine")
    patch(api, "_analyse_captured", "analysis")
    for n, v in list(vars(api.Profile).items()):
        if isinstance(v, cached_property):
            patch(api.Profile, n, "lazy")
    from tapescope.analysis import memory as amem
    for n, v in list(vars(amem.MemoryReport).items()):
        if isinstance(v, cached_property):
            patch(amem.MemoryReport, n, "lazy")
    if "module_rollup" in vars(rconsole):  # the console summary imported it before 2026-11-24
        patch(rconsole, "module_rollup", "lazy")
    patch(rconsole, "render_summary", "report")
    return undo


def run_once(meta_model, m):
    p = tapescope.profile(meta_model, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)
    rconsole.render_summary(p, Console(file=io.StringIO(), width=120))
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true", help="also cProfile's top 10 (cumulative)")
    ap.add_argument("--models", default="zoo:gpt2:8,torchvision:vit_b_16:32")
    args = ap.parse_args()
    for item in args.models.split(","):
        spec, batch = item.rsplit(":", 1)
        m = resolve(spec, batch=int(batch), seq=1024 if spec.startswith("zoo:") else None)
        meta_model = build_on_meta(m.build)
        run_once(meta_model, m)  # warm
        plain = []
        for _ in range(args.repeat):
            gc.collect()
            t = time.perf_counter()
            run_once(meta_model, m)
            plain.append(time.perf_counter() - t)
        undo = instrument()
        per = {s: [] for s in STAGES}
        totals = []
        try:
            for _ in range(args.repeat):
                gc.collect()
                _acc.clear()
                t = time.perf_counter()
                _enter("capture")
                p = run_once(meta_model, m)
                _leave()
                totals.append(time.perf_counter() - t)
                for s in STAGES:
                    per[s].append(_acc.get(s, 0.0))
        finally:
            for owner, name, raw in reversed(undo):
                setattr(owner, name, raw)
        tot = statistics.median(totals)
        print(f"\n{spec} (batch {batch}): {len(p.ops)} ops in the reported step, "
              f"{len(p.trace.ops)} recorded; unwrapped {statistics.median(plain):.3f} s, "
              f"wrapped {tot:.3f} s (medians of {args.repeat})\n")
        print("| stage | seconds | share |")
        print("|---|---|---|")
        for s in STAGES:
            v = statistics.median(per[s])
            print(f"| {s} | {v:.3f} | {v / tot:.0%} |")
        if args.cprofile:
            pr = cProfile.Profile()
            gc.collect()
            pr.enable()
            run_once(meta_model, m)
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(40)
            print(out.getvalue())
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())


if __name__ == "__main__":
    main()
