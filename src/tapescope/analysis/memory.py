"""The memory timeline of a step: live bytes by category after every op, the peak and its causes.

Live bytes are the sum of the sizes of live storages on the profiled device (each storage once,
however many views point at it) - what a real allocator's "allocated" counter reports, before any
rounding or caching (that is the allocator model's job). A storage's category is the most specific
role it plays (see records.CATEGORIES): a parameter that autograd saves stays a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..capture.records import ALL_CATEGORIES, CATEGORIES, ROLE_ORDER, SAVED, TEMPORARY, Trace
from .events import device_events, initially_live, live_after
from .modules import ancestors
from .ops import Op
from .reallocations import Reallocations
from .steps import StepView

__all__ = ["MemoryReport", "LiveTensor", "LiveGroup", "ModuleMemory", "storage_categories",
           "memory_report", "peak_bytes", "group_live_tensors"]


@dataclass(frozen=True, slots=True)
class LiveTensor:
    """A storage alive at the peak, and where it came from."""

    storage: int
    nbytes: int
    category: str
    op: int | None        # index (in the step) of the op that allocated it; None: before the step
    op_name: str | None   # "resize_": re-allocated before op `op` by the line `source`
    module: str | None
    owner: str | None     # parameter fqn, for parameters, gradients and optimizer state
    source: str | None


@dataclass(frozen=True, slots=True)
class LiveGroup:
    """Tensors alive at the peak that repeat one another: the same size, category, op and line,
    in instances of one repeated block (module pattern `h.*.mlp`)."""

    first: LiveTensor
    count: int
    module: str | None    # the module pattern of the instances
    owner: str | None     # the parameter pattern, for parameters, gradients and state
    nbytes: int           # all of them together


def group_live_tensors(live: list) -> list:
    """`live` (largest first) with repeats grouped, largest group total first."""
    from .modules import module_pattern

    groups: dict = {}
    for t in live:
        module = None if t.module is None else module_pattern(t.module)
        owner = None if t.owner is None else module_pattern(t.owner)
        key = (t.nbytes, t.category, t.op_name, module, owner if t.op is None else None, t.source)
        g = groups.get(key)
        groups[key] = LiveGroup(t, 1, module, owner, t.nbytes) if g is None else \
            LiveGroup(g.first, g.count + 1, module, owner, g.nbytes + t.nbytes)
    return sorted(groups.values(), key=lambda g: (-g.nbytes, g.first.storage))


@dataclass(frozen=True, slots=True)
class ModuleMemory:
    module: str
    peak_bytes: int       # highest live bytes while one of its ops (or a submodule's) ran
    saved_bytes: int      # most activations its ops had saved for backward at one moment


@dataclass
class MemoryReport:
    step: int
    peak_bytes: int
    peak_op: int
    at_peak: dict                 # category -> bytes at the peak
    live_at_peak: list            # LiveTensor, largest first (the `top` largest)
    timeline: list                # per op: highest live bytes while it ran
    timeline_by_category: dict    # category -> per-op bytes at that same moment
    initial_bytes: int
    final_bytes: int
    modules: list = field(default_factory=list)   # ModuleMemory, largest peak first
    # LiveGroup, largest total first (the `top` largest): repeats counted over every tensor
    # alive at the peak
    live_groups: list = field(default_factory=list)

    def to_dict(self, with_timeline: bool = True) -> dict:
        d = {
            "step": self.step, "peak_bytes": _n(self.peak_bytes), "peak_op": self.peak_op,
            "at_peak": {k: _n(v) for k, v in self.at_peak.items()},
            "live_at_peak": [
                {"storage": t.storage, "bytes": _n(t.nbytes), "category": t.category, "op": t.op,
                 "op_name": t.op_name, "module": t.module, "owner": t.owner, "source": t.source}
                for t in self.live_at_peak],
            "live_groups_at_peak": [
                {"bytes_each": _n(g.first.nbytes), "count": g.count, "bytes": _n(g.nbytes),
                 "category": g.first.category, "op_name": g.first.op_name,
                 "module": g.first.module if g.count == 1 else g.module,
                 "owner": g.first.owner if g.count == 1 else g.owner, "source": g.first.source}
                for g in self.live_groups],
            "initial_bytes": _n(self.initial_bytes), "final_bytes": _n(self.final_bytes),
            "modules": [{"module": m.module, "peak_bytes": _n(m.peak_bytes),
                         "saved_bytes": _n(m.saved_bytes)} for m in self.modules],
        }
        if with_timeline:
            d["timeline"] = [_n(x) for x in self.timeline]
            d["timeline_by_category"] = {k: [_n(x) for x in v]
                                         for k, v in self.timeline_by_category.items()}
        return d


def _n(x):
    return x if isinstance(x, int) else str(x)


def storage_categories(trace: Trace) -> list[str]:
    """Category of every storage (index = storage id)."""
    saved_storages = set()
    saved = trace.saved_values
    if saved:
        for op in trace.ops:  # (each op's refs read in place: no tuple made per op)
            for t in op.outputs:
                if t is not None and t.value in saved:
                    saved_storages.add(t.storage)
            for t in op.inputs:
                if t.value in saved:
                    saved_storages.add(t.storage)
    cats = []
    for s in trace.storages:
        roles = s.roles
        for role in ROLE_ORDER:
            if role in roles:
                cats.append(role)
                break
        else:
            cats.append(SAVED if s.id in saved_storages else TEMPORARY)
    for sid, model in trace.stand_ins.items():  # an untraced micro-batch's, as the traced one's
        cats[sid] = cats[model]
    return cats


def peak_bytes(trace: Trace, view: StepView) -> int:
    """Just the peak of a step's live bytes (what memory_report computes, without the details)."""
    storages = trace.storages
    total = peak = sum(storages[sid].nbytes for sid in initially_live(trace, view))
    for _, _, sid, delta in device_events(trace, view):
        total += storages[sid].nbytes if delta > 0 else -storages[sid].nbytes
        if total > peak:
            peak = total
    return peak


