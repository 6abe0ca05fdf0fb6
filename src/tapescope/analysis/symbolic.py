"""Memory and FLOPs as formulas of the named dimensions (batch, seq), from one symbolic trace.

The capture ran with PyTorch's ShapeEnv: every size that depends on a named input dimension is a
SymInt, so every storage size and every op's shapes in the trace are expressions. Here they become
sympy polynomials in the dimension names, and:
- FLOPs per phase are sums of the ops' formulas, exact;
- live bytes after each allocation are sums of storage sizes, exact; the peak is the largest of them,
  which depends on the sizes, so we keep the allocations that can be the peak for some sizes (the
  "pieces": one live-bytes polynomial each, with the op that reached it) and drop every one that
  another bounds from above on the whole domain (checked on the polynomial's coefficients after
  shifting each variable by its lower bound, which proves p >= q for all sizes, not just sampled ones);
- a size that rounds (a kernel's workspace rounded up to a tile: `16384*((seq + 127)//128)`) is a
  piecewise polynomial: each floor division, modulo, max or min becomes one more variable (`_Aux`),
  computed exactly from the dimensions at every size, and bounded below by its value at the
  dimensions' lower bounds (it grows with them), which keeps the coefficient proof sound;
- `at(batch=..., seq=...)` evaluates the pieces, a few multiplications each, so a thousand sizes
  take milliseconds.
The formulas hold where the trace's guards hold: the ranges ShapeEnv recorded (sizes >= 2, and any
bound the model checks, like seq <= block_size). A guard that pins a dimension to one value
(specialisation) makes them hold at that value only; `at()` then traces each size concretely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import sympy

from fractions import Fraction

from ..capture.records import CATEGORIES, StorageRecord, TensorRef, Trace
from .events import device_events, initially_live
from .flops import op_flops
from .memory import storage_categories
from .steps import StepView, step_views

__all__ = ["NotPolynomial", "converter", "Guard", "Piece", "Estimate", "SymbolicProfile", "symbolic_profile", "sympify_trace",
           "instantiate", "fit_pinned"]


@dataclass(frozen=True)
class Guard:
    expr: str     # in the dimension names, e.g. "seq <= 1024"
    where: str    # the source line that asked
    pins: str | None = None  # the dimension this guard fixes to one value, if it does


@dataclass(frozen=True)
class _Aux:
    """A rounding function of the dimensions, treated as one more variable of the polynomials:
    `kind` applied to `args` (polynomials in the variables before it) and `divisor`."""

    symbol: sympy.Symbol
    expr: sympy.Expr     # the same in the dimension names, for the formulas shown
    kind: str            # "floordiv", "mod", "max", "min"
    args: tuple          # polynomials
    divisor: int | None = None
    low: int = 0         # its value where every dimension is at its lower bound

    def value(self, vals: tuple) -> int:
        a = [_eval_exact(p, vals) for p in self.args]
        if self.kind == "floordiv":
            return math.floor(a[0] / self.divisor)
        if self.kind == "mod":
            return int(a[0] - self.divisor * math.floor(a[0] / self.divisor))
        return int((max if self.kind == "max" else min)(a))


def _extend(aux: tuple, vals: tuple) -> tuple:
    """The dimensions' values followed by each rounding variable's (in order: each reads only
    the ones before it)."""
    for a in aux:
        vals = vals + (a.value(vals),)
    return vals


@dataclass
class Piece:
    """One allocation whose live bytes can be the step's peak for some sizes."""

    bytes: dict          # polynomial: exponent tuple -> coefficient
    op: int              # index of the op (in the step) that made the allocation
    categories: dict     # category -> polynomial


@dataclass(frozen=True)
class Estimate:
    sizes: dict
    peak_bytes: int
    first_step_peak_bytes: int
    flops: dict
    at_peak: dict        # category -> bytes, at the steady-state peak
    peak_op: int | None = None


