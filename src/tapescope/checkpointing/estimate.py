"""What checkpointing a module would do to a step, read off one trace of the step without it.

For each candidate module (a "unit", one call of it in the forward) and each mode, from the
baseline trace's records alone:

- recompute cost: its forward ops, in order, up to the last tensor checkpoint packs (non-reentrant
  checkpoint stops there: the op that packs it is recomputed if it packs an output, not if it
  packs an input, before its kernel); what an op's node saved is what its backward ops read. A
  selective policy keeps the matmul and attention outputs, so those ops cost nothing again. Cost
  is the step-time model's seconds per op on a GPU (analysis.timing), elsewhere a nominal
  roofline of FLOPs and bytes.
- memory: a tensor the unit made and autograd saved, read by no forward op outside the unit, is
  no longer kept from the forward to the unit's backward: it dies after its last forward read
  and comes back when the unit's first backward node runs (the recomputation). A selective
  policy keeps the outputs of matmul / attention ops alive until then (checkpoint caches them),
  or until the unit's backward ends for an op the recomputation stops before, and drops the rest.
  On CPU, each checkpointed call also keeps the RNG state (5056 bytes).

`PeakModel` applies any choice of modes to the baseline's allocation timeline and gives the
peak: an estimate that steers the search. The plan's reported peak is always a re-trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch.nn as nn

from ..analysis.events import device_events, initially_live
from ..analysis.memory import storage_categories
from ..analysis.op_classes import op_class
from ..analysis.steps import step_views
from ..capture.records import BACKWARD, FORWARD, SAVED, TEMPORARY
from .policy import FULL, SELECTIVE

__all__ = ["UnitEffect", "PeakModel", "unit_effects", "find_units", "CPU_FLOPS", "CPU_BYTES"]

# The nominal roofline that ranks recomputation off a GPU: 1 TFLOP/s, 100 GB/s.
CPU_FLOPS, CPU_BYTES = 1e12, 1e11
RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator's Mersenne Twister state
_KEPT_CLASSES = ("matmul", "attention", "convolution")


@dataclass
class UnitEffect:
    """One unit: its ops in the step (positions), and per mode its cost and memory changes.

    intervals[mode]: (bytes, first event, end event) changes of live bytes over events
    [first, end): negative where a tensor is no longer alive, positive where one lives longer.
    """

    fqn: str
    index: int                      # forward order among the units
    forward: tuple                  # positions of its forward ops
    backward_start: int | None      # position of its first backward op
    save_ops: tuple = ()            # the ops a selective policy keeps (their overload names)
    seconds: dict = field(default_factory=dict)
    flops: dict = field(default_factory=dict)
    intervals: dict = field(default_factory=dict)

    def saved_bytes(self, mode: str) -> int:
        """Bytes no longer kept from forward to backward (the linear view of the saving)."""
        return -sum(b for b, _, _ in self.intervals.get(mode, ()))


def find_units(model: nn.Module, units=None) -> list[str]:
    """The modules to consider, as fqns in forward-definition order.

    Default: the layers of the model's stacks - the children of an nn.ModuleList or
    nn.Sequential holding at least two modules of one class with parameters (transformer blocks,
    ResNet blocks) - outermost stacks only. `units` overrides: fqns, a module class, or a
    predicate fn(fqn, module) -> bool.
    """
    named = dict(model.named_modules(remove_duplicate=False))
    if units is not None:
        if isinstance(units, type):
            chosen = [n for n, m in named.items() if isinstance(m, units) and n]
        elif callable(units):
            chosen = [n for n, m in named.items() if n and units(n, m)]
        else:
            chosen = [units] if isinstance(units, str) else list(units)  # one fqn, or several
            for n in chosen:
                if n not in named or not n:
                    from ..errors import TapescopeError

                    raise TapescopeError(f"the model has no module {n!r} to checkpoint")
        return _outermost(chosen)
    found = []
    for name, mod in named.items():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(f"{name}.{k}" if name else k, c) for k, c in mod._modules.items()
                    if c is not None and any(True for _ in c.parameters())]
        by_class: dict = {}
        for fqn, c in children:
            by_class.setdefault(type(c), []).append(fqn)
        for fqns in by_class.values():
            if len(fqns) >= 2:
                found.extend(fqns)
    order = {n: i for i, n in enumerate(named)}
    return _outermost(sorted(set(found), key=order.get))


def _outermost(fqns: list[str]) -> list[str]:
    out = []
    for n in fqns:
        if not any(n != o and n.startswith(o + ".") for o in fqns):
            out.append(n)
    return out


def unit_effects(profile, fqns: list[str]) -> list[UnitEffect]:
    """The effect of checkpointing each of `fqns` (each call of it) in `profile`'s step."""
    trace = profile.trace
    ops = profile.ops
    categories = getattr(profile, "_categories", None) or storage_categories(trace)
    seconds = _op_seconds(profile)
    cpu = trace.device.type == "cpu"

    # where each unit's forward ops are, and who reads each storage in the forward
    owner_of = _unit_of_module(fqns, {op.module for op in ops if op.module is not None})
    calls: list[tuple[str, list[int]]] = []
    last_unit = None
    readers: dict[int, list[int]] = {}
    for op in ops:
        if op.phase != FORWARD:
            continue
        for t in op.inputs:
            readers.setdefault(t.storage, []).append(op.index)
        u = owner_of.get(op.module)
        if u is None:
            last_unit = None
            continue
        if u != last_unit:
            calls.append((u, []))
            last_unit = u
        calls[-1][1].append(op.index)

    events = _Events(trace, profile)
    unit_of_op = {}
    for k, (_, positions) in enumerate(calls):
        for i in positions:
            unit_of_op[i] = k
    backward_start: dict[int, int] = {}
    backward_end: dict[int, int] = {}
    unpacked: dict[int, set] = {}  # forward op -> values its node's backward ops read
    for op in ops:
        if op.phase == BACKWARD and not op.recompute and op.forward_op is not None:
            unpacked.setdefault(op.forward_op, set()).update(t.value for t in op.inputs)
            k = unit_of_op.get(op.forward_op)
            if k is not None:
                backward_start.setdefault(k, op.index)
                backward_end[k] = op.index

    effects = []
    for k, (fqn, positions) in enumerate(calls):
        u = UnitEffect(fqn, k, tuple(positions), backward_start.get(k))
        effects.append(u)
        if u.backward_start is None:
            continue  # nothing of it runs in the backward: nothing to recompute
        inside = set(positions)
        # Non-reentrant checkpoint recomputes until it has packed as many tensors as the forward
        # did: up to the op of the last pack, itself included if it packs an output (after its
        # kernel), not if it packs an input (before its kernel: the op stops there). What an
        # op's node saved is what that node's backward ops read.
        last_in = max((i for i in positions
                       if any(t.value in unpacked.get(i, ()) for t in ops[i].inputs)), default=-1)
        last_out = max((i for i in positions
                        if any(t.value in unpacked.get(i, ()) for t in ops[i].outputs)),
                       default=-1)
        last = last_out if last_out >= last_in else last_in - 1
        if last_in < 0 and last_out < 0:
            continue
        recomputed = [i for i in positions if i <= last]
        kept = {i for i in positions if op_class(ops[i].record.func) in _KEPT_CLASSES}
        u.save_ops = tuple(sorted({ops[i].name for i in kept}))
        back = events.at(u.backward_start)
        for mode in (FULL, SELECTIVE):
            if mode == SELECTIVE and not kept:
                continue
            again = recomputed if mode == FULL else [i for i in recomputed if i not in kept]
            u.seconds[mode] = sum(seconds[i] for i in again)
            u.flops[mode] = sum(ops[i].flops or 0 for i in again)
            changes = []
            for i in positions:
                op = ops[i]
                keep = mode == SELECTIVE and i in kept
                for t in op.outputs:
                    sid = t.storage
                    if sid < 0 or trace.storages[sid].created_by != op.record.index:
                        continue
                    category = categories[sid]
                    death = events.death.get(sid)
                    if category == SAVED and not keep:
                        reads = readers.get(sid, ())
                        if any(r not in inside for r in reads):
                            continue  # read outside the unit: still kept (saved by another)
                        start = events.at(max([i, *reads]) + 1)
                        end = back if death is None else min(back, death)
                        if start < end:
                            changes.append((-trace.storages[sid].nbytes, start, end))
                    elif category == TEMPORARY and keep and death is not None:
                        # checkpoint's cache holds it until the recomputation takes it back, or,
                        # for an op the recomputation never reaches, until the call is released
                        until = back if i <= last else events.at(backward_end[k] + 1)
                        if death < until:
                            changes.append((trace.storages[sid].nbytes, death, until))
            if cpu:  # the RNG state checkpoint keeps until the call is recomputed and released
                changes.append((RNG_STATE_BYTES, events.at(positions[0]),
                                events.at(backward_end[k] + 1)))
            u.intervals[mode] = changes
    return _merge_calls([u for u in effects if u.intervals])


