"""How good and how fast `tapescope.plan_checkpointing` is.

1. Optimality: on small models with 4 checkpointable layers (3 modes each: 81 plans), every plan
   is traced; for budgets spread between the lowest reachable peak and the peak without
   checkpointing, the cheapest plan whose traced peak fits (the exhaustive optimum) is compared
   with the planner's plan (its re-traced peak and recompute cost, the same cost model).
2. Speed: planning a 70B Llama step (verification re-traces included) - wall time, CPU time and
   peak resident memory, in a fresh subprocess, against one plain profile of the same step in
   the same subprocess.
3. Side by side with torch's own knob, functorch's `activation_memory_budget`, on a compiled
   real CPU step (the allocator's steady peak per budget fraction), with `--torch`.

    python benchmarks/checkpoint_plan.py [--skip-exhaustive] [--skip-70b] [--torch]

Prints Markdown tables (docs/checkpointing.md keeps the last run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time

import torch
import torch.nn as nn

import tapescope
from tapescope.checkpointing.planner import _Search
from tapescope.checkpointing.policy import FULL, SELECTIVE, UnitPolicy
from tapescope.options import Options, Workload
from tapescope.zoo import ModelSpec, resolve

SMALL = [
    ("zoo:gpt2:n_layer=4,n_embd=128,n_head=4,vocab_size=512,block_size=128", 4, 128, "cpu"),
    ("zoo:llama:dim=128,n_layers=4,n_heads=4,n_kv_heads=2,ffn_dim=352,vocab_size=512", 4, 128,
     "cpu"),
    ("zoo:gpt2:n_layer=4,n_embd=128,n_head=4,vocab_size=512,block_size=128", 4, 128, "cuda"),
    ("uneven", 4096, None, "cpu"),
]


class _Block(nn.Module):
    """A residual MLP block; blocks of different widths make layers unlike each other."""

    def __init__(self, d, h):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(d), nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.b(torch.tanh(nn.functional.gelu(self.a(self.norm(x)))))


class Uneven(nn.Module):
    """Four layers of hidden widths 1024, 128, 512, 256 (d=128): savings and costs differ."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block(128, h) for h in (1024, 128, 512, 256))
        self.head = nn.Linear(128, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _model(spec, batch, seq):
    if spec == "uneven":
        return ModelSpec("uneven", Uneven, (tapescope.spec((batch, 128)),))
    return resolve(spec, batch=batch, seq=seq)


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def exhaustive(spec, batch, seq, device, n_budgets=6):
    m = _model(spec, batch, seq)
    wl = Workload(m.build, tuple(m.inputs), dict(m.input_kwargs), spec)
    kw = dict(loss_fn=m.loss_fn, device=device, gpu="h100" if device == "cuda" else None)
    opts = Options.create(**kw)
    search = _Search(wl, opts, None, None)
    effects = search.effects
    table = {}
    t0 = time.perf_counter()
    for modes in itertools.product((None, SELECTIVE, FULL), repeat=len(effects)):
        policies = tuple(UnitPolicy(u.fqn, mode, u.save_ops if mode == SELECTIVE else ())
                         for u, mode in zip(effects, modes) if mode is not None)
        p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                              checkpointing=policies, **kw)
        t = search._summarise(p)
        table[modes] = (t.peak, t.seconds)
    enumerate_s = time.perf_counter() - t0
    low = min(v[0] for v in table.values())
    high = table[(None,) * len(effects)][0]
    rows = []
    for i in range(n_budgets):
        budget = int(low + (high - low) * i / (n_budgets - 1))
        best = min((v[1] for v in table.values() if v[0] <= budget), default=None)
        t = time.perf_counter()
        plan = tapescope.plan_checkpointing(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                                            budget=budget, **kw)
        rows.append(dict(budget=budget, optimum=best, plan=plan.recompute_seconds,
                         plan_peak=plan.peak_bytes, estimate=plan.estimated_peak_bytes,
                         met=plan.meets_budget, traces=plan.traces,
                         seconds=time.perf_counter() - t,
                         plan_modes=f"{sum(p.mode == FULL for p in plan.policies)}F"
                                    f"+{sum(p.mode == SELECTIVE for p in plan.policies)}S"))
    return dict(spec=spec, device=device, plans=len(table), enumerate_s=enumerate_s,
                cost_model=search.cost_model, rows=rows)