@dataclass
class SymbolicProfile:
    names: tuple                 # dimension names, in polynomial order
    symbols: tuple               # sympy symbols named after them
    hints: dict                  # the sizes the trace ran at
    ranges: dict                 # name -> (low, high or None) where the formulas hold
    guards: list                 # Guard, from the model's own code
    specialized: dict            # name -> the one value a guard pinned it to
    pieces: list                 # Piece, steady state (or the only step)
    first_pieces: list           # Piece, first step
    flops_poly: dict             # phase -> polynomial
    ops: list = field(default_factory=list, repr=False)   # the step's op names, for peak ops
    fitted: dict | None = None   # when a dimension was pinned: how the formulas were fitted instead
    aux: tuple = ()              # _Aux: the rounding variables after the dimensions

    # ---- expressions ----------------------------------------------------------------------

    def expr(self, poly: dict) -> sympy.Expr:
        gens = self.symbols + tuple(a.expr for a in self.aux)
        return sympy.Add(*(sympy.Rational(Fraction(c).numerator, Fraction(c).denominator) * sympy.Mul(*(s ** e for s, e in zip(gens, exps)))
                           for exps, c in poly.items())) if poly else sympy.Integer(0)

    @property
    def flops(self) -> dict:
        return {k: self.expr(v) for k, v in self.flops_poly.items()}

    def peak_expr(self, first_step: bool = False) -> sympy.Expr:
        """Piecewise: each piece where it is the largest (ties go to the earliest)."""
        pieces = self.first_pieces if first_step else self.pieces
        exprs = [self.expr(p.bytes) for p in pieces]
        if len(exprs) == 1:
            return exprs[0]
        return sympy.Piecewise(*[
            (e, sympy.And(*[e >= o for j, o in enumerate(exprs) if j != i]))
            for i, e in enumerate(exprs[:-1])], (exprs[-1], True))

    def large_size_peak_expr(self, dim: str) -> sympy.Expr:
        """The peak's formula that holds for large sizes of `dim`: the piece (of the first step's
        or the steady step's) that is largest there, other dimensions at their sizes."""
        huge = {**self.hints, dim: 1 << 40}
        symbols = dict(zip(self.names, self.symbols))
        best, best_value = None, None
        for pieces in (self.pieces, self.first_pieces):
            for piece in pieces:
                e = self.expr(piece.bytes)
                v = e.xreplace({symbols[n]: huge[n] for n in self.names if n in huge})
                if best_value is None or v > best_value:
                    best, best_value = e, v
        return best

    # ---- evaluation -----------------------------------------------------------------------

    def valid(self, sizes: dict) -> bool:
        for name in self.names:
            lo, hi = self.ranges[name]
            v = sizes[name]
            if v < lo or (hi is not None and v > hi):
                return False
            if name in self.specialized and v != self.specialized[name] and not (
                    self.fitted and self.fitted["verified"]):
                return False
        return True

    def point(self, sizes: dict) -> tuple:
        """The values the polynomials are evaluated at: the dimensions', then the rounding
        variables'."""
        missing = [n for n in self.names if n not in sizes]
        if missing:
            raise ValueError(f"give a size for {', '.join(missing)}")
        return _extend(self.aux, tuple(int(sizes[n]) for n in self.names))

    def at(self, **sizes) -> Estimate:
        vals = self.point(sizes)
        best, best_piece = _best(self.pieces, vals)
        first, _ = _best(self.first_pieces, vals)
        return Estimate(dict(zip(self.names, vals)), best, first,
                        {k: _eval(v, vals) for k, v in self.flops_poly.items()},
                        {c: _eval(v, vals) for c, v in best_piece.categories.items()},
                        best_piece.op)