def _categories_in(categories: list[str]) -> tuple:
    """The core categories, and the distributed ones some storage has, in report order."""
    extra = set(categories).difference(CATEGORIES)
    if not extra:
        return CATEGORIES
    return tuple(c for c in ALL_CATEGORIES if c in CATEGORIES or c in extra)


def memory_report(trace: Trace, view: StepView, ops: list[Op], categories: list[str],
                  top: int = 20) -> MemoryReport:
    names = _categories_in(categories)
    storages = trace.storages
    local = {t: k for k, t in enumerate(view.ops)}
    n_ops = len(view.ops)

    initial = initially_live(trace, view)
    by_cat = dict.fromkeys(names, 0)
    for sid in initial:
        by_cat[categories[sid]] += storages[sid].nbytes
    total = sum(by_cat.values())
    initial_bytes = total
    initial_cat = dict(by_cat)

    timeline = [None] * n_ops
    timeline_cat = {c: [None] * n_ops for c in names}
    peak, peak_event, peak_pos = total, -1, 0
    for e, pos, sid, delta in device_events(trace, view):
        nbytes = storages[sid].nbytes if delta > 0 else -storages[sid].nbytes
        total += nbytes
        by_cat[categories[sid]] += nbytes
        if total > peak:
            peak, peak_event, peak_pos = total, e, pos
        if n_ops and (timeline[pos] is None or total > timeline[pos]):
            timeline[pos] = total  # the highest level while the op ran
            for c in names:
                timeline_cat[c][pos] = by_cat[c]
    # ops that allocated and freed nothing carry the level of the op before them (a level is
    # never None, and an op's categories are set together with its total: each column is
    # filled on its own)
    for column, last in ((timeline, initial_bytes),
                         *((timeline_cat[c], initial_cat[c]) for c in names)):
        for p in range(n_ops):
            level = column[p]
            if level is None:
                column[p] = last
            else:
                last = level

    live_at_peak = live_after(trace, view, peak_event)
    at_peak = dict.fromkeys(names, 0)
    for sid in live_at_peak:
        at_peak[categories[sid]] += storages[sid].nbytes
    tensors = []
    resized = Reallocations(trace)
    for sid in sorted(live_at_peak, key=lambda s: storages[s].nbytes, reverse=True):
        k = local.get(storages[sid].created_by)  # None: made before this step
        again = resized.of(sid) if k is not None else None
        if again is not None:  # re-allocated between ops: by a line, for the next op's module
            tensors.append(LiveTensor(
                sid, storages[sid].nbytes, categories[sid], local.get(again.next_op, k),
                "resize_", again.module, trace.storage_owner.get(sid), again.where))
            continue
        op = ops[k] if k is not None else None
        tensors.append(LiveTensor(
            sid, storages[sid].nbytes, categories[sid], k, op.name if op else None,
            op.module if op else None, trace.storage_owner.get(sid), _source(trace, op)))
    # repeats are counted over every tensor alive at the peak, not only among the largest few
    # (a tensor each of 8 blocks holds is x8 even where 20 larger ones come first)
    groups = group_live_tensors(tensors)[:top]

    return MemoryReport(
        step=view.step, peak_bytes=peak, peak_op=peak_pos, at_peak=at_peak,
        live_at_peak=tensors[:top], live_groups=groups, timeline=timeline, timeline_by_category=timeline_cat,
        initial_bytes=initial_bytes, final_bytes=total,
        modules=_module_memory(trace, view, ops, timeline, categories),
    )


