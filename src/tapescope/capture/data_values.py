"""Data-dependent sizes: the value an explicit assumption gives them, carried as unbacked symbols.

A size that depends on tensor values (how many tokens a router sends to an expert, how many
elements a boolean mask keeps) cannot be read from shapes. PyTorch's ShapeEnv carries such a size
as an unbacked SymInt (`u0`): the op that makes it (nonzero, masked_select, unique ...) gives its
output that size and every later op computes with it symbolically. What is missing is a value:
a Python branch or loop on it stops a fake trace. tapescope takes the value from an assumption
(`Sizes`), and the report names every assumption it used:

- routing: the indices a router selects (aten.topk's, argmax's) get real values that realize the
  assumed routing: "balanced" (tokens x top-k / experts per expert), "worst" (every token to
  expert 0, the rest spread evenly), or the user's shares per expert. Every op whose tensor inputs
  all carry values then runs for real on those values (a one-hot, a histogram, a sort,
  `expert_mask[e]`: small integer tensors), so each size, `.item()`, `.tolist()` or Python branch
  they decide has the value a real step routed that way has. A nonzero's unbacked size gets its
  value through ShapeEnv.set_real_tensor_prop_unbacked_vals, the mechanism torch's draft export
  uses: a guard on it evaluates with the value and becomes a runtime assertion.
- mask: a boolean mask no assumption decided (`x[x > 0]`) keeps the user's fraction of elements.
- input: an integer input the user gave as a real tensor (labels, token ids) keeps its values.
- random: a small random draw (LayerDrop's `torch.rand([])`, at most RANDOM_LIMIT elements) is
  taken at its median (`_DRAWS`: 0.5 for rand, the mean for randn, the likelier outcome of a
  bernoulli), so a branch on `draw < p` takes its likelier side: with a drop probability below
  1/2, every layer runs, the memory-worst case. Named in the report only where the step read a
  draw; a draw used as data (a dropout mask) decides nothing.

Constants need no assumption: a tensor the model holds (a buffer or tensor attribute of at most
CONSTANT_LIMIT elements: Encodec's `padding_total`, BatchNorm's `num_batches_tracked`,
torchvision's cell anchors) keeps its values (`give_constant`; a model built on meta from a build
function keeps those its build made, build_values.py). One on the meta device with no value is
marked, and a read of it (or of what it computed) stops with a message naming the buffer.

The sizes stay symbols: memory and FLOPs are formulas of them (analysis/symbolic.py), one name per
source line, op and value (under balanced routing every expert's token count comes from one line
with one value: one name, "peak = f(that count)"), evaluated at the assumed values.

Why our own propagation rather than FakeTensorMode(propagate_real_tensors=True): that mode runs
every op for real when its inputs have real values, factory functions included, which would
allocate the model. Here only the routing's descendants carry values, each at most VALUE_LIMIT
elements, and a pure op's values are computed only when something reads them (`_defer`): most
never are (a rope's positions once a DTensor mask's literal turns values on), and computed at once
they held 1 GiB of a 405B rank's capture.
"""

from __future__ import annotations

import os
from math import prod
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..errors import TapescopeError, UnknownValueRead
from ..torch_compat import (DynamicOutputShapeException, FakeTensor, fake_mode_unset,
                            free_unbacked_symbols, pytree_node_types, tree_flatten, tree_map)
from ..values.sizes import ROUTINGS, Sizes
from .build_values import build_value

__all__ = ["Sizes", "DataValues", "OpKind", "DataSize", "Assumption", "UnknownValueRead",
           "expert_counts", "routing_indices", "ROUTINGS", "CONSTANT_LIMIT"]

_CPU = torch.device("cpu")  # where the values live
VALUE_LIMIT = 1 << 22     # elements: larger tensors are not given values (then no assumption holds)
FACTORY_LIMIT = 1 << 16   # factory outputs (arange(E), a causal mask) get values up to this size

_ATTR = "_tapescope_data"  # (real tensor, frozenset of assumption ids), on a fake tensor
_UNKNOWN = "_tapescope_unknown"  # on a small fake tensor whose values no one knows: Unknown
RANDOM_LIMIT = 64          # elements: a random scalar (LayerDrop's torch.rand([])), not a mask
CONSTANT_LIMIT = 64        # elements: an integer buffer this small is a constant (a stride, a pad)
aten = torch.ops.aten


# ---- the assumption ------------------------------------------------------------------------