def fit_pinned(sp: SymbolicProfile, trace_at) -> None:
    """A guard pinned some dimensions, so the trace's formulas hold at one size only. Trace the
    step concretely on a grid of sizes of the pinned dimensions, fit the peak, the first-step peak
    and the FLOPs as polynomials (degree <= 2 in each pinned dimension: attention is quadratic in
    the sequence), check them at two more sizes, and say so in `sp.fitted`.

    trace_at(sizes) -> Profile of a concrete trace.
    """
    import itertools

    pinned = [n for n in sp.names if n in sp.specialized]
    base = {n: sp.specialized.get(n, sp.hints[n]) for n in sp.names}
    grid = {n: [base[n] * k for k in (1, 2, 3)] for n in pinned}
    checks = [{**base, **{n: base[n] * 5 for n in pinned}}, {**base, **{n: base[n] * 7 for n in pinned}}]
    points = [dict(base, **dict(zip(pinned, combo)))
              for combo in itertools.product(*(grid[n] for n in pinned))]

    def measure(sizes):
        p = trace_at(sizes)
        return {"peak": p.peak_bytes, "first": p.first_step_peak_bytes, **p.flops}

    data = [measure(pt) for pt in points]
    idx = [sp.names.index(n) for n in pinned]
    exps = list(itertools.product(range(3), repeat=len(pinned)))
    polys = {}
    pad = (0,) * len(sp.aux)  # the fitted polynomials read no rounding variable
    for q in data[0]:
        coeffs = _solve([[_mono(pt, pinned, e) for e in exps] for pt in points], [d[q] for d in data])
        polys[q] = {tuple(e[idx.index(i)] if i in idx else 0 for i in range(len(sp.names))) + pad: c
                    for e, c in zip(exps, coeffs) if c}
    verified = all(_eval(polys[q], sp.point(ck)) == m[q]
                   for ck in checks for m in [measure(ck)] for q in polys)
    sp.fitted = {"dims": pinned, "traced_at": points, "checked_at": checks, "verified": verified}
    if verified:
        sp.pieces = [Piece(polys["peak"], -1, {c: {} for c in CATEGORIES})]
        sp.first_pieces = [Piece(polys["first"], -1, {c: {} for c in CATEGORIES})]
        sp.flops_poly = {k: polys[k] for k in ("forward", "backward", "optimizer", "total")}


def _mono(pt: dict, names: list, exps: tuple) -> Fraction:
    out = Fraction(1)
    for n, e in zip(names, exps):
        out *= pt[n] ** e
    return out


def _solve(a: list, b: list) -> list:
    """Exact Gaussian elimination over the rationals (a small square system)."""
    n = len(a)
    m = [list(map(Fraction, row)) + [Fraction(v)] for row, v in zip(a, b)]
    for col in range(n):
        piv = next(r for r in range(col, n) if m[r][col] != 0)
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _eval_exact(poly: dict, vals: tuple) -> Fraction:
    total = Fraction(0)
    for exps, c in poly.items():
        term = c
        for v, e in zip(vals, exps):
            if e:
                term *= v ** e
        total += term
    return total


def _eval(poly: dict, vals: tuple) -> int:
    return int(_eval_exact(poly, vals))  # exact: the polynomials take integer values at integer sizes


def _best(pieces, vals):
    best, piece = None, None
    for p in pieces:
        v = _eval(p.bytes, vals)
        if best is None or v > best:
            best, piece = v, p
    return best, piece


# ---- turning the trace into polynomials -----------------------------------------------------

class NotPolynomial(ValueError):
    """A size the formulas cannot hold: `keep[:100]` of a data-dependent `keep` is
    Min(100, n), piecewise in n."""


def _rounding_kinds() -> dict:
    from ..torch_compat import sympy_size_functions

    # CleanDiv is a FloorDiv, and CeilDiv builds a FloorDiv of base + divisor - 1
    (floordiv, mod, python_mod, max_, min_), _ = sympy_size_functions()
    return {floordiv: "floordiv", mod: "mod", python_mod: "mod", max_: "max", min_: "min",
            sympy.Max: "max", sympy.Min: "min", sympy.Mod: "mod"}


def _pow_by_natural():
    from ..torch_compat import sympy_size_functions

    return sympy_size_functions()[1]


