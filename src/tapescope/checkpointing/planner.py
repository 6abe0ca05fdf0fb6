"""`tapescope.plan_checkpointing`: what to recompute so that a training step fits a memory budget.

1. Trace the step once without checkpointing (the baseline).
2. Candidate units: the layers of the model's stacks (estimate.find_units), or the user's.
3. For each unit and mode (none, selective, full), its recompute cost and which saved tensors it
   stops keeping, read off the baseline (estimate.unit_effects); applied to the baseline's
   allocation timeline, they give any plan's estimated peak (estimate.PeakModel, ~0.2 ms).
4. For a budget, two candidates, each pruned (units stepped back down while the estimate fits):
   the greedy path - each step moves the unit whose move lowers the estimated peak most per
   second of recompute; position matters and the estimate sees it (the last layers' activations
   are back at the start of the backward anyway, so they come last) - with the one-move plans
   next to it; and a multiple-choice knapsack (dynamic programming) over each move's peak
   reduction alone. The cheaper wins.
5. Re-trace it with the plan applied (torch's own checkpoint_wrapper on the traced copy): its peak
   is the plan's peak. If it misses, or beats the budget by more than the estimate said, aim
   again with the error seen; a few re-traces settle it. A budget no plan meets is reported as
   such, with the lowest peak found.
6. A candidate torch itself refuses to run (torch.utils.checkpoint raises while the re-trace
   recomputes: CheckpointError, or selective checkpointing's "not found in storage" when the
   recomputation runs other ops than the forward did - transformers' KV cache updated again)
   is discarded, with the mode it used for that kind of layer; the search goes on without it,
   and the plan names what was refused and why (`Plan.refused`). Only plans that traced are
   proposed, so only plans torch runs.

benchmarks/checkpoint_plan.py measures the recompute cost of the plans against an exhaustive
search over every plan of small models.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.nn as nn

from ..api import profile_workload
from ..errors import TapescopeError
from ..options import Options, Workload
from .estimate import CPU_BYTES, CPU_FLOPS, PeakModel, find_units, unit_effects
from .policy import FULL, SELECTIVE, UnitPolicy, apply_policies, policy_code

__all__ = ["Plan", "ParetoPoint", "Refusal", "plan_checkpointing", "plan_workload"]


@dataclass(frozen=True)
class Refusal:
    """A mode the planner stopped proposing for a kind of unit, because torch refused to run a
    plan that used it (`reason`: the error, naming the op and module)."""

    kind: str      # the unit's class name, e.g. "LlamaDecoderLayer"
    module: str    # the unit whose re-trace failed
    mode: str
    reason: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        return (f"{self.mode} checkpointing of {self.kind} ({self.module} and its like): torch "
                f"refuses to run it - {self.reason}")


@dataclass(frozen=True)
class ParetoPoint:
    """A budget, the plan chosen for it, and that plan's re-traced peak and recompute cost."""

    budget: int
    peak_bytes: int
    recompute_seconds: float
    recompute_flops: int
    full: int
    selective: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Plan:
    """Which modules to checkpoint, and what that does to the step.

    `peak_bytes` is the peak of the step re-traced with the plan applied (the higher of the
    first and the steady step), never the planner's estimate (`estimated_peak_bytes`).
    `recompute_seconds` comes from the GPU step-time model when the trace is of a GPU, else
    from a nominal roofline (`cost_model` says which).
    """

    budget: int
    policies: tuple
    peak_bytes: int
    first_step_peak_bytes: int
    steady_peak_bytes: int
    baseline_peak_bytes: int
    meets_budget: bool
    recompute_flops: int
    recompute_seconds: float
    cost_model: str
    units: tuple
    estimated_peak_bytes: int
    traces: int
    seconds: float
    pareto: list = field(default_factory=list)
    refused: tuple = ()   # Refusal: modes not proposed because torch refused to run them
    profile: object = field(default=None, repr=False)

    def apply(self, model: nn.Module) -> nn.Module:
        """Checkpoint `model`'s modules as planned, in place (torch.distributed's
        checkpoint_wrapper, non-reentrant torch.utils.checkpoint, selective contexts); returns
        it. The only call that changes a model: planning traced a copy."""
        return apply_policies(model, self.policies)

    def code(self) -> str:
        """The plan as Python to paste into a training script: `apply_checkpointing(model)`."""
        from ..report.text import fmt_bytes

        note = (f"tapescope plan: peak {fmt_bytes(self.peak_bytes)} "
                f"({'within' if self.meets_budget else 'OVER'} the budget of "
                f"{fmt_bytes(self.budget)}; {fmt_bytes(self.baseline_peak_bytes)} without "
                f"checkpointing), recompute {self.recompute_flops:.3g} FLOP, "
                f"{self.recompute_seconds * 1e3:.3g} ms ({self.cost_model})")
        return policy_code(self.policies, note)

    def to_dict(self) -> dict:
        return {
            "budget": self.budget, "meets_budget": self.meets_budget,
            "peak_bytes": self.peak_bytes, "first_step_peak_bytes": self.first_step_peak_bytes,
            "steady_peak_bytes": self.steady_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "recompute_flops": self.recompute_flops, "recompute_seconds": self.recompute_seconds,
            "cost_model": self.cost_model, "units": list(self.units),
            "policies": [p.to_dict() for p in self.policies],
            "traces": self.traces, "planning_seconds": self.seconds,
            "pareto": [p.to_dict() for p in self.pareto],
            "refused": [r.to_dict() for r in self.refused], "code": self.code(),
        }

    def summary(self) -> str:
        from ..report.text import fmt_bytes

        full = sum(p.mode == FULL for p in self.policies)
        sel = len(self.policies) - full
        verdict = "meets" if self.meets_budget else "cannot meet"
        return (f"plan {verdict} the budget {fmt_bytes(self.budget)}: peak "
                f"{fmt_bytes(self.peak_bytes)} (re-traced; {fmt_bytes(self.baseline_peak_bytes)} "
                f"without checkpointing); {full} of {len(self.units)} units checkpointed whole, "
                f"{sel} selectively; recompute {self.recompute_flops:.3g} FLOP, "
                f"{self.recompute_seconds * 1e3:.3g} ms ({self.cost_model})")


