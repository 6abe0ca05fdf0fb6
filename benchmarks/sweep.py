"""A sweep over every model family (benchmarks/sweep_models.py): tapescope's first-step and
steady-state peaks and its op sequence against the same step run for real on this CPU.

Each model runs in its own process (a crash or a hang costs one row), with `threads` CPU threads
for both the prediction and the real run. The real run is validate.real: the allocator's running
total under torch.profiler, the outermost dispatched ops. Where tapescope is low and the real
peak falls inside an op that allocated scratch it frees before returning, the row says how much
and in which op (RealStep.scratch_at_peak): that is kernel workspace, which fake kernels do not
allocate (capture/fidelity WORKSPACE rules).

    nice -n 19 python benchmarks/sweep.py --out sweep.jsonl [NAME-SUBSTRING ...]
    python benchmarks/sweep.py --table sweep.jsonl        # the Markdown table of docs/validation.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXACT_BYTES = 16        # Python-number scalars a CPU kernel makes inside an op (8-12 bytes)
GOAL = 1e-3             # 0.1%


def run_one(index: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, HERE)
    import tapescope
    from sweep_models import ROWS
    from tapescope.errors import TapescopeError
    from tapescope.validate.harness import same_ops
    from tapescope.validate.real import run_real_steps

    row = ROWS[index]
    out = {"family": row.family, "name": row.name, "shape": row.shape,
           "options": {k: v for k, v in row.options.items()
                       if k not in ("forced_routing", "keep_layers")}}
    m = row.make()
    accumulate = row.options.get("accumulate", 1)
    t0 = time.perf_counter()
    try:
        p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                              sizes=row.options.get("sizes"), accumulate=accumulate)
    except TapescopeError as e:
        out["error"] = str(e)
        return out
    out["profile_s"] = time.perf_counter() - t0
    out["predicted"] = [p.first_step_peak_bytes, p.peak_bytes]
    if p.data_sizes is not None:
        out["assumptions"] = [f"{a.where}: {a.detail}" + ("" if a.decided else " (decides nothing)")
                              for a in p.data_sizes.assumptions]
    build = m.build
    if row.options.get("forced_routing"):
        from tapescope.validate.routing import forced_routing

        build = forced_routing(build, row.options["forced_routing"])
    t0 = time.perf_counter()
    if row.options.get("keep_layers"):  # LayerDrop: the real run of a seed that dropped none
        from operator import attrgetter

        from tapescope.validate.layerdrop import steps_keeping_every_layer

        out["seed"], real = steps_keeping_every_layer(
            build, m.inputs, m.input_kwargs, layers=attrgetter(row.options["keep_layers"]),
            loss_fn=m.loss_fn, accumulate=accumulate)
    else:
        real = run_real_steps(build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn,
                              accumulate=accumulate)
    out["real_s"] = time.perf_counter() - t0
    out["measured"] = [real.peaks[1], real.peaks[2]]
    out["scratch"] = [real.scratch_at_peak(1), real.scratch_at_peak(2)]
    ok, diff = same_ops(p, [f"{ph} {n.replace('::', '.')}" for s, ph, n in real.ops
                            if s == 2 and ph])
    out["ops_identical"], out["ops_diff"] = ok, diff[:6]
    return out


def verdict(r: dict) -> str:
    if "error" in r:
        return "error: " + r["error"]
    if "crash" in r:
        return "CRASH: " + r["crash"]
    notes = []
    for (pred, meas), (scratch, op), step in zip(zip(r["predicted"], r["measured"]), r["scratch"],
                                                  ("first step", "steady")):
        gap = meas - pred
        if abs(gap) <= EXACT_BYTES or abs(gap) / meas <= GOAL:
            continue
        if scratch and abs(gap - scratch) <= max(EXACT_BYTES, GOAL * meas):
            notes.append(f"{step}: kernel scratch, {scratch:,} B inside {op} (WORKSPACE rules)")
        elif scratch or _workspace_op(r):
            notes.append(f"{step}: {gap:+,} B; kernel workspace at the real peak ("
                         + (f"{scratch:,} B scratch inside {op}" if scratch else _workspace_op(r))
                         + "; WORKSPACE rules)")
        else:
            notes.append(f"{step}: {gap:+,} B not explained")
    if not notes:
        worst = max(abs(m - p) for p, m in zip(r["predicted"], r["measured"]))
        return f"exact to {worst} B" if worst <= EXACT_BYTES else "within 0.1%"
    return "; ".join(notes)


# kernels whose workspace is an output the fake kernel leaves empty (the real op sequence then
# differs where the backward uses it): the other WORKSPACE rules' domain
_WORKSPACE_OUTPUTS = ("mkldnn_rnn_layer",)


def _workspace_op(r) -> str:
    text = " ".join(r.get("ops_diff") or [])
    return next((f"{k} workspace" for k in _WORKSPACE_OUTPUTS if k in text), "") or (
        "the LSTM's mkldnn_rnn_layer workspace" if "LSTM" in r["name"] else "")


def _err(p, m) -> str:
    return f"{(p - m) / m:+.3%}"


def table(results: list[dict]) -> str:
    lines = ["| family | model | batch x size | first step | steady | ops | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "predicted" in r:
            e1, e2 = (_err(p, m) for p, m in zip(r["predicted"], r["measured"]))
            ops = "identical" if r["ops_identical"] else "differs: " + " ".join(r["ops_diff"][:2])
        else:
            e1 = e2 = ops = "-"
        name = r["name"] + ("".join(f", {k}={v}" for k, v in r.get("options", {}).items()
                                    if k != "accumulate"))
        v = verdict(r).replace("|", "/")
        if r.get("assumptions"):
            v += " — assumed: " + "; ".join(r["assumptions"])
        lines.append(f"| {r['family']} | {name} | {r['shape']} | {e1} | {e2} | {ops} | {v} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("only", nargs="*")
    ap.add_argument("--out", default=os.path.join(HERE, "sweep_results.jsonl"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--table", help="print the Markdown table of a results file")
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(run_one(a.one, a.threads), default=str))
        return
    if a.table:
        with open(a.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    sys.path.insert(0, HERE)
    from sweep_models import ROWS

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    with open(a.out, "a") as f:
        for i, row in enumerate(ROWS):
            if a.only and not any(o in row.name for o in a.only):
                continue
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, __file__, "--one", str(i), "--threads",
                                       str(a.threads)], capture_output=True, text=True,
                                      timeout=a.timeout, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                r = json.loads(lines[-1]) if lines else {
                    "family": row.family, "name": row.name, "shape": row.shape,
                    "crash": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            except subprocess.TimeoutExpired:
                r = {"family": row.family, "name": row.name, "shape": row.shape,
                     "crash": f"timed out after {a.timeout} s"}
            r["wall_s"] = time.perf_counter() - t0
            f.write(json.dumps(r, default=str) + "\n")
            f.flush()
            print(f"[{i + 1}/{len(ROWS)}] {row.name}: {verdict(r)} ({r['wall_s']:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