class _Converter:
    """SymInts -> sympy expressions in the dimension names; sizes -> polynomials."""

    def __init__(self, trace: Trace):
        self.names = tuple(trace.symbols)
        self.symbols = tuple(sympy.Symbol(n, integer=True, positive=True) for n in self.names)
        self.aux: list[_Aux] = []
        self.lows: tuple = ()          # each variable's lower bound (dimensions, then aux)
        self.lifted: dict = {}
        self.frozen = False            # set by the first polynomial: no variable may follow it
        self.kinds = _rounding_kinds()
        self.nonpoly = tuple(self.kinds) + (_pow_by_natural(),)
        self.rename = {trace.symbols[n]: s for n, s in zip(self.names, self.symbols)}
        by_name = dict(zip(self.names, self.symbols))
        for sym, name in trace.unbacked.items():  # every symbol of a data-dependent size
            self.rename[sym] = by_name[name]
        self.memo: dict = {}
        self.polys: dict = {}

    def expr(self, x):
        if isinstance(x, int):
            return x
        node = getattr(x, "node", None)
        if node is None:
            return x
        e = self.memo.get(id(x))
        if e is None:
            e = node.expr.xreplace(self.rename)
            e = int(e) if e.is_Integer else e
            self.memo[id(x)] = e
        return e

    @property
    def gens(self) -> tuple:
        return self.symbols + tuple(a.symbol for a in self.aux)

    def prepare(self, exprs, lows: tuple) -> None:
        """Give every rounding function in `exprs` its variable, before the first polynomial (all
        polynomials share one list of variables)."""
        self.lows = tuple(lows)
        for e in exprs:
            if isinstance(e, sympy.Basic):
                self._lift(e)

    def _lift(self, e):
        """`e` with each rounding function replaced by its variable (innermost first)."""
        if e.is_Atom or not e.has(*self.nonpoly):
            return e
        out = self.lifted.get(e)
        if out is not None:
            return out
        args = [self._lift(a) for a in e.args]
        kind = next((k for t, k in self.kinds.items() if isinstance(e, t)), None)
        if isinstance(e, _pow_by_natural()) and args[1].is_Integer:
            out = args[0] ** args[1]
        elif kind is None:
            out = e.func(*args)
        else:
            out = self._variable(e, kind, args)
        self.lifted[e] = out
        return out

    def _variable(self, e, kind: str, args: list):
        if self.frozen:
            raise NotPolynomial(f"size {e}: a rounding function met after the polynomials were made")
        divisor = None
        if kind in ("floordiv", "mod"):
            args, d = args[:1], args[1]
            if not (d.is_Integer and d > 0):
                raise NotPolynomial(f"size {e} divides by {d}, not by a positive integer")
            divisor = int(d)
        polys = tuple(self._poly_in(a, self.gens) for a in args)
        lows = []
        for a, p in zip(args, polys):
            # grows with every variable (no negative coefficient once shifted to the lower
            # bounds): then its value at the lower bounds bounds it below on the whole domain
            if any(v < 0 for v in _shift(p, self.lows).values()):
                raise NotPolynomial(f"size {e}: {a} does not grow with the sizes, so it has no "
                                 f"lower bound to prove the peak's pieces with")
            lows.append(_eval_exact(p, self.lows))
        low = 0 if kind == "mod" else (math.floor(lows[0] / divisor) if kind == "floordiv"
                                       else int((max if kind == "max" else min)(lows)))
        symbol = sympy.Symbol(f"_r{len(self.aux)}", integer=True)
        self.aux.append(_Aux(symbol, e, kind, polys, divisor, low))
        self.lows = self.lows + (low,)
        return symbol

    def _poly_in(self, e, gens) -> dict:
        try:  # rational coefficients (L*(L+1)/2 pairs of a causal mask) stay exact
            return {k: int(v.p) if v.q == 1 else Fraction(int(v.p), int(v.q))
                    for k, v in sympy.Poly(e, *gens).as_dict().items()}
        except (sympy.PolynomialError, TypeError) as exc:
            raise NotPolynomial(f"size {e} is not a polynomial of {', '.join(self.names)}") from exc

    def poly(self, e) -> dict:
        if isinstance(e, int):
            return {(0,) * len(self.gens): e} if e else {}
        p = self.polys.get(e)
        if p is None:
            lifted = self._lift(e)
            self.frozen = True
            p = self.polys[e] = self._poly_in(lifted, self.gens)
        return p


def _ref(conv: _Converter, r):
    if type(r) is TensorRef:
        return TensorRef(tuple(conv.expr(s) for s in r.shape), r.dtype, r.storage, r.value)
    if type(r) in (tuple, list):
        return tuple(_ref(conv, x) for x in r)
    return conv.expr(r) if hasattr(r, "node") else r