def print_exhaustive(results):
    print("| model | device | budget | planner peak (re-traced) | its estimate | planner recompute | "
          "optimum of 81 | over optimum | plan | traces |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = worst_err = 0.0
    exact = n = 0
    for r in results:
        name = (r["spec"].split(":")[1] if ":" in r["spec"] else r["spec"]) + " (4 layers)"
        for row in r["rows"]:
            opt, got = row["optimum"], row["plan"]
            if opt is None:
                over = "no plan fits" if not row["met"] else "?"
            elif opt == 0:
                over = "0%" if got == 0 else "inf"
            else:
                worst = max(worst, got / opt - 1)
                over = f"{(got / opt - 1) * 100:+.1f}%"
            err = (row["estimate"] - row["plan_peak"]) / row["plan_peak"]
            exact += row["estimate"] == row["plan_peak"]
            worst_err = max(worst_err, abs(err))
            print(f"| {name} | {r['device']} | {_fmt(row['budget'])} | {_fmt(row['plan_peak'])}"
                  f"{'' if row['met'] else ' (over)'} | {err * 100:+.2f}% | {got * 1e6:.1f} us | "
                  f"{'-' if opt is None else f'{opt * 1e6:.1f} us'} | {over} | "
                  f"{row['plan_modes']} | {row['traces']} |")
    n = sum(len(r["rows"]) for r in results)
    print(f"\nworst excess over the exhaustive optimum: {worst * 100:.1f}%; the chosen plan's "
          f"estimated peak equalled its re-traced peak in {exact} of {n} cases (worst error "
          f"{worst_err * 100:.2f}%)")
    for r in results:
        print(f"- {r['spec']} on {r['device']}: {r['plans']} plans traced in "
              f"{r['enumerate_s']:.0f} s; cost model: {r['cost_model']}")


_WORKER = r"""
import json, resource, sys, time
import tapescope
from tapescope.zoo import ModelSpec, resolve
spec, batch, seq, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
m = resolve(spec, batch=batch, seq=seq)
kw = dict(input_kwargs=m.input_kwargs, loss_fn=m.loss_fn, device="cuda", gpu="h100", dtype="bf16")
w, c = time.perf_counter(), time.process_time()
p = tapescope.profile(m.build, *m.inputs, **kw)
profile = (time.perf_counter() - w, time.process_time() - c, len(p.ops), p.peak_bytes)
del p
w, c = time.perf_counter(), time.process_time()
plan = tapescope.plan_checkpointing(m.build, *m.inputs, budget=budget, **kw)
out = dict(profile_wall=profile[0], profile_cpu=profile[1], ops=profile[2], baseline=profile[3],
           plan_wall=time.perf_counter() - w, plan_cpu=time.process_time() - c,
           rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, traces=plan.traces,
           peak=plan.peak_bytes, estimated=plan.estimated_peak_bytes, budget=plan.budget,
           met=plan.meets_budget, full=sum(p.mode == "full" for p in plan.policies),
           selective=sum(p.mode == "selective" for p in plan.policies), units=len(plan.units),
           recompute_ms=plan.recompute_seconds * 1e3)
print(json.dumps(out))
"""


def llama70b(batch=8, seq=4096, budget="640GiB"):
    r = subprocess.run([sys.executable, "-c", _WORKER, "zoo:llama-70b", str(batch), str(seq),
                        budget], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def print_70b(r, batch, seq):
    print(f"| zoo:llama-70b, {batch} x {seq}, bf16, AdamW, H100 rules | value |")
    print("|---|---|")
    print(f"| baseline peak (no checkpointing) | {_fmt(r['baseline'])} |")
    print(f"| budget | {_fmt(r['budget'])} |")
    print(f"| plan | {r['full']} of {r['units']} layers whole, {r['selective']} selective; "
          f"recompute {r['recompute_ms']:.0f} ms (H100 model) |")
    print(f"| peak, re-traced (estimate) | {_fmt(r['peak'])} ({_fmt(r['estimated'])}) "
          f"{'meets' if r['met'] else 'MISSES'} the budget |")
    print(f"| planning: wall / CPU time | {r['plan_wall']:.1f} s / {r['plan_cpu']:.1f} s "
          f"({r['traces']} traces incl. the baseline) |")
    print(f"| one plain profile: wall / CPU time | {r['profile_wall']:.1f} s / "
          f"{r['profile_cpu']:.1f} s ({r['ops']} ops) |")
    print(f"| planning / profile (CPU time) | {r['plan_cpu'] / r['profile_cpu']:.2f}x |")
    print(f"| peak resident memory (process, torch included) | {_fmt(r['rss'])} |")


_TORCH_WORKER = r"""
import json, sys
import torch
import torch._functorch.config as fconfig
from tapescope.validate.real import run_real_steps
from tapescope.zoo import ModelSpec, resolve
spec, batch, seq, frac = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
m = resolve(spec, batch=batch, seq=seq)
fconfig.activation_memory_budget = frac
def build():
    return torch.compile(m.build())
real = run_real_steps(build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn, steps=3)
print(json.dumps({"steady": real.peaks[3]}))
"""


def torch_budget(spec, batch, seq, fracs=(1.0, 0.5, 0.2, 0.05)):
    rows = []
    for f in fracs:
        r = subprocess.run([sys.executable, "-c", _TORCH_WORKER, spec, str(batch), str(seq),
                            str(f)], capture_output=True, text=True)
        if r.returncode:
            rows.append((f, None, r.stderr.strip().splitlines()[-1][:120]))
        else:
            rows.append((f, json.loads(r.stdout.strip().splitlines()[-1])["steady"], ""))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-exhaustive", action="store_true")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--budget-70b", default="640GiB")
    a = ap.parse_args()
    if not a.skip_exhaustive:
        print_exhaustive([exhaustive(*s) for s in SMALL])
        print()
    if not a.skip_70b:
        print_70b(llama70b(budget=a.budget_70b), 8, 4096)
        print()
    if a.torch:
        spec, batch, seq = SMALL[0][:3]
        m = resolve(spec, batch=batch, seq=seq)
        base = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs,
                                 loss_fn=m.loss_fn)
        print("| torch.compile, activation_memory_budget | real steady peak (allocator) |")
        print("|---|---|")
        for f, peak, note in torch_budget(spec, batch, seq):
            print(f"| {f} | {_fmt(peak) if peak else note} |")
        print(f"\neager, no checkpointing (tapescope = real): {_fmt(base.peak_bytes)}")


if __name__ == "__main__":
    main()