def plan_checkpointing(model, *inputs, budget=None, units=None, max_traces: int = 4,
                       pareto: int = 0, input_kwargs=None, name=None, progress=None,
                       **profile_options) -> Plan:
    """Choose what to recompute so that the training step's peak fits `budget`.

    budget: bytes, or a size such as "40GiB" (default with a `gpu`: its usable memory).
    units: the modules to consider (fqns, a module class, or fn(fqn, module) -> bool); default:
        the layers of the model's stacks (an nn.ModuleList / nn.Sequential of like modules).
    max_traces: re-traces the search may spend correcting its estimate (the baseline and the
        final plan's trace included in the count reported, not in this limit).
    pareto: also trace this many budgets between the lowest reachable peak and the baseline's
        (Plan.pareto: budget -> re-traced peak -> recompute cost).
    profile_options: as for `tapescope.profile` (device, gpu, dtype, amp, optimizer, loss_fn...).

    The model is not modified (planning traces a copy); `Plan.apply(model)` applies the plan.
    """
    opts = Options.create(**profile_options)
    return plan_workload(Workload(model, tuple(inputs), dict(input_kwargs or {}), name), opts,
                         budget=budget, units=units, max_traces=max_traces, pareto=pareto,
                         progress=progress)


def plan_workload(workload: Workload, options: Options, *, budget=None, units=None,
                  max_traces: int = 4, pareto: int = 0, progress=None) -> Plan:
    from ..fit import default_budget, parse_bytes

    t0 = time.perf_counter()
    if options.checkpointing:
        raise TapescopeError("plan_checkpointing plans from a step without checkpointing; do "
                             "not pass checkpointing=... as well")
    if options.symbolic:
        raise TapescopeError("plan_checkpointing traces concrete sizes; drop symbolic=...")
    if options.mesh is not None:
        # its re-traces would apply the plan to a distributed profile, a pairing profile()
        # refuses (options.py): not yet checked against real ranks
        raise TapescopeError("plan_checkpointing of a distributed step (mesh=) is not supported "
                             "yet: plan one rank's step on one device (its per-rank batch and "
                             "shard shapes), or apply checkpointing in your parallelize function, "
                             "as torchtitan does")
    for what, n in (("pareto (CLI: --pareto)", pareto), ("max_traces (CLI: --max-traces)",
                                                         max_traces)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TapescopeError(f"{what} takes a whole number >= 0, got {n!r}")
    if budget is None:
        if options.gpu is None:
            raise TapescopeError("give a budget (e.g. '40GiB') or a GPU (e.g. 'h100')")
        budget = default_budget(options.gpu)
    budget = parse_bytes(budget)
    search = _Search(workload, options, units, progress)
    points = search.pareto(pareto, max_traces) if pareto else []
    choice, met = search.choose(budget, max_traces)
    chosen = search.trace(choice, keep=True)
    return Plan(
        budget=budget, policies=search.policies(choice), peak_bytes=chosen.peak,
        first_step_peak_bytes=chosen.first, steady_peak_bytes=chosen.steady,
        baseline_peak_bytes=search.traced[_key({})].peak, meets_budget=met,
        recompute_flops=chosen.flops, recompute_seconds=chosen.seconds,
        cost_model=search.cost_model, units=tuple(search.fqns),
        estimated_peak_bytes=search.estimate(choice), traces=len(search.traced),
        seconds=time.perf_counter() - t0, pareto=points, refused=tuple(search.refused),
        profile=chosen.profile)


@dataclass
class _Traced:
    peak: int      # the higher of the first and the steady step's
    first: int
    steady: int
    flops: int
    seconds: float
    profile: object = field(repr=False, default=None)


def _key(choice: dict) -> frozenset:
    return frozenset(choice.items())


class _Search:
    """The baseline, the greedy order of changes, and the re-traces made so far (by plan)."""

    def __init__(self, workload: Workload, options: Options, units, progress):
        self.options, self.progress = options, progress or (lambda message: None)
        model = workload.model
        if not isinstance(model, nn.Module):
            from ..capture.model import model_of

            model = model_of(model)  # once: the re-traces use the same (meta) model
            workload = Workload(model, workload.args, workload.kwargs,
                                workload.name or getattr(workload.model, "__name__", None))
        self.workload = workload
        self.fqns = find_units(model, units)
        self.kinds = [type(model.get_submodule(f)).__name__ for f in self.fqns]
        self.refused: list[Refusal] = []
        if not self.fqns:
            raise TapescopeError(
                "found no layers to checkpoint (no nn.ModuleList / nn.Sequential of like modules); "
                "name the modules with units=[...] (CLI: --unit NAME)")
        self.progress("tracing the step without checkpointing")
        base = profile_workload(workload, options)
        self.cost_model = (f"{options.gpu.name} step-time model" if base.time is not None else
                           f"nominal roofline: {CPU_FLOPS / 1e12:g} TFLOP/s, "
                           f"{CPU_BYTES / 1e9:g} GB/s")
        self.effects = unit_effects(base, self.fqns)
        self.model = PeakModel(base, self.effects)
        self._estimates: dict = {}
        # each unit's modes, cheapest first (those that keep fewer bytes than no checkpointing)
        self.modes = [sorted((m for m in u.intervals if u.saved_bytes(m) > 0),
                             key=lambda m, u=u: u.seconds[m]) for u in self.effects]
        self.path = self._greedy_path()
        self.traced: dict[frozenset, _Traced] = {_key({}): self._summarise(base)}
        self.traced[_key({})].profile = base  # the plan's profile if no checkpointing is needed

    # ---- the estimate ------------------------------------------------------------------------

    def estimate(self, choice: dict) -> int:
        key = _key(choice)
        e = self._estimates.get(key)
        if e is None:
            e = self._estimates[key] = self.model.peak(choice)
        return e

    def cost(self, choice: dict) -> float:
        return sum(self.effects[k].seconds[m] for k, m in choice.items())

    def _greedy_path(self) -> list[dict]:
        """Plans of rising cost: from none, each step moves one unit to a costlier mode, the move
        that lowers the estimated peak most per second of recompute; when no move lowers it (the
        peak sits where no unit reaches, or needs several moves at once) the one that saves most
        bytes per second. The last layers, whose activations are back at the start of the
        backward anyway, come last."""
        choice: dict = {}
        path = [dict(choice)]
        self.trials: list[list[dict]] = []  # per plan on the path: the one-move plans from it
        peak = self.estimate(choice)
        # Layers alike (same modes, costs and bytes) differ only by position: of those in the
        # same mode, the first and the last are the ones worth trying (a 70B model's 80 layers
        # make 4 candidates a step, not 160)
        signature = [tuple((m, u.seconds[m], u.saved_bytes(m)) for m in modes)
                     for u, modes in zip(self.effects, self.modes)]
        while True:
            best, trials = None, []
            ends: dict = {}
            for k in range(len(self.modes)):
                ends.setdefault((signature[k], choice.get(k)), []).append(k)
            tried = {ks[0] for ks in ends.values()} | {ks[-1] for ks in ends.values()}
            for k, modes in enumerate(self.modes):
                if k not in tried:
                    continue
                now = choice.get(k)
                u = self.effects[k]
                for mode in modes[modes.index(now) + 1 if now else 0:]:
                    trial = {**choice, k: mode}
                    trials.append(trial)
                    dcost = u.seconds[mode] - (u.seconds[now] if now else 0.0)
                    dbytes = u.saved_bytes(mode) - (u.saved_bytes(now) if now else 0)
                    gain = peak - self.estimate(trial)
                    rank = (0 if gain > 0 else 1,
                            dcost / gain if gain > 0 else dcost / max(dbytes, 1), k)
                    if best is None or rank < best[0]:
                        best = (rank, trial)
            self.trials.append(trials)
            if best is None:
                return path
            choice = best[1]
            peak = self.estimate(choice)
            path.append(choice)

    def plan_for(self, target: float) -> dict:
        """The cheapest plan estimated to fit `target`, of two candidates, each with units then
        stepped back down (costliest first) while the estimate still fits:
        - greedy: the plans on the greedy path up to the first that fits, and the one-move plans
          next to them (the best ratio can overshoot a budget one cheaper move meets);
        - knapsack: the cheapest set of moves whose peak reductions, each measured alone from
          the baseline, add up to what the target needs (unlike layers: a cheap move on a small
          layer and one on a large layer can beat the best ratio), the need raised by what the
          estimate still misses, a few times."""
        candidates = []
        fitting = []
        for plan, trials in zip(self.path, self.trials):
            fitting += [(self.cost(t), len(t), i, t) for i, t in enumerate(trials)
                        if self.estimate(t) <= target]
            if self.estimate(plan) <= target:
                fitting.append((self.cost(plan), len(plan), -1, plan))
                break
        if fitting:
            candidates.append(self._prune(min(fitting, key=lambda f: f[:3])[3], target))
        knapsack = self._knapsack(target)
        if knapsack is not None:
            candidates.append(self._prune(knapsack, target))
        if not candidates:
            return self.path[-1]
        return min(candidates, key=lambda c: (self.cost(c), len(c)))

    def _prune(self, choice: dict, target: float) -> dict:
        changed = True
        while changed:
            changed = False
            for k in sorted(choice, key=lambda k: (-self.effects[k].seconds[choice[k]], -k)):
                modes = self.modes[k]
                lower = modes.index(choice[k]) - 1
                trial = dict(choice)
                if lower >= 0:
                    trial[k] = modes[lower]
                else:
                    del trial[k]
                if self.estimate(trial) <= target:
                    choice, changed = trial, True
        return choice

    def _knapsack(self, target: float, rounds: int = 6, resolution: int = 2000) -> dict | None:
        """Multiple-choice knapsack (one mode per unit) by dynamic programming over the peak
        reduction needed, in `resolution` steps."""
        base = self.estimate({})
        items = []  # (unit, mode, reduction alone, cost)
        for k, modes in enumerate(self.modes):
            for mode in modes:
                gain = base - self.estimate({k: mode})
                if gain > 0:
                    items.append((k, mode, gain, self.effects[k].seconds[mode]))
        need = base - target
        if not items or need <= 0:
            return None
        for _ in range(rounds):
            choice = _min_cost_cover(items, need, resolution)
            if choice is None:
                return None
            miss = self.estimate(choice) - target
            if miss <= 0:
                return choice
            need += miss
        return None

    # ---- re-traces ---------------------------------------------------------------------------

    def policies(self, choice: dict) -> tuple:
        out = []
        for unit, mode in sorted(choice.items()):
            u = self.effects[unit]
            out.append(UnitPolicy(u.fqn, mode, u.save_ops if mode == SELECTIVE else ()))
        return tuple(out)

    def trace(self, choice: dict, keep: bool = False) -> _Traced | None:
        """The step re-traced with `choice` applied; None if torch refuses to run it (then the
        search stops proposing what it refused: `_refuse`). Only the last Profile asked to be
        kept is held (a 70B model's profile is hundreds of MB); the others keep their figures."""
        key = _key(choice)
        t = self.traced.get(key)
        if t is None or (keep and t.profile is None):
            policies = self.policies(choice)
            self.progress(f"re-tracing with {len(policies)} units checkpointed")
            try:
                p = profile_workload(self.workload, self.options.but(checkpointing=policies))
            except TapescopeError as e:
                if not _refused_by_torch_checkpoint(e):
                    raise
                self._refuse(choice, e)
                return None
            t = self.traced[key] = self._summarise(p)
        for other_key, other in self.traced.items():
            if other_key != key or not keep:
                other.profile = None
        return t

    def _refuse(self, choice: dict, error: TapescopeError) -> None:
        """torch refused to run `choice`: stop proposing the refused unit's mode for every unit
        of its class (the refusal comes from the class's code - a KV cache its forward updates
        again when recomputed - so its like fail alike, and a 70B model's 80 layers cost one
        failed trace, not 80). Where the error names no unit of the plan, every (class, mode)
        of the plan is dropped. Each refusal drops at least one, so the search ends."""
        module = getattr(error.__cause__, "tapescope_module", None) or ""
        blamed = [k for k in sorted(choice)
                  if module == self.fqns[k] or module.startswith(self.fqns[k] + ".")]
        blamed = blamed[-1:] or sorted(choice)  # the innermost unit that ran the failing op
        dropped = {}
        for k in blamed:
            dropped.setdefault((self.kinds[k], choice[k]), k)
        for (kind, mode), k in dropped.items():
            self.refused.append(Refusal(kind, self.fqns[k], mode, str(error)))
        self.modes = [[m for m in modes if (kind, m) not in dropped]
                      for kind, modes in zip(self.kinds, self.modes)]
        self.path = self._greedy_path()

    def _trace_path_end(self) -> _Traced:
        """The end of the greedy path (the lowest peak the search reaches), re-traced; if torch
        refuses it, the end of the path without what it refused."""
        while True:
            t = self.trace(self.path[-1])
            if t is not None:
                return t

    def _summarise(self, p) -> _Traced:
        rec = [op for op in p.ops if op.recompute]
        if p.time is not None:
            seconds = p.time.recompute
        else:
            seconds = sum(op.runs * ((op.flops if isinstance(op.flops, int) else 0) / CPU_FLOPS
                                     + (op.bytes_read + op.bytes_written) / CPU_BYTES)
                          for op in rec)
        flops = sum(op.total_flops for op in rec if isinstance(op.flops, int))
        return _Traced(max(p.peak_bytes, p.first_step_peak_bytes), p.first_step_peak_bytes,
                       p.peak_bytes, flops, seconds, p)

    def choose(self, budget: int, max_traces: int) -> tuple[dict, bool]:
        """The cheapest re-traced plan that fits `budget` (or the lowest peak found)."""
        if self.traced[_key({})].peak <= budget:
            return {}, True
        error, tries = 0, 0
        while tries < max_traces:
            choice = self.plan_for(budget - error)
            key = _key(choice)
            if key in self.traced:
                if self.traced[key].peak <= budget or choice == self.path[-1]:
                    break
                error += self.traced[key].peak - budget  # missed again: aim lower
                tries += 1
                continue
            t = self.trace(choice)
            if t is None:
                continue  # torch refused it; what it refused is no longer proposed
            tries += 1
            error = t.peak - self.estimate(choice)
        fits = [(t.seconds, t.peak, key) for key, t in self.traced.items() if t.peak <= budget]
        if fits:
            return dict(min(fits)[2]), True
        self._trace_path_end()  # nothing fitted: see what the whole path reaches
        low = min(t.peak for t in self.traced.values())
        # the lowest peak, with the least recompute that reaches it
        best = min((t.seconds, key) for key, t in self.traced.items() if t.peak == low)[1]
        cheaper = self.plan_for(low - (self.traced[best].peak - self.estimate(dict(best))))
        if _key(cheaper) not in self.traced and self.cost(cheaper) < self.cost(dict(best)):
            t = self.trace(cheaper)
            if t is not None and t.peak <= low:
                best = _key(cheaper)
        return dict(best), False

    def pareto(self, n: int, max_traces: int) -> list[ParetoPoint]:
        """n budgets from the lowest peak checkpointing reaches to the baseline's peak, each
        with the cheapest re-traced plan that fits it (so cost falls as the peak rises)."""
        low = self._trace_path_end().peak
        high = self.traced[_key({})].peak
        budgets = sorted({int(low + (high - low) * i / max(n - 1, 1)) for i in range(n)})
        for b in budgets:
            self.choose(b, max_traces)
        rows = []
        for b in budgets:
            fits = [(t.seconds, t.peak, key) for key, t in self.traced.items() if t.peak <= b]
            key = min(fits)[2] if fits else min(self.traced, key=lambda k: self.traced[k].peak)
            t = self.traced[key]
            modes = [m for _, m in key]
            rows.append(ParetoPoint(b, t.peak, t.seconds, t.flops, modes.count(FULL),
                                    modes.count(SELECTIVE)))
        return rows


def _refused_by_torch_checkpoint(error: TapescopeError) -> bool:
    """Did torch.utils.checkpoint itself refuse the traced step: a CheckpointError (recomputed
    tensors differ from the forward's), or an error raised in its own code (selective
    checkpointing's "... not found in storage": the recomputation ran other ops)? The same
    step run for real on the same torch raises the same."""
    import torch.utils.checkpoint as torch_checkpoint

    cause = error.__cause__
    if cause is None:
        return False
    if isinstance(cause, torch_checkpoint.CheckpointError):
        return True
    tb, last = cause.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return last is not None and os.path.abspath(last) == os.path.abspath(torch_checkpoint.__file__)


def _min_cost_cover(items, need: float, resolution: int) -> dict | None:
    """{unit: mode} of least total cost whose reductions sum to at least `need` (one mode per
    unit); None if even all of them fall short. Reductions are counted in steps of
    need / resolution, rounded down (so a cover is never an overcount)."""
    import numpy as np

    res = resolution
    need = max(1, int(np.ceil(need)))
    by_unit: dict = {}
    for k, mode, gain, cost in items:
        by_unit.setdefault(k, []).append((mode, min(res, int(gain) * res // need), cost))
    dp = np.full(res + 1, np.inf)  # dp[v]: least cost reaching v steps (v = res: res or more)
    dp[0] = 0.0
    trail = []
    for k, options in by_unit.items():
        new, src, pick = dp.copy(), np.arange(res + 1), np.full(res + 1, -1)
        for j, (mode, value, cost) in enumerate(options):
            cand, frm = np.full(res + 1, np.inf), np.arange(res + 1) - value
            if value < res:
                cand[value:res] = dp[:res - value] + cost
            lo = max(0, res - value)
            w = lo + int(np.argmin(dp[lo:]))
            cand[res], frm[res] = dp[w] + cost, w
            better = cand < new
            new[better], src[better], pick[better] = cand[better], frm[better], j
        trail.append((k, options, src, pick))
        dp = new
    if not np.isfinite(dp[res]):
        return None
    choice, v = {}, res
    for k, options, src, pick in reversed(trail):
        if pick[v] >= 0:
            choice[k] = options[pick[v]][0]
        v = int(src[v])
    return choice