def _sympify_op(conv: _Converter, r):
    """A copy of one OpRecord whose sizes are sympy expressions in the dimension names."""
    return replace(r, args=tuple(_ref(conv, a) for a in r.args),
                   kwargs={k: _ref(conv, v) for k, v in r.kwargs.items()},
                   outputs=tuple(None if o is None else _ref(conv, o) for o in r.outputs),
                   inputs=tuple(_ref(conv, t) for t in r.inputs))


def converter(trace: Trace) -> _Converter:
    """What `instantiate` evaluates a trace's sizes with (symbolic_profile's second result)."""
    return _Converter(trace)


def sympify_trace(trace: Trace) -> tuple[Trace, _Converter]:
    """A copy of the trace whose sizes are sympy expressions in the dimension names."""
    conv = _Converter(trace)
    storages = [StorageRecord(s.id, conv.expr(s.nbytes), s.device, s.created_by, s.roles, s.stream,
                              s.resized_by)
                for s in trace.storages]
    t = replace(trace, ops=[_sympify_op(conv, r) for r in trace.ops], storages=storages)
    return t, conv


def instantiate(trace: Trace, conv: _Converter, sizes: dict) -> Trace:
    """The trace at concrete sizes: every size expression evaluated (exact: polynomials in
    integers). `trace` is the captured one (SymInts) or `sympify_trace`'s copy: a SymInt is read
    as its expression first, so both give the same trace, and the captured one is not copied
    twice."""
    subs = {s: int(sizes[n]) for n, s in zip(conv.names, conv.symbols)}
    memo: dict = {}
    of_symint: dict = {}  # id -> value: the captured trace holds each SymInt, alive, many times

    def evaluate(e):
        if isinstance(e, sympy.Expr):
            v = memo.get(e)
            if v is None:
                v = memo[e] = int(e.xreplace(subs))
            return v
        return e

    def val(x):
        if hasattr(x, "node"):
            key = id(x)
            try:
                return of_symint[key]
            except KeyError:
                v = of_symint[key] = evaluate(conv.expr(x))
                return v
        return evaluate(x)

    def ref(r):
        if type(r) is TensorRef:
            return TensorRef(tuple(val(s) for s in r.shape), r.dtype, r.storage, r.value)
        if type(r) in (tuple, list):
            return tuple(ref(x) for x in r)
        return val(r)

    ops = [replace(r, args=tuple(ref(a) for a in r.args),
                   kwargs={k: ref(v) for k, v in r.kwargs.items()},
                   outputs=tuple(None if o is None else ref(o) for o in r.outputs),
                   inputs=tuple(ref(t) for t in r.inputs)) for r in trace.ops]
    storages = [StorageRecord(s.id, val(s.nbytes), s.device, s.created_by, s.roles, s.stream,
                              s.resized_by)
                for s in trace.storages]
    return replace(trace, ops=ops, storages=storages, symbols={}, hints={}, guards=[],
                   replacements={}, ranges={})


# ---- the analysis ---------------------------------------------------------------------------

def _shift(poly: dict, lows: tuple) -> dict:
    """poly(x) -> poly(low + y) as a polynomial in y (exact integer arithmetic)."""
    out: dict = {}
    for exps, c in poly.items():
        terms = [((), c)]
        for e, lo in zip(exps, lows):
            # (lo + y)^e = sum_k C(e, k) lo^(e-k) y^k
            terms = [(k_prev + (k,), coef * math.comb(e, k) * lo ** (e - k))
                     for k_prev, coef in terms for k in range(e + 1)]
        for k, coef in terms:
            out[k] = out.get(k, 0) + coef
    return out


def _covers(p_shifted: dict, q_shifted: dict) -> bool:
    """p >= q for every size >= the lower bounds, given both shifted to those bounds: then
    p - q has no negative coefficient (a proof for all sizes, not a sample)."""
    for k, v in q_shifted.items():
        if p_shifted.get(k, 0) < v:
            return False
    return all(v >= 0 for k, v in p_shifted.items() if k not in q_shifted)


def _add(total: dict, poly: dict, sign: int) -> None:
    for k, v in poly.items():
        n = total.get(k, 0) + sign * v
        if n:
            total[k] = n
        else:
            total.pop(k, None)