def _merge_calls(effects: list[UnitEffect]) -> list[UnitEffect]:
    """One effect per module: a module called twice is checkpointed in both calls (a plan wraps
    the module), so its calls' costs and changes add up, in the modes both calls allow."""
    merged: dict[str, UnitEffect] = {}
    for u in effects:
        m = merged.get(u.fqn)
        if m is None:
            merged[u.fqn] = u
            continue
        for mode in list(m.intervals):
            if mode not in u.intervals:
                del m.intervals[mode]
                continue
            m.seconds[mode] += u.seconds[mode]
            m.flops[mode] += u.flops[mode]
            m.intervals[mode] = m.intervals[mode] + u.intervals[mode]
        m.save_ops = tuple(sorted(set(m.save_ops) | set(u.save_ops)))
    out = list(merged.values())
    for i, u in enumerate(out):
        u.index = i
    return out


def _unit_of_module(fqns: list[str], modules: set) -> dict:
    """Module fqn -> the unit containing it (itself or an ancestor)."""
    units = set(fqns)
    out = {}
    for m in modules:
        probe = m
        while True:
            if probe in units:
                out[m] = probe
                break
            if "." not in probe:
                break
            probe = probe.rsplit(".", 1)[0]
    return out


def _op_seconds(profile) -> list[float]:
    """Each op's time: the GPU step-time model where there is one, else the nominal roofline."""
    t = profile.time if profile.trace.device.type == "cuda" else None
    if t is not None:
        return list(t.op_seconds)
    out = []
    for op in profile.ops:
        flops = op.flops if isinstance(op.flops, int) else 0
        out.append(op.runs * (flops / CPU_FLOPS + (op.bytes_read + op.bytes_written) / CPU_BYTES))
    return out