def expert_counts(tokens: int, k: int, experts: int, routing) -> list[int]:
    """How many of the tokens x k assignments each expert receives under `routing` (each count
    at most `tokens`: a token picks an expert once)."""
    total = tokens * k

    def spread(n, over):
        return [n // over + (1 if i < n % over else 0) for i in range(over)] if over else []

    if routing == "balanced":
        return spread(total, experts)
    if routing == "worst":
        return [tokens] + spread(total - tokens, experts - 1)
    shares = tuple(routing)
    if len(shares) != experts:
        raise TapescopeError(f"routing gives {len(shares)} shares, but the router chooses among "
                             f"{experts} experts")
    raw = [s / sum(shares) * total for s in shares]
    counts = [int(r) for r in raw]
    for i in sorted(range(experts), key=lambda i: counts[i] - raw[i])[:total - sum(counts)]:
        counts[i] += 1  # largest remainders first: the counts add up to tokens x k
    if max(counts) > tokens:
        raise TapescopeError(f"routing shares {shares} send {max(counts)} of {tokens} tokens x "
                             f"top-{k} to one expert; a token picks an expert once, so a share "
                             f"can be at most 1/{k} of the total")
    return counts


def routing_indices(tokens: int, k: int, experts: int, routing) -> torch.Tensor:
    """(tokens, k) expert indices realizing `routing`: expert e appears counts[e] times, never
    twice for one token (the assignments are laid out column by column, and a run of one expert
    is at most `tokens` long, so it meets each token at most once)."""
    counts = expert_counts(tokens, k, experts, routing)
    order = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    return order.view(k, tokens).t().contiguous()


# ---- records ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Assumption:
    """One place where an assumption gave values: a router's selection, a mask."""

    kind: str     # "routing", "mask", "finite gradients", ...
    where: str    # the source line
    detail: str   # what was assumed, in words
    decided: bool = True  # False: no size or value read of the step depended on it


@dataclass(frozen=True)
class DataSize:
    """A size the data decides, as the trace carries it: one name, its assumed value."""

    name: str
    value: int
    op: str
    where: str
    assumptions: tuple   # indices into Trace.assumptions: what decided it
    pinned: bool = False  # the trace fixed it to its value (a loop or a branch used it)


# ---- the per-capture value model ---------------------------------------------------------------

@dataclass
class DataValues:
    """Values for the tensors an assumption decides, and for the sizes they decide, in one capture.

    The Tape calls `before` for an op about to run (an `.item()` of a valued tensor is answered
    from its value) and `after` for each recorded op (values flow to its outputs; a new unbacked
    size gets its value).
    """

    sizes: Sizes
    shape_env: object
    assumptions: list = field(default_factory=list)        # Assumption
    data_sizes: list = field(default_factory=list)         # DataSize
    names: dict = field(default_factory=dict)              # unbacked sympy symbol -> name
    used: set = field(default_factory=set)                 # assumption indices that decided a size
    _sources: dict = field(default_factory=dict)           # (kind, where) -> assumption index
    _groups: dict = field(default_factory=dict)            # (op, where, value) -> name
    _taken: set = field(default_factory=set)
    _permutations: dict = field(default_factory=dict)      # assumption index -> where drawn
    _given: int = 0                                        # values set so far (`building`)
    _active: bool = False                                  # some tensor has values
    _deferred: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # _Deferred not yet run
    _counts: dict = field(default_factory=dict)   # source line -> [sizes.counts not yet taken]
    _calls: dict = field(default_factory=dict)    # source line -> counts taken so far
    _kinds: dict = field(default_factory=dict)             # op -> OpKind (see `op_kind`)
    routers = None   # the ops whose selections are routings (set below the class)

    def __post_init__(self):
        self._counts = self.sizes.counts_at()

    def counts_left(self) -> bool:
        """Whether sizes.counts holds sizes no call took yet (a second step's: then step 2 is
        traced with them, not repeated from step 1)."""
        return any(self._counts.values())

    @property
    def live(self) -> bool:
        """Whether ops other than a router's need a look (the Tape asks before each op)."""
        return self._active or self.shape_env is not None

    # ---- values on fake tensors --------------------------------------------------------------

    def value(self, t):
        """(real tensor, sources) of a fake tensor the capture knows the values of, else None.
        A value whose op was deferred (`_defer`) is computed now, once."""
        v = getattr(t, _ATTR, None)
        if v is None or not isinstance(v[0], _Lazy):
            return v
        real = v[0].real()
        if real is None:  # the op refused these values: no value, as if it had run at once
            delattr(t, _ATTR)
            return None
        v = (real, v[1])
        setattr(t, _ATTR, v)
        return v

    def read(self, t, how: str = "tolist"):
        """The values of a fake tensor the capture knows, read as `t.tolist()` / `t.numpy()`
        would (None if it has none); they then count as used by the step."""
        v = self.value(t)
        if v is None:
            return None
        self.used.update(v[1])
        with fake_mode_unset():  # called from inside the capture's fake mode
            return getattr(v[0], how)()

    def alias(self, src, dst) -> None:
        """`dst` is `src` again (autograd's copy of a saved tensor): the same values."""
        for attr in (_ATTR, _UNKNOWN):
            v = getattr(src, attr, None)
            if v is not None:
                setattr(dst, attr, v)

    def _set(self, t, real, sources) -> None:
        setattr(t, _ATTR, (real, sources))
        self._given += 1

    @contextmanager
    def building(self):
        """Small factories get values inside this block even before any tensor has one: code
        that builds state reads what it made (bitsandbytes' 8-bit optimizers compute their
        quantization maps with `linspace(...).tolist()` in `__init__`). After it, values stay
        on only if the block gave some."""
        active, given = self._active, self._given
        self._active = True
        try:
            yield
        finally:
            self._active = active or self._given > given

    def _drop(self, t) -> None:
        if hasattr(t, _ATTR):
            delattr(t, _ATTR)

    # ---- hooks the Tape calls -------------------------------------------------------------------

    def before(self, func, args, kwargs, kind: "OpKind | None" = None):
        """(True, result) for an op whose result is data (an `.item()`, `equal`) on valued
        tensors: the real result. Else (False, None). Reading a tensor marked unknown (a random
        draw no rule of `_DRAWS` gives a value, a meta buffer) raises UnknownValueRead. `kind`:
        `op_kind(func)`, where the caller keeps it."""
        kind = kind or self._kinds.get(func) or self.op_kind(func)
        if not kind.reads_data:
            return False, None
        tensors = [t for t in _leaves(args, kwargs) if isinstance(t, torch.Tensor)]
        self.check_known(func, tensors)
        if not tensors or any(self.value(t) is None for t in tensors):
            return False, None
        out, sources = self._run_real(func, args, kwargs, None if kind.returns_tensors else ())
        if out is None:
            return False, None
        for i in sources:  # which element a permutation put first is not known, only sizes
            if i in self._permutations:
                raise UnknownValueRead(func, Unknown("random", self._permutations[i]))
        self.used.update(sources)
        return True, out

    def after(self, func, args, kwargs, out, where, kind: "OpKind | None" = None) -> None:
        """Give the outputs of a recorded op their values and new unbacked sizes their values.
        `where()` names the user's source line (asked only when needed: it walks the stack).
        `kind`: `op_kind(func)`, where the caller keeps it (the Tape, with its own per-op
        answers: each lookup by an OpOverload hashes it in Python)."""
        kind = kind or self._kinds.get(func) or self.op_kind(func)
        if kind.router and self._route(func, args, kwargs, out, where):
            self._active = True
            return
        if kind.seeded:
            if self._active:  # x.uniform_(): whatever values x had are gone
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and _written(kind, t, args, kwargs):
                        self._drop(t)
            if self._draw(func, args, kwargs, out, where) \
                    or self._permutation(func, args, out, where) or self._mark_random(out, where):
                self._active = True  # a number the code may branch on
            return
        if not self._active and self.shape_env is None:
            return  # no tensor has values and no size can depend on them: nothing to do
        tensors = _tensors(args, kwargs.values()) if kwargs else _tensors(args)
        if tensors and self.shape_env is None and not kind.looked_at:
            # what the branches below decide for such an op (no input valued or unknown, no
            # symbolic size, no table names it: nothing), without their work: once an
            # optimizer's step counters have values every op of the step passes here. (A value
            # or mark is an entry of the tensor's __dict__, set and deleted by name: looked up
            # there, without getattr's miss of the class's attributes.)
            for t in tensors:
                held = t.__dict__
                if _ATTR in held or _UNKNOWN in held:
                    break
            else:
                return
        outs = [out] if isinstance(out, torch.Tensor) else \
            _tensors(out) if isinstance(out, (list, tuple)) else []
        unknown = None
        valued = []  # each tensor's (value, sources) as held (_held), None where it has none
        for t in tensors:
            held = t.__dict__
            if unknown is None:
                unknown = held.get(_UNKNOWN)
            valued.append(held.get(_ATTR))
        if unknown is not None:  # what a random draw (a meta buffer) computes is unknown too
            for o in outs:
                if o.numel() <= RANDOM_LIMIT:
                    setattr(o, _UNKNOWN, unknown)
        fresh = self._fresh_symbols(outs)
        all_valued = bool(tensors) and None not in valued
        if all_valued and not fresh and not kind.mutable:
            self._defer(func, args, kwargs, outs, valued)
        elif all_valued:
            if kind.mutable:
                self._run_deferred()  # what was deferred reads the values before this write
            real, sources = self._run_real(func, args, kwargs, outs)
            if real is not None:
                self._attach(outs, _flat_tensors(real), sources, func, where)
        elif func in _VALIDITY and outs and _small_factory(func, outs, VALUE_LIMIT) \
                and (fill := _VALIDITY[func][1](args)) is not None:
            # a check of values no one knows (`if torch.isnan(h).any():`, a distribution's
            # argument validation): the values a valid step has, named as an assumption
            assumed, _, detail = _VALIDITY[func]
            i = self._assumption(assumed, _short(where()) or "?", detail)
            with fake_mode_unset(), _one_thread():
                real = torch.full([self._int(s) for s in outs[0].shape], fill, dtype=torch.bool)
            self._set(outs[0], real, frozenset((i,)))
            self._active = True
        elif func in _STATISTICS and isinstance(out, torch.Tensor) and out.dim() == 0 \
                and out.is_floating_point():
            # a norm of values no one knows, as a number the step may read: Adafactor's
            # `max(eps, RMS(p))` with its defaults (scale_parameter) compares a parameter's RMS
            # with eps = 1e-3
            i = self._assumption("statistic", _short(where()) or "?", _STATISTIC)
            with fake_mode_unset():
                self._set(out, torch.ones((), dtype=out.dtype), frozenset((i,)))
            self._active = True
        elif func in _FINITE_CHECKS and self.value(args[1]) is not None:
            # GradScaler's check of the unscaled gradients writes found_inf only when one is
            # inf or nan: a step is assumed to have finite gradients (found_inf stays 0, the
            # optimizer steps), as a healthy step of a real run does
            detail = "the gradients are finite: GradScaler's found_inf stays 0 and it steps"
            i = self._assumption("finite gradients", where(), detail)
            real, sources = self.value(args[1])
            self._set(args[1], real, frozenset(sources) | {i})
        elif func in _OVERWRITES and _small_factory(func, [args[0]]):
            # x.fill_(v) / x.zero_() on a tensor with no values (`torch.empty(()).fill_(s)`, a
            # stride in torchvision's anchors): every element is written, so its values are known
            self._run_deferred()
            with fake_mode_unset(), _one_thread():
                real = torch.full([self._int(s) for s in args[0].shape], _OVERWRITES[func](args),
                                  dtype=args[0].dtype)
            self._set(args[0], real, frozenset())
            self._active = True
        elif func in _FILLS and outs and _small_factory(func, outs):
            fill = _FILLS[func](args, kwargs)  # ones_like(x): x's values do not matter
            # on one thread, as every value (_one_thread): a fill of more than one grain (32,768
            # elements) wakes the intra-op pool, ~3.6 ms CPU a fill on the 2-core machine, where
            # a symbolic llama profile fills 69 optimizer states (0.25 s)
            with fake_mode_unset(), _one_thread():
                real = torch.full([self._int(s) for s in outs[0].shape], fill, dtype=outs[0].dtype)
            self._set(outs[0], real, frozenset())
            self._active = True
        elif not tensors and outs and _small_factory(func, outs):
            real, sources = self._run_real(func, args, kwargs, outs)
            if real is not None:
                self._attach(outs, _flat_tensors(real), sources, func, where)
        else:
            for t, v in zip(tensors, valued):  # an in-place op with inputs we cannot follow
                if v is not None and _written(kind, t, args, kwargs):
                    self._drop(t)
        given = self._given_count(fresh, where)
        if given is not None:
            self._check_given(func, fresh, given, where)
        fresh = [s for s in fresh if s not in self.names]
        if fresh and given is not None:
            for sym in fresh:
                self._name(sym, given[1], func, where, frozenset((given[0],)))
        elif fresh:
            self._mask_sizes(func, args, kwargs, fresh, tensors, where)

    def op_kind(self, func) -> "OpKind":
        """What `before` and `after` ask of an op, answered once per op of the capture: each
        `func in table` hashes the OpOverload in Python and `func.tags` is a Python property
        (~1 us), and both run for every op once values are about."""
        tags = func.tags
        kind = self._kinds[func] = OpKind(
            reads_data=torch.Tag.data_dependent_output in tags,
            seeded=torch.Tag.nondeterministic_seeded in tags, router=func in _ROUTERS,
            looked_at=func in _LOOKED_AT, mutable=func._schema.is_mutable,
            returns_tensors=any("Tensor" in str(r.type) for r in func._schema.returns),
            writes=_writes(func))
        return kind

    def write(self, trace) -> None:
        """The data-dependent sizes as the trace's symbols: name -> symbol, hint, range, and a
        name pinned to one value where the trace specialised any of its symbols."""
        env = self.shape_env
        trace.unbacked = dict(self.names)
        # a random draw no branch read (a dropout mask), a norm nothing read, assumed nothing
        kept = [i for i, a in enumerate(self.assumptions)
                if a.kind not in _NAMED_IF_READ or i in self.used]
        index = {i: n for n, i in enumerate(kept)}
        trace.assumptions = [replace(self.assumptions[i], decided=i in self.used) for i in kept]
        trace.data_sizes = [replace(d, assumptions=tuple(index[i] for i in d.assumptions))
                            for d in self.data_sizes]
        for d in self.data_sizes:
            members = [s for s, n in self.names.items() if n == d.name]
            trace.symbols.setdefault(d.name, members[0])
            trace.hints[d.name] = d.value
            for s in members:
                r = env.replacements.get(s)
                if r is not None and getattr(r, "is_Integer", False):
                    trace.replacements[d.name] = r
            vr = env.var_to_range.get(members[0])
            lo = int(vr.lower) if vr is not None and vr.lower.is_Integer else 0
            trace.ranges[d.name] = (lo, None)
        trace.data_sizes = [replace(d, pinned=d.name in trace.replacements)
                            for d in trace.data_sizes]

    def give_literal(self, fake, real) -> None:
        """`torch.tensor(data)` made in the step from Python data: an integer or boolean one
        keeps its values (a mask computed with numpy, a list of ids)."""
        if real.is_complex() or real.numel() > VALUE_LIMIT:
            return
        with fake_mode_unset():  # (an optimizer's step counters: one literal per parameter)
            value = real.detach().clone()
        self._set(fake, value, frozenset())
        self._active = True

    def give_input(self, fake, real, name: str) -> None:
        """An input the user gave as a real integer tensor (labels, token ids) keeps its values:
        the real step reads them (a `labels.max()` check, the targets a CTC loss selects)."""
        if real.numel() > VALUE_LIMIT:
            return
        shape = "x".join(str(s) for s in real.shape)
        a = self._assumption("input", name, f"the values of {name} ({str(real.dtype)[6:]} "
                                            f"{shape}) as given")
        with fake_mode_unset():  # called inside the capture's fake mode
            value = real.detach().cpu().clone()
        self._set(fake, value, frozenset((a,)))
        self._active = True

    def give_constant(self, fake, t, name: str | None) -> None:
        """A small tensor the model holds (a buffer: Encodec's padding,
        BatchNorm's batch count) keeps its values: the real step computes with them. One on the
        meta device keeps the value its build made (build_values.py), else it is marked
        unknown: a read of it then names it."""
        if t.is_complex() or t.numel() > CONSTANT_LIMIT or isinstance(t, FakeTensor) \
                or isinstance(t, torch.nn.Parameter) or t.requires_grad:
            return  # a parameter is trained, not a constant
        real = build_value(t) if t.device.type == "meta" else t
        self._active = True
        if real is None:
            what = f"buffer '{name}'" if name else "a tensor attribute of a module"
            shape = "x".join(str(n) for n in t.shape) or "scalar"
            setattr(fake, _UNKNOWN, Unknown("meta", f"{what} ({str(t.dtype)[6:]} {shape})"))
            return
        with fake_mode_unset():  # called inside the capture's fake mode
            value = real.detach().to("cpu", copy=True)
        self._set(fake, value, frozenset())

    def check_known(self, func, tensors) -> None:
        """Raise UnknownValueRead if `func` reads one of `tensors` whose values no one knows."""
        for t in tensors:
            unknown = getattr(t, _UNKNOWN, None)
            if unknown is not None and self.value(t) is None:
                raise UnknownValueRead(func, unknown)

    def _draw(self, func, args, kwargs, out, where) -> bool:
        """A small random draw `_DRAWS` knows: its median (see the module docstring)."""
        rule = _DRAWS.get(func)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if rule is None or len(outs) != 1 or not _static_small(outs, RANDOM_LIMIT):
            return False
        o = outs[0]
        with fake_mode_unset():  # called inside the capture's fake mode
            median = rule(args, kwargs, self.value)
            if median is None:
                return False
            if isinstance(median, torch.Tensor):  # per element: the likelier outcome
                real, median = median.to(o.dtype).expand(o.shape).clone(), "the likelier outcome"
            else:
                real, median = torch.full(list(o.shape), median, dtype=o.dtype), f"{median:g}"
        op = func.name().split("::")[-1].split(".")[0].rstrip("_")
        a = self._assumption("random", _short(where()) or "?",
                             f"{op} draws taken at their median ({median}): a branch on a draw "
                             f"takes its likelier side (LayerDrop, stochastic depth with a drop "
                             f"probability below 1/2: no layer dropped, the memory-worst case)")
        self._set(o, real, frozenset((a,)))
        if hasattr(o, _UNKNOWN):
            delattr(o, _UNKNOWN)
        return True

    def _permutation(self, func, args, out, where) -> bool:
        """randperm(n) taken as the identity: what a sampler selects with `perm[:k]` (which of
        torchvision's positive anchors) has the same sizes under every permutation."""
        if func not in _PERMUTATIONS or not isinstance(out, torch.Tensor):
            return False
        n = self._int(args[0])
        if n is None or n > VALUE_LIMIT:
            return False
        with fake_mode_unset():  # called inside the capture's fake mode
            real = torch.arange(n, dtype=out.dtype)
        w = _short(where()) or "?"
        a = self._assumption("random", w, "randperm taken as the identity permutation: the "
                             "sizes of what it selects are the same under every permutation (a "
                             "read of its values, as a number, stops)")
        self._permutations[a] = w
        self._set(out, real, frozenset((a,)))
        return True

    def _mark_random(self, out, where) -> bool:
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not outs or not _static_small(outs, RANDOM_LIMIT):
            return False  # a dropout mask, not a number the code decides on
        w = where()
        for o in outs:
            self._drop(o)
            setattr(o, _UNKNOWN, Unknown("random", _short(w) or "?"))
        return True

    # ---- routing ----------------------------------------------------------------------------------

    def _route(self, func, args, kwargs, out, where) -> bool:
        src = args[0]
        if not src.is_floating_point() or self.value(src) is not None:
            return False  # scores the step knows (a detector's box overlaps) select by value
        index_pos, k, dim = _ROUTERS[func](args, kwargs)
        idx = out[index_pos] if isinstance(out, (tuple, list)) else out
        if not isinstance(idx, torch.Tensor) or idx.numel() == 0 or idx.numel() > VALUE_LIMIT:
            return False
        dim = dim % max(src.dim(), 1)
        experts = self._int(src.shape[dim])
        shape = [self._int(s) for s in idx.shape]
        if None in shape or experts is None:
            return False
        tokens = prod(shape) // k if k else 0  # shape: ints (an unbacked size at its value)
        if k >= experts or tokens == 0:
            return False  # selecting every candidate (a sort) routes nothing
        routing = self.sizes.routing
        real = routing_indices(tokens, k, experts, routing)  # (tokens, k)
        if idx.dim() == src.dim():  # the chosen experts along `dim`
            rest = shape[:dim] + shape[dim + 1:]
            real = real.reshape(rest + [k]).movedim(-1, dim).contiguous()
        else:  # argmax without keepdim
            real = real.reshape(shape)
        counts = expert_counts(tokens, k, experts, routing)
        detail = (f"{self.sizes.describe_routing()} routing: {tokens} tokens x top-{k} over "
                  f"{experts} experts -> {_counts_text(counts)} per expert")
        a = self._assumption("routing", _short(where()) or "?", detail)
        self._set(idx, real, frozenset((a,)))
        return True

    def assume(self, kind: str, where: str, detail: str) -> None:
        """Record an assumption a rule made about values it could not know (a matrix's norm),
        named in the report as deciding this step."""
        self.used.add(self._assumption(kind, where, detail))

    def _assumption(self, kind, where, detail) -> int:
        key = (kind, where, detail)
        i = self._sources.get(key)
        if i is None:
            i = self._sources[key] = len(self.assumptions)
            self.assumptions.append(Assumption(kind, where, detail))
        return i

    # ---- running ops on values --------------------------------------------------------------------

    def _run_real(self, func, args, kwargs, outs=None):
        """func on the values (CPU tensors) of its tensor arguments: (result, sources), or
        (None, ...) if an argument has no concrete value or the op refuses. `outs`: the op's
        fake output tensors, () for an op that returns none, None where not known (with the
        values' sizes they say whether the op needs the thread setting, `_on_values`)."""
        if not kwargs:
            flat = self._flat_values(args)
            if flat is not None:  # tensors and plain numbers only: no closure, no mapping
                rargs, sources, elements = flat
                if rargs is None:  # an argument without a value: the op has none either
                    return None, sources
                return self._run_on_values(func, rargs, {}, sources, elements, outs)
        sources: set = set()
        elements = [0]  # the most elements of a value read

        def real(x):
            v = self.value(x)  # (a deferred value is computed here)
            if v is None:
                raise LookupError
            n = v[0].numel()
            if n > VALUE_LIMIT:
                raise LookupError
            if n > elements[0]:
                elements[0] = n
            sources.update(v[1])
            return v[0]

        try:
            rargs, rkwargs = _as_values(args, kwargs, real, self._int)
        except LookupError:  # an argument without a value: the op has none either
            return None, sources
        return self._run_on_values(func, rargs, rkwargs, sources, elements[0], outs)

    def _flat_values(self, args):
        """`_run_real`'s conversion of arguments that are all tensors and plain numbers (an
        optimizer's step counter: `step += 1`, `.item()`; ~700 ops a GPT-2 profile): (values,
        sources, most elements read), with values None where a tensor has none or too many
        elements; None for any other argument (a list, a device, a SymInt: `_as_values`). The
        same conversion `_as_values` makes of such arguments, without its two closures and
        mapping, ~3 us an op."""
        for a in args:
            if not isinstance(a, torch.Tensor) and type(a) not in _PLAIN_NUMBERS:
                return None
        rargs, sources, elements = [], set(), 0
        for a in args:
            if isinstance(a, torch.Tensor):
                v = self.value(a)  # (a deferred value is computed here)
                if v is None:
                    return None, sources, elements
                n = v[0].numel()
                if n > VALUE_LIMIT:
                    return None, sources, elements
                if n > elements:
                    elements = n
                sources.update(v[1])
                a = v[0]
            rargs.append(a)
        return rargs, sources, elements

    @staticmethod
    def _run_on_values(func, rargs, rkwargs, sources, elements, outs):
        # an op on single elements (an optimizer's step counter: `step += 1`, `.item()`) leaves
        # the thread setting alone (_on_values); one whose outputs are not known may be large
        single = elements <= 1 and outs is not None and _at_most_one_element(outs)
        try:
            with _on_values(threads=not single):
                return func(*rargs, **rkwargs), frozenset(sources)
        except Exception:  # noqa: BLE001 - an op the values cannot run: no value, the trace goes on
            return None, sources

    def _defer(self, func, args, kwargs, outs, valued) -> None:
        """Give the outputs of a pure op on valued tensors values computed when first read.

        Most values are never read: a rope's positions, cosines and sines (12 ops, 8192 x 64
        elements each, per layer of a 405B model) only reach ops on fake activations, and
        computed at once they held 1 GiB of a 126-layer rank's capture. An op is deferred only
        when nothing needs its real outputs now: it makes no new data-dependent size (those are
        named from the real shapes at once) and writes no argument. A write to a valued tensor
        first runs every op still deferred (`_run_deferred`), so each reads its inputs as they
        were when the step ran it: the values are the ones running each op at once gives."""
        if not outs:
            return  # a pure op that makes no tensor: nothing to give a value
        try:
            dargs, dkwargs = _as_values(args, kwargs, lambda t: _held(t)[0], self._int)
        except LookupError:  # a size the values cannot give: no value, as _run_real decides
            return
        depth = 1 + max((x.op.depth for x in tree_flatten((dargs, dkwargs))[0]
                         if isinstance(x, _Lazy)), default=0)
        op = _Deferred(func, dargs, dkwargs, tuple(o.dim() for o in outs), depth)
        sources = frozenset().union(*(v[1] for v in valued))
        for i, o in enumerate(outs):
            self._set(o, _Lazy(op, i), sources)
        if depth >= _MAX_DEPTH:
            op.run()  # computing a value walks its deferred inputs: keep that walk short
        else:
            self._deferred.add(op)

    def _run_deferred(self) -> None:
        """Run every op still deferred (before a write to a value: see `_defer`)."""
        if not self._deferred:  # (a WeakSet's iteration costs ~5 us: an empty one's length ~1)
            return
        for op in list(self._deferred):
            op.run()
        self._deferred.clear()

    def _attach(self, outs, reals, sources, func, where) -> None:
        if len(outs) != len(reals):
            return
        for t, r in zip(outs, reals):
            if t.dim() != r.dim():
                continue
            for s, rs in zip(t.shape, r.shape):
                self._bind(s, rs, func, where, sources)
            self._set(t, r, sources)

    def _int(self, s):
        """A size as an int: its value, or the value the assumption gave it (None if neither)."""
        if isinstance(s, int):
            return s
        env = self.shape_env
        if env is None:
            return None
        e = s.node.expr.xreplace(env.backed_var_to_val).xreplace(env.real_tensor_prop_unbacked_vals)
        return int(e) if e.is_number else None

    def _bind(self, s, value, func, where, sources) -> None:
        if isinstance(s, int):
            return
        expr = s.node.expr
        if not expr.is_Symbol or expr in self.names or expr not in free_unbacked_symbols(s):
            return
        self._name(expr, int(value), func, where, sources)

    def _name(self, sym, value, func, where, sources) -> None:
        self.shape_env.set_real_tensor_prop_unbacked_vals(sym, value)
        w = where()
        where_text = str(_short(w)) if w is not None else "?"
        key = (func.name(), where_text, value)
        name = self._groups.get(key)
        if name is None:
            base = _symbol_name(func, w)
            name, n = base, 1
            while name in self._taken:
                n += 1
                name = f"{base}_{n}"
            self._taken.add(name)
            self._groups[key] = name
            self.data_sizes.append(DataSize(name, value, str(func), where_text,
                                            tuple(sorted(sources))))
        self.names[sym] = name
        self.used.update(sources)

    # ---- sizes given per source line (sizes.counts) ---------------------------------------------

    def _given_count(self, fresh, where):
        """(assumption index, size) the counts give the call of a data-dependent op (one that
        made new unbacked sizes) at this line, or None (no counts, none left)."""
        if not fresh or not self._counts:
            return None
        line = _short(where()) or "?"
        left = self._counts.get(line)
        if not left:
            return None
        n = self._calls[line] = self._calls.get(line, 0) + 1
        value = left.pop(0)
        a = self._assumption("counts", line, f"the sizes given for this line (sizes counts=): "
                                             f"{', '.join(map(str, self.sizes.counts_at()[line]))}")
        return a, value

    def _check_given(self, func, fresh, given, where) -> None:
        """A size the values decided must be the one given for the call: else the counts and
        the step do not line up (another step's counts, a list in another order)."""
        for sym in fresh:
            name = self.names.get(sym)
            if name is None:
                continue
            decided = next(d.value for d in self.data_sizes if d.name == name)
            if decided != given[1]:
                line = _short(where()) or "?"
                raise TapescopeError(
                    f"sizes counts for {line} give {given[1]} at call {self._calls[line]} of "
                    f"{func}, but the step's values decide {decided} there: the counts do not "
                    f"follow this step's calls (record them from the same step: "
                    f"tapescope.validate.data_sizes)")
            self.used.add(given[0])

    # ---- masks no routing decided -----------------------------------------------------------------

    def _fresh_symbols(self, outs) -> list:
        if self.shape_env is None:
            return []
        syms = []
        for t in outs:
            for s in t.shape:
                if not isinstance(s, int):
                    syms.extend(x for x in free_unbacked_symbols(s) if x not in self.names)
        return list(dict.fromkeys(syms))

    def _mask_sizes(self, func, args, kwargs, fresh, tensors, where) -> None:
        """A new unbacked size no value decided: a valued boolean mask among the inputs decides
        it (x[mask]); else the assumed mask fraction of the input's elements; else stop."""
        masks = [t for t in tensors if t.dtype == torch.bool and self.value(t) is not None]
        if len(fresh) == 1 and len(masks) == 1:
            real, sources = self.value(masks[0])
            self._name(fresh[0], int(real.sum()), func, where, sources)
            return
        fraction = self.sizes.mask
        w = where()
        if fraction is None or not tensors:
            # torch's own error for it: the capture names the op, module and line, and the fix
            raise DynamicOutputShapeException(func)
        candidates = _CANDIDATES.get(func.name())
        if candidates is not None:  # an op that keeps some of its candidates (NMS's boxes)
            numel, noun = self._int(candidates[0](args)) or 0, candidates[1]
            what = f"{func.name().split('::')[-1]} keeps {fraction:.0%} of its {numel} {noun}"
        else:
            bools = [t for t in tensors if t.dtype == torch.bool]
            numel = 1  # of the mask (x[mask], masked_select), else of the input (nonzero(x))
            for s in (bools or tensors)[0].shape:
                numel *= self._int(s) or 0
            what = f"a boolean mask keeps {fraction:.0%} of its {numel} elements"
        a = self._assumption("mask", str(_short(w) if w else "?"), what)
        for sym in fresh:
            self._name(sym, int(round(fraction * numel)), func, where, frozenset((a,)))


# ops of libraries that keep some of their candidates, where the candidates are not the
# elements of an input: op name -> (args -> how many candidates, what they are). torchvision's
# nms(boxes (N, 4), scores (N,), iou) keeps at most N boxes, not 4N.
_CANDIDATES = {
    "torchvision::nms": (lambda args: args[0].shape[0], "boxes"),
}
@dataclass(frozen=True, slots=True)
class OpKind:
    """What DataValues asks of an op (DataValues.op_kind)."""

    reads_data: bool  # its result is data (`.item()`, `equal`): Tag.data_dependent_output
    seeded: bool      # a random op: Tag.nondeterministic_seeded
    router: bool      # its selections may be a routing (_ROUTERS)
    looked_at: bool   # a table of `after`'s branches names it (_LOOKED_AT)
    mutable: bool     # it writes an argument (schema)
    returns_tensors: bool  # a tensor among its results (schema: Tensor, Tensor[], Tensor?)
    writes: tuple     # (position, name) of each argument it writes (`_written`)


@dataclass(frozen=True)
class Unknown:
    """Why a small tensor has no values: a random draw (`source`: where it was drawn) or a
    buffer on the meta device (`source`: which)."""

    kind: str      # "random" or "meta"
    source: str


_MAX_DEPTH = 64  # deferred ops in a chain before one is run (see _defer)
# arguments `_as_values` leaves as they are (not a tensor, device, SymInt or container)
_PLAIN_NUMBERS = frozenset((int, float, bool, complex, type(None)))


def _as_values(args, kwargs, value, size):
    """An op's arguments as its values run it: each tensor by `value(t)`, each SymInt by
    `size(s)`, devices the CPU and memory not pinned (the values are CPU tensors). Raises
    LookupError where `value` does or `size` gives None. Shared by the ops run at once
    (`DataValues._run_real`) and the deferred ones (`DataValues._defer`), so that both run an op
    on the same arguments."""
    def convert(x):
        if isinstance(x, torch.Tensor):
            return value(x)
        if isinstance(x, torch.device):
            return _CPU
        if isinstance(x, torch.SymInt):
            c = size(x)
            if c is None:
                raise LookupError
            return c
        return x

    try:
        vargs = tuple([_map_one_level(convert, a) for a in args])
        vkwargs = {k: _map_one_level(convert, v) for k, v in kwargs.items()}
    except _Deeper:
        vargs, vkwargs = tree_map(convert, (args, kwargs))
    if "device" in vkwargs:
        vkwargs["device"] = _CPU
    if "pin_memory" in vkwargs:
        vkwargs["pin_memory"] = False
    return vargs, vkwargs


def _held(t):
    """A fake tensor's (value, sources) as held: the value may be a _Lazy (not computed)."""
    return getattr(t, _ATTR, None)


class _Deferred:
    """A pure op on values, run when one of its outputs' values is read (DataValues._defer).
    Its arguments hold the values of its tensor arguments (real tensors, or _Lazy)."""

    __slots__ = ("func", "args", "kwargs", "dims", "depth", "reals", "__weakref__")

    def __init__(self, func, args, kwargs, dims, depth):
        self.func, self.args, self.kwargs, self.dims, self.depth = func, args, kwargs, dims, depth
        self.reals = None

    def run(self) -> list:
        """The real outputs (None for one the values cannot give), computed once, as
        DataValues._run_real and _attach would have at the op."""
        if self.reals is not None:
            return self.reals
        self.reals = [None] * len(self.dims)

        def real(x):
            if isinstance(x, _Lazy):
                x = x.real()
                if x is None:
                    raise LookupError
            if isinstance(x, torch.Tensor) and x.numel() > VALUE_LIMIT:
                raise LookupError
            return x

        try:
            rargs, rkwargs = tree_map(real, (self.args, self.kwargs))
            with _on_values():
                out = self.func(*rargs, **rkwargs)
        except Exception:  # noqa: BLE001 - an op the values cannot run: no value (_run_real)
            out = None
        reals = [r for r in tree_flatten(out)[0] if isinstance(r, torch.Tensor)]
        if len(reals) == len(self.dims):
            self.reals = [r if r.dim() == d else None for r, d in zip(reals, self.dims)]
        self.func = self.args = self.kwargs = None  # its inputs' values may go
        return self.reals


class _Lazy:
    """Output `index` of a deferred op: the value of a fake tensor, computed when read."""

    __slots__ = ("op", "index")

    def __init__(self, op: _Deferred, index: int):
        self.op, self.index = op, index

    def real(self):
        return self.op.run()[self.index]


# ---- random draws taken at their median -----------------------------------------------------------
# each: (args, kwargs, value_of) -> the median (a number, or a tensor of per-element likelier
# outcomes), or None where it is not known

def _arg(args, kwargs, i, name, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _mid(args, kwargs):
    return (_arg(args, kwargs, 1, "from", 0.0) + _arg(args, kwargs, 2, "to", 1.0)) / 2


def _likelier(p):
    return 1 if p >= 0.5 else 0


def _bernoulli_tensor(args, kwargs, value_of):
    v = value_of(args[0])  # per-element probabilities the step knows
    return None if v is None else (v[0] >= 0.5)


_DRAWS = {
    aten.rand.default: lambda a, k, v: 0.5,
    aten.rand.generator: lambda a, k, v: 0.5,
    aten.rand_like.default: lambda a, k, v: 0.5,
    aten.uniform_.default: lambda a, k, v: _mid(a, k),
    aten.uniform.default: lambda a, k, v: _mid(a, k),
    aten.randn.default: lambda a, k, v: 0.0,
    aten.randn.generator: lambda a, k, v: 0.0,
    aten.randn_like.default: lambda a, k, v: 0.0,
    aten.normal_.default: lambda a, k, v: _arg(a, k, 1, "mean", 0.0),
    aten.bernoulli_.float: lambda a, k, v: _likelier(_arg(a, k, 1, "p", 0.5)),
    aten.bernoulli.p: lambda a, k, v: _likelier(_arg(a, k, 1, "p", 0.5)),
    aten.bernoulli.default: _bernoulli_tensor,
    aten.randint.low: lambda a, k, v: (_arg(a, k, 0, "low", 0) + _arg(a, k, 1, "high", 1) - 1) // 2,
    aten.randint.default: lambda a, k, v: (_arg(a, k, 0, "high", 1) - 1) // 2,
}


# ---- which ops route, which are small factories -------------------------------------------------

def _topk(args, kwargs):
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return 1, int(k), dim


def _argmax(args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return 0, 1, -1 if dim is None else dim


def _max_dim(args, kwargs):
    return 1, 1, args[1] if len(args) > 1 else kwargs["dim"]


_ROUTERS = {aten.topk.default: _topk, aten.argmax.default: _argmax, aten.max.dim: _max_dim}
DataValues.routers = frozenset(_ROUTERS)


# factories that take a tensor for its shape only, and the value they fill with
# ops that write a flag only when a value is not finite (GradScaler's unscale)
_FINITE_CHECKS = {aten._amp_foreach_non_finite_check_and_unscale_.default}

_PERMUTATIONS = (aten.randperm.default, aten.randperm.generator)

# checks a valid step passes, on values no one knows: op -> (assumption kind, each element's
# value, what is assumed). The non-finite tests are false for finite values; `_is_all_true` is
# torch's assertion primitive (torch.distributions' argument and sample validation,
# torch._check_tensor_all): a step that runs on passes it.
_FINITE = "the values are finite (isnan / isinf false, isfinite true): the branch a valid step takes"
_INF = float("inf")
_VALIDITY = {  # op -> (kind, args -> each element's value or None where the rule does not apply,
    #                   what is assumed)
    aten.isnan.default: ("finite values", lambda a: False, _FINITE),
    aten.isinf.default: ("finite values", lambda a: False, _FINITE),
    aten.isposinf.default: ("finite values", lambda a: False, _FINITE),
    aten.isneginf.default: ("finite values", lambda a: False, _FINITE),
    aten.isfinite.default: ("finite values", lambda a: True, _FINITE),
    # torch.isfinite decomposes to `(x == x) * (x.abs() != inf)`; constraints.real checks x == x
    aten.eq.Tensor: ("finite values", lambda a: True if a[0] is a[1] else None, _FINITE),
    aten.ne.Tensor: ("finite values", lambda a: False if a[0] is a[1] else None, _FINITE),
    aten.ne.Scalar: ("finite values", lambda a: True if a[1] in (_INF, -_INF) else None, _FINITE),
    aten.eq.Scalar: ("finite values", lambda a: False if a[1] in (_INF, -_INF) else None, _FINITE),
    aten._is_all_true.default: ("validation", lambda a: True, "a validation check passes "
                                "(torch.distributions' argument checks, torch._check_tensor_all):"
                                " the step is valid; validate_args=False skips the check"),
}

# a norm (of a parameter, a gradient, optimizer state) whose input has no values: taken as 1.0
_STATISTICS = (aten.linalg_vector_norm.default,)
_STATISTIC = ("a norm of values no one knows (a parameter's RMS, a gradient norm) is taken as 1: "
              "a comparison with a small threshold (Adafactor's max(eps, RMS)) takes the side of "
              "a parameter that is not all zeros")
# assumptions named in the report only where the step read a value they gave
_NAMED_IF_READ = ("random", "statistic", "finite values", "validation")

# in-place writes of one number to every element (of a tensor whose values were unknown)
_OVERWRITES = {aten.fill_.Scalar: lambda a: a[1], aten.zero_.default: lambda a: 0}

_FILLS = {aten.ones_like.default: lambda a, k: 1, aten.zeros_like.default: lambda a, k: 0,
          aten.full_like.default: lambda a, k: a[1], aten.new_ones.default: lambda a, k: 1,
          aten.new_zeros.default: lambda a, k: 0, aten.new_full.default: lambda a, k: a[2]}
# every op a branch of `DataValues.after` names by table (its fast path skips the others)
_LOOKED_AT = frozenset().union(_VALIDITY, _STATISTICS, _FINITE_CHECKS, _OVERWRITES, _FILLS)


def _small_factory(func, outs, limit: int = FACTORY_LIMIT) -> bool:
    """A small tensor made from no data (arange(E), full((S, S), -inf)): its values are known."""
    if func in (aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default):
        return False  # no values to give
    n = 0
    for o in outs:
        for s in o.shape:
            if not isinstance(s, int):
                return False
        n += o.numel()
    return n <= limit


def _at_most_one_element(outs) -> bool:
    """Whether every tensor has static sizes and at most one element (a symbolic size is not
    compared: that would add a guard)."""
    for o in outs:
        for s in o.shape:
            if not isinstance(s, int) or s > 1:
                return False
    return True


def _static_small(outs, limit) -> bool:
    """Whether tensors have static shapes and at most `limit` elements in all."""
    return not any(isinstance(s, torch.SymInt) for o in outs for s in o.shape) \
        and sum(o.numel() for o in outs) <= limit


class _Deeper(Exception):
    """An argument nested deeper than aten's lists of tensors or sizes: walk it with pytree."""


def _map_one_level(convert, x):
    """tree_map(convert, x) for an aten argument: a leaf, or a list or tuple of leaves. Written
    out because pytree's walk cost ~0.2 ms an op here, and an optimizer's step counters (values:
    `step_t += 1`, `step_t.item()` for each parameter, each step) run hundreds of ops on values
    a profile. Raises _Deeper for anything pytree would open further, so the result is always
    tree_map's."""
    kind = type(x)
    if kind is list or kind is tuple:
        for y in x:
            if type(y) in pytree_node_types or isinstance(y, tuple):
                raise _Deeper
        return kind(convert(y) for y in x)
    if kind in pytree_node_types or isinstance(x, tuple):
        raise _Deeper
    return convert(x)


def _leaves(args, kwargs) -> list:
    """tree_flatten((args, kwargs))[0] for an aten op's arguments, one level deep when that is
    all there is (as `_map_one_level`)."""
    leaves = []
    for group in (args, kwargs.values()):
        for x in group:
            kind = type(x)
            for y in (x if kind is list or kind is tuple else (x,)):
                if type(y) in pytree_node_types or isinstance(y, tuple):
                    return tree_flatten((args, kwargs))[0]
                leaves.append(y)
    return leaves


def _flat_tensors(out) -> list:
    """The tensors of an op's result, as `tree_flatten(out)` lists them: a tensor, or a list or
    tuple of tensors and other leaves without pytree's walk; pytree for anything deeper."""
    if isinstance(out, torch.Tensor):
        return [out]
    kind = type(out)
    if (kind is list or kind is tuple) and not any(
            type(y) in pytree_node_types or isinstance(y, tuple) for y in out):
        return [y for y in out if isinstance(y, torch.Tensor)]
    return [r for r in tree_flatten(out)[0] if isinstance(r, torch.Tensor)]


def _tensors(*groups) -> list:
    """The tensors among op arguments (lists of tensors one level deep, as aten takes them):
    cheaper than a pytree walk, and this runs for every op once values are about."""
    out = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif type(a) in (list, tuple):
                out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _written(kind: OpKind, t, args, kwargs) -> bool:
    """Whether the op writes `t` (an argument its schema marks written: `Tensor(a!)`)."""
    for i, name in kind.writes:
        a = args[i] if i < len(args) else kwargs.get(name)
        if a is t:
            return True
    return False


def _writes(func) -> tuple:
    """(position, name) of each argument `func`'s schema marks written."""
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


def _counts_text(counts: list) -> str:
    distinct = sorted(set(counts), reverse=True)
    if len(distinct) == 1:
        return str(distinct[0])
    return ", ".join(str(c) for c in counts)


def _short(frame):
    if frame is None:
        return None
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def _symbol_name(func, frame) -> str:
    op = func.name().split("::")[-1].strip("_")
    if frame is None:
        return op
    stem = os.path.splitext(os.path.basename(frame.filename))[0]
    return f"{op}_{stem}_{frame.lineno}"


class _one_thread:
    """Values are small (at most VALUE_LIMIT elements) and computed one op at a time between
    fake ops: on torch's intra-op thread pool each op wakes the pool's other threads, which then
    spin waiting for more work (OpenMP's wait policy) while the capture goes on in Python. In a
    distributed capture (a DTensor mask's literal turns values on) that spinning was 5 s of the
    18.5 s CPU of a 70B rank, on a rope's positions alone. One thread computes the same integer
    and boolean values (what code branches on); a float reduction over more than one grain of
    elements may round differently, as it does between machines with other thread counts. The
    caller's setting is restored at once. (A class, not a generator context: entered for each
    op run on values, ~700 a GPT-2 profile.)"""

    __slots__ = ("threads",)

    def __enter__(self) -> None:
        self.threads = threads = torch.get_num_threads()
        if threads != 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        if self.threads != 1:
            torch.set_num_threads(self.threads)


class _on_values:
    """Where an op runs on values: no fake mode (they are real CPU tensors), no autograd, one
    intra-op thread (`_one_thread`). One class-based context for the three generator contexts
    this took (unset_fake_temporarily, torch.no_grad, _one_thread: ~7 us an op, ~700 ops a GPT-2
    profile, whose optimizer step counters have values); grad mode is switched only where it
    is on (an optimizer step runs under no_grad)."""

    __slots__ = ("fake", "grad", "threads")

    def __init__(self, threads: bool = True):
        # False for an op that reads and writes at most one element: ATen's parallel loops run
        # inline below two iterations (at::parallel_for: `numiter > 1`), and one element's
        # value cannot depend on how many threads could have split it
        self.threads = _one_thread() if threads else None

    def __enter__(self) -> None:
        self.fake = fake = fake_mode_unset()
        fake.__enter__()
        self.grad = grad = torch.is_grad_enabled()
        if grad:
            torch.set_grad_enabled(False)
        if self.threads is not None:
            self.threads.__enter__()

    def __exit__(self, *exc) -> None:
        if self.threads is not None:
            self.threads.__exit__()
        if self.grad:
            torch.set_grad_enabled(True)
        self.fake.__exit__()