def _source(trace, op) -> str | None:
    """Where an op came from: the user's line, else the compiled graph whose generated code ran
    it (inductor's files are named by a hash: no line of the user's)."""
    if op is None:
        return None
    if op.source is not None:
        return str(op.source)
    i = op.record.index
    for label, start, end in trace.compiled_calls:
        if start <= i < end:
            return f"compiled graph ({label})"
    return None


def _module_memory(trace, view, ops, timeline, categories) -> list[ModuleMemory]:
    """Per module: the highest live bytes while its ops ran, and the most saved activations whose
    memory its ops allocated that were alive at one moment (a view that autograd saves keeps its
    base's allocation alive). At one moment, not added up over the step: what checkpointing
    recomputes is saved again in the backward and freed at once, and each micro-batch of an
    accumulated step saves anew, so a sum would exceed the step's peak."""
    storages = trace.storages
    peak: dict[str, int] = {}
    local = {t: k for k, t in enumerate(view.ops)}
    lineage: dict[str, tuple] = {}  # module -> its ancestors (a step has few modules, many ops)

    def ancestors_of(module: str) -> tuple:
        found = lineage.get(module)
        if found is None:
            found = lineage[module] = tuple(ancestors(module))
        return found

    for op in ops:
        if op.module is None:
            continue
        live = timeline[op.index]
        for m in ancestors_of(op.module):
            if m not in peak or live > peak[m]:
                peak[m] = live
    owners: dict[int, tuple] = {}  # a saved storage made in this step -> its op's modules
    for s in storages:
        k = local.get(s.created_by)
        if k is not None and categories[s.id] == SAVED and ops[k].module is not None:
            owners[s.id] = ancestors_of(ops[k].module)
    alive: dict[str, int] = {}
    saved: dict[str, int] = {}
    for _, _, sid, delta in device_events(trace, view):
        mods = owners.get(sid)
        if mods is None:
            continue
        nbytes = storages[sid].nbytes if delta > 0 else -storages[sid].nbytes
        for m in mods:
            alive[m] = alive.get(m, 0) + nbytes
            if delta > 0 and alive[m] > saved.get(m, 0):
                saved[m] = alive[m]
    out = [ModuleMemory(m, p, saved.get(m, 0)) for m, p in peak.items()]
    out.sort(key=lambda m: m.peak_bytes, reverse=True)
    return out