def _pieces(trace: Trace, nbytes: list, view: StepView, conv: _Converter, categories,
            lows) -> list[Piece]:
    """`nbytes`: each storage's size as an expression."""
    shifted_of: dict = {}

    def polys(sid):
        p = conv.poly(nbytes[sid])
        key = id(p)
        sp = shifted_of.get(key)
        if sp is None:
            sp = shifted_of[key] = (p, _shift(p, lows))  # shifting is linear: once per size
        return sp

    total, total_s = {}, {}
    by_cat = {c: {} for c in CATEGORIES}
    for sid in initially_live(trace, view):
        p, ps = polys(sid)
        _add(total, p, 1)
        _add(total_s, ps, 1)
        _add(by_cat.setdefault(categories[sid], {}), p, 1)  # + a rank's distributed ones
    pieces = [(dict(total_s), Piece(dict(total), 0, {c: dict(v) for c, v in by_cat.items()}))]
    last = None  # the shifted bytes of the piece that bounded the last allocation
    for _, pos, sid, delta in device_events(trace, view):
        p, ps = polys(sid)
        _add(total, p, delta)
        _add(total_s, ps, delta)
        _add(by_cat.setdefault(categories[sid], {}), p, delta)
        if delta < 0:
            continue
        # the piece that bounded the last allocation mostly bounds this one too: asked first
        if last is not None and _covers(last, total_s):
            continue
        last = next((qs for qs, _ in pieces if _covers(qs, total_s)), None)
        if last is not None:
            continue
        pieces = [(qs, q) for qs, q in pieces if not _covers(total_s, qs)]
        pieces.append((dict(total_s),
                       Piece(dict(total), pos, {c: dict(v) for c, v in by_cat.items()})))
    return [q for _, q in pieces]


def _guards(trace: Trace, conv: _Converter):
    """Guards the model's own code placed on the dimensions, and the dimensions they pin."""
    specialized = {}
    for name, r in trace.replacements.items():
        if getattr(r, "is_Integer", False):
            specialized[name] = int(r)
    out = []
    for g in trace.guards:
        if g.internal:
            continue  # tapescope's own bookkeeping, structural
        expr = str(g.expr.xreplace(conv.rename))
        pins = next((n for n, v in specialized.items()
                     if expr in (f"Eq({n}, {v})", f"Eq({v}, {n})")), None)
        out.append(Guard(expr, g.where, pins))
    ranges = {}
    for name in trace.symbols:
        lo, hi = trace.ranges.get(name, (None, None))
        ranges[name] = (specialized.get(name, 2 if lo is None else lo), specialized.get(name, hi))
    return out, specialized, ranges


def symbolic_profile(trace: Trace) -> tuple[SymbolicProfile, _Converter]:
    """Formulas from a symbolic trace, and the converter that `instantiate` evaluates it with.
    Only what the formulas read is turned into sympy: every storage's size, and the ops of the
    steady step (their FLOPs)."""
    conv = _Converter(trace)
    guards, specialized, ranges = _guards(trace, conv)
    lows = tuple(max(ranges[n][0], 1) for n in conv.names)
    # step views and categories read no size: the captured trace's serve
    views = step_views(trace)
    categories = storage_categories(trace)
    main = views[max(views)]
    nbytes = [conv.expr(s.nbytes) for s in trace.storages]
    op_flop_exprs = []
    for i in main.ops:
        r = _sympify_op(conv, trace.ops[i])
        f = op_flops(r)
        if f:
            op_flop_exprs.append((r.phase, sympy.expand(f) if isinstance(f, sympy.Expr) else int(f)))
    conv.prepare(nbytes + [f for _, f in op_flop_exprs], lows)
    lows = conv.lows
    pieces = _pieces(trace, nbytes, main, conv, categories, lows)
    first = pieces if main.step == 1 else _pieces(trace, nbytes, views[1], conv, categories, lows)
    flops: dict = {"forward": {}, "backward": {}, "optimizer": {}}
    for phase, f in op_flop_exprs:
        _add(flops[phase], conv.poly(f), 1)
    total: dict = {}
    for v in flops.values():
        _add(total, v, 1)
    flops["total"] = total
    return (SymbolicProfile(conv.names, conv.symbols, dict(trace.hints), ranges, guards,
                            specialized, pieces, first, flops,
                            [trace.ops[i].name for i in main.ops], aux=tuple(conv.aux)),
            conv)