class _Events:
    """The step's allocation timeline on the traced device: live bytes after each event, the
    event at which each op's events begin, each storage's death."""

    def __init__(self, trace, profile):
        view = step_views(trace)[profile.steps]
        storages = trace.storages
        pos, level, self.death = [], [], {}
        live = sum(storages[s].nbytes for s in initially_live(trace, view))
        self.initial = live
        for e, p, sid, delta in device_events(trace, view):
            live += storages[sid].nbytes * delta
            pos.append(p)
            level.append(live)
            if delta < 0:
                self.death[sid] = len(pos) - 1
        self.pos = np.asarray(pos, dtype=np.int64)
        self.level = np.asarray(level, dtype=np.int64)

    def at(self, position: int) -> int:
        """The first event of the op at `position` or later (len: none)."""
        return int(np.searchsorted(self.pos, position, side="left"))


class PeakModel:
    """The baseline timeline with units' changes applied: `peak(choice)` for {fqn index: mode}."""

    def __init__(self, profile, effects: list[UnitEffect]):
        self.events = _Events(profile.trace, profile)
        self.effects = effects
        n = len(self.events.level)
        self._diffs = {}
        for k, u in enumerate(effects):
            for mode, changes in u.intervals.items():
                d = np.zeros(n + 1, dtype=np.int64)
                for nbytes, a, b in changes:
                    d[a] += nbytes
                    d[b] -= nbytes
                nz = np.nonzero(d)[0]
                self._diffs[(k, mode)] = (nz, d[nz])

    def peak(self, choice: dict) -> int:
        ev = self.events
        d = np.zeros(len(ev.level) + 1, dtype=np.int64)
        for k, mode in choice.items():
            idx, val = self._diffs[(k, mode)]
            d[idx] += val
        levels = ev.level + np.cumsum(d[:-1])
        return int(max(ev.initial, levels.max(initial=ev.initial)))
