"""The search loop: which candidates to trace, in what order, on which workers, and which the
traces already rule out.

These rules prune, each a consequence of traces already made, never a formula standing in for
one:

- memory grows with the micro-batch, and checkpointing saves memory: once a candidate runs out of
  memory on some rank, every candidate of its layout and schedule with as little recompute or
  less at a micro-batch as large or larger is out too. So at each micro-batch size the least
  recompute is traced first, then, when it runs out, the most (when that runs out too, so does
  every mode between), then the modes between;
- memory grows as sharding shrinks: HSDP holds more of the parameters, gradients and optimizer
  state on each rank than FSDP over all its data-parallel ranks, and the same activations. An
  HSDP candidate waits for its FSDP twin and is out when that one is out of memory;
- a floor on what a pipelined candidate's rank provably holds (memory_floors.py: FSDP2's
  unsharded parameters and gradients kept across micro-batches; the micro-batches in flight
  at their unpipelined twins' saved bytes; the last stage's loss backward on its fp32 logits;
  these two beside the stage's parameter shards, optimizer state and FSDP2's gathered root
  group) above the bytes the GPU's allocator can use: the candidate runs out of memory, and
  the rules above extend that to its family, before any trace of it;
- at one micro-batch size, a mode with more recompute runs the same step plus the recomputed
  forward ops: when a mode with less recompute fits there, the heavier one is not traced (it is
  listed as dominated, naming the candidate that fits);
- branch and bound: a candidate whose step time is provably longer than the `top`-th best so far
  (a lower bound from earlier traces, layout_search/bounds.py) cannot enter the table's top rows
  and is not traced. The top `top` rows are therefore brute force's; rows below may miss a
  candidate that was not traced. Each layout (with its schedule) is opened with its least
  recompute at its largest micro-batch: its fewest micro-batches, the cheapest trace of the
  layout, and, fit or not, its kernels bound every micro-batch size of the layout and of the
  layouts that split the model the same way (bounds.py), so a layout far from the top costs one
  trace. A pipelined candidate waits for the one-micro-batch unpipelined candidates of its TP /
  CP split (their kernels bound it: bounds.pipelined_model_kernels) while unpipelined work is
  ready or being traced. (One-micro-batch screens of accumulating candidates were tried and dropped: on
  benchmarks/search_speed.py's spaces they cost more than they pruned.)

The brute-force search checks each rule: every candidate the rules rule out runs out of memory
(or is slower than the candidate that dominates it) when traced (tests/test_search.py).

`brute_force=True` traces every candidate instead (benchmarks/search_speed.py compares the two).

Workers: in this process (workers=1), local processes (concurrent.futures, the default), or a
Ray cluster (layout_search/ray_pool.py). Each free worker gets the best ready candidate once
every finished trace is read, none queued ahead: a queued candidate was chosen without the
traces that finish while it waits, which may rule it out. A cache file keeps each finished
candidate's outcome, one JSON line each, so that a search stopped half way resumes where it
was.

Stopping: a time limit (`time_limit` seconds), Ctrl-C or SIGTERM ends the loop, the workers and the
candidates they are tracing; what the traces showed is kept. The time limit returns a result with
`complete` False, every candidate neither traced nor ruled out in `not_searched` with the lower
bound the traces give its step (so a reader sees whether the stop could hide a faster layout);
Ctrl-C and SIGTERM raise SearchInterrupted / SearchTerminated carrying that result, so that a
caller who does not catch them ends as on any Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, replace

from ..errors import TapescopeError
from .bounds import Bound, Known, _pipeline_twin, lower_bound, matmul_rate
from .evaluate import ERROR, FITS, OOM, Outcome, Source, evaluate
from .memory_floors import (MemoryFloor, Twins, allocator_capacity, memory_floor,
                            model_parameters)
from .space import RECOMPUTE_ORDER, Candidate, SearchSpace, candidate_grid

__all__ = ["SearchResult", "Progress", "Untraced", "SearchInterrupted", "SearchTerminated",
           "run_search", "InProcess", "LocalPool"]


@dataclass(frozen=True)
class Progress:
    done: int
    pruned: int
    left: int
    running: int
    best: Outcome | None
    last: Outcome | None      # the outcome just in (None: a start or prune notice)


@dataclass(frozen=True)
class Untraced:
    """A candidate a stopped search neither traced nor ruled out."""

    candidate: Candidate
    bound: Bound | None   # the lower bound on its step the traces gave (None: no rule applied)
    being_traced: bool    # a worker was tracing it when the search stopped


@dataclass
class SearchResult:
    source: Source
    space: SearchSpace
    outcomes: list                                    # Outcome, every candidate traced
    pruned: list = field(default_factory=list)        # (Candidate, reason): ruled out by a trace
    skipped: list = field(default_factory=list)       # (Candidate, reason): outside the limits
    seconds: float = 0.0
    workers: str = ""
    top: int | None = None                            # the rows branch and bound kept exact
    bounds: dict = field(default_factory=dict)        # Candidate -> the step-time bound (s) that
                                                      # pruned it
    stopped: str | None = None                        # what ended the search early (None: it
                                                      # searched the whole space)
    not_searched: list = field(default_factory=list)  # Untraced, when stopped
    rows: int | None = None                           # the top rows asked for (the table's)

    @property
    def complete(self) -> bool:
        return self.stopped is None

    def could_enter_top(self, u: Untraced) -> bool:
        """Whether the untraced `u` could take one of the top `rows` rows: no bound, fewer
        candidates fit than there are rows, or its bound is below the rows-th best's step."""
        ranked = self.ranked
        if u.bound is None or self.rows is None or len(ranked) < self.rows:
            return True
        return u.bound.seconds < ranked[self.rows - 1].step_seconds

    def could_beat_best(self, u: Untraced) -> bool:
        """Whether the untraced `u` could be faster than the best traced candidate."""
        w = self.winner
        return w is None or u.bound is None or u.bound.seconds < w.step_seconds

    @property
    def exact_rows(self) -> int | None:
        """The leading rows of `ranked` that are brute force's: complete, the `top` that branch
        and bound kept exact (None: every row); stopped, those no candidate left unsearched
        can beat (its bound at least their step), at most `top`."""
        if self.complete:
            return self.top
        floor = min((u.bound.seconds if u.bound is not None else 0.0
                     for u in self.not_searched), default=float("inf"))
        proven = sum(1 for o in self.ranked if o.step_seconds <= floor)
        return proven if self.top is None else min(proven, self.top)

    @property
    def ranked(self) -> list:
        """The candidates that fit on every rank, most tokens per second first; not those a
        lighter checkpointing mode of the same step beats (`dominated`)."""
        return [o for o in self._timed() if not _dominated(o.candidate, self._by_candidate())]

    @property
    def dominated(self) -> list:
        """Candidates that fit, traced, whose step with less recompute fits too (and is faster:
        the pruned search does not trace them once it knows)."""
        return [o for o in self._timed() if _dominated(o.candidate, self._by_candidate())]

    def _timed(self) -> list:
        timed = [o for o in self.outcomes if o.fits and o.tokens_per_second]
        return sorted(timed, key=lambda o: (-o.tokens_per_second, o.candidate.key()))

    def _by_candidate(self) -> dict:
        return {o.candidate: o for o in self.outcomes}

    @property
    def winner(self) -> Outcome | None:
        r = self.ranked
        return r[0] if r else None

    @property
    def rejected(self) -> list:
        return [o for o in self.outcomes if not o.fits]


# ---- workers -----------------------------------------------------------------------------------

class InProcess:
    """Candidates one after another in this process (workers=1; the tests' default). Its
    candidates share DTensor's sharding decisions (distributed/fidelity.py, point 6) for the
    pool's life, as a local pool's worker processes do."""

    name = "this process"
    slots = 1

    def __init__(self):
        from ..distributed.fidelity import DecisionMemory

        self.decisions = DecisionMemory()

    def submit(self, fn, *args) -> Future:
        from ..distributed.fidelity import decisions_remembered

        f: Future = Future()
        try:
            with decisions_remembered(self.decisions):
                f.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future; a
            # stop (Ctrl-C, SIGTERM, the time limit) is no Exception: it ends the search now
            f.set_exception(e)
        return f

    def close(self, abort: bool = False) -> None:
        pass


class LocalPool:
    """Local worker processes (spawned: a forked copy of a process that has run torch's
    threads can hang). Each worker's candidates share DTensor's sharding decisions for the
    worker's life (distributed/fidelity.py, point 6)."""

    def __init__(self, workers: int):
        import multiprocessing

        from ..distributed.fidelity import remember_decisions_in_this_process

        self.slots = workers
        self.name = f"{workers} local processes"
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=remember_decisions_in_this_process)

    def submit(self, fn, *args) -> Future:
        return self.pool.submit(fn, *args)

    def close(self, abort: bool = False) -> None:
        """Stop the workers. abort (Ctrl-C, SIGTERM, the time limit, an error): end the
        candidates they are tracing too; a 70B trace runs for minutes, and
        ProcessPoolExecutor's shutdown lets a running task finish. concurrent.futures has no
        public way to end its processes before Python 3.14 (terminate_workers), so they are
        terminated by their handles."""
        if not abort:   # idle workers end on their own (a worker's exit can take seconds)
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        processes = list((self.pool._processes or {}).values())
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=10)
        # then wait for the pool's own thread to see them gone and close its pipes: left
        # running, it can close a pipe while Python 3.11's exit hook writes to it (an OSError
        # traceback at exit, seen after SIGINT). Bounded: a Ctrl-C that lands inside the pool's
        # own bookkeeping can leave that thread waiting for good (a SIGINT'd search once never
        # printed its table in CI), and the table and JSON come first
        thread = getattr(self.pool, "_executor_manager_thread", None)  # shutdown drops it
        self.pool.shutdown(wait=False, cancel_futures=True)
        if thread is not None:
            thread.join(timeout=10)


# ---- the cache ---------------------------------------------------------------------------------

class Cache:
    """Outcomes of finished candidates, one JSON line each, keyed by the workload, the tapescope
    version and the candidate: a second search with the same source reads them back."""

    def __init__(self, path: str | None, source: Source, global_tokens: int):
        from ..version import __version__

        self.path = path
        self.prefix = json.dumps({"source": asdict(source), "tokens": global_tokens,
                                  "version": __version__}, sort_keys=True, default=str)
        self.known: dict = {}
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by an interrupted write
                    if entry.get("workload") == self.prefix:
                        o = Outcome.from_dict(entry["outcome"])
                        self.known[o.candidate.key()] = o

    def get(self, c: Candidate) -> Outcome | None:
        return self.known.get(c.key())

    def put(self, o: Outcome) -> None:
        if not self.path or o.cached:
            return
        from ..report.json import to_jsonable

        with open(self.path, "a") as f:
            f.write(json.dumps({"workload": self.prefix, "outcome": to_jsonable(o.to_dict())})
                    + "\n")


# ---- the loop ----------------------------------------------------------------------------------

class _Grid:
    """Each cell's state: an Outcome, a pruning reason, or nothing yet."""

    def __init__(self, space: SearchSpace, top: int | None = None, rate: float | None = None,
                 source: Source | None = None, capacity: int | None = None):
        grid = candidate_grid(space)
        self.skipped = grid.skipped
        self.chains = grid.chains
        # chains of one layout, schedule, compile and float8 setting by checkpointing mode
        self.families: dict = {}
        for key, chain in grid.chains.items():
            layout, ac, schedule, compiled, float8 = key
            self.families.setdefault((layout, schedule, compiled, float8), {})[ac] = chain
        self.outcome: dict = {}     # Candidate -> Outcome
        self.pruned: dict = {}      # Candidate -> reason
        self.started: set = set()
        self.all = {c for ch in grid.chains.values() for c in ch}
        # branch and bound: the fitting candidates' step seconds, and what the traces measured
        # for the bounds (top None: no bound pruning)
        self.top = top
        self.fit_seconds: dict = {}     # Candidate -> step seconds
        self.known = Known(rate)
        self.bounds: dict = {}      # Candidate -> its lower bound (Bound) that pruned it
        # memory floors (memory_floors.py): the model's parameters, read off a meta build the
        # first time a pipelined candidate reaches the gate; the allocator's capacity
        self.source, self.capacity = source, capacity
        self.model = None
        self.twins = Twins()        # unpipelined traces: what a block keeps for its backward
        self.floors: dict = {}      # Candidate -> (twins.added, its MemoryFloor)

    def learn(self, o: Outcome) -> None:
        """What a trace adds to the bounds and the top."""
        self.known.add(o)
        self.twins.add(o)
        if o.candidate in self.all and o.fits and o.step_seconds:
            self.fit_seconds[o.candidate] = o.step_seconds

    def _limit(self) -> float | None:
        """The top-th best step among the fitting candidates that are not dominated (a lighter
        checkpointing mode of the same step fits: that one is faster, and the search lists
        the heavier one apart, as brute force's ranking does not need it)."""
        if self.top is None:
            return None
        steps = sorted(t for c, t in self.fit_seconds.items() if not _dominated(c, self.outcome))
        return steps[self.top - 1] if len(steps) >= self.top else None

    def _ooms(self, c: Candidate | None) -> bool:
        """Known not to fit (traced out of memory, or ruled out by a smaller micro-batch)."""
        if c is None:
            return True
        o = self.outcome.get(c)
        return o is not None and o.status == OOM or c in self.pruned and \
            self.pruned[c].startswith("out of memory")

    def _at(self, family: dict, ac: str, mb: int) -> Candidate | None:
        return next((c for c in family.get(ac, ()) if c.micro_batch == mb), None)

    def update(self, brute_force: bool) -> list:
        """Apply the pruning rules; the cells that can be traced now, in order."""
        ready = []
        if not brute_force:
            # a pipelined candidate whose floor exceeds the GPU is out of memory wherever it
            # waits in its family's order (the gate would rule it out once ready): ruled out
            # now, so that the memory rules extend it and a stopped search does not list it
            # as unsearched
            for c in self.all:
                if c.layout.pp > 1 and self._open(c):
                    self._above_floor(c)
        for family in self.families.values():
            modes = [m for m in RECOMPUTE_ORDER if m in family]
            if brute_force:
                ready += [c for m in modes for c in family[m] if self._open(c)]
                continue
            # at each micro-batch size the least recompute first (when it fits, every heavier
            # mode there is dominated), then the most (when that runs out, so does every
            # mode between, and every larger micro-batch), then the modes between
            order = [modes[0], *modes[:0:-1][:1], *modes[1:-1]]
            # the family's opener: the least recompute at the largest micro-batch, its fewest
            # micro-batches (the cheapest trace of the family, and the likeliest fastest when it
            # fits); fit or not, its kernels bound every micro-batch size of the layout
            # (bounds.py), so that a layout far from the top is ruled out after one trace
            opener = family[modes[0]][-1]
            if self._open(opener):
                ready += self._gate(opener)
                continue
            if opener in self.started:
                continue
            for k, ac in enumerate(modes):
                chain = family[ac]
                for i, c in enumerate(chain):
                    if not self._open(c):
                        continue
                    oom = self._ran_out_before(family, modes, c)
                    if oom is not None:
                        self.pruned[c] = (f"out of memory: {oom.label()} already runs out "
                                          "(as much recompute or more, a micro-batch as "
                                          "small or smaller)")
                        continue
                    failed = next((b for b in chain[:i] + [opener] if b in self.outcome
                                   and self.outcome[b].status == ERROR), None)
                    if failed is not None:
                        self.pruned[c] = f"not profiled: {self.outcome[failed].reason}"
                        continue
                    lighter = [self._at(family, m, c.micro_batch) for m in modes[:k]]
                    fit = next((x for x in lighter if x in self.outcome
                                and self.outcome[x].fits), None)
                    if fit is not None:
                        self.pruned[c] = (f"dominated: {fit.label()} fits with less "
                                          "recompute")
                        continue
                    slow = next((x for x in lighter if x in self.bounds), None)
                    if slow is not None:   # more recompute: that step and more
                        self.bounds[c] = self.bounds[slow]
                        self.pruned[c] = (f"cannot enter the top {self.top}: it recomputes "
                                          f"more than {slow.label()}, which cannot")
                        continue
                    before = [self._at(family, m, c.micro_batch)
                              for m in order[:order.index(ac)]]
                    if any(x is not None and not self._resolved(x) for x in before):
                        continue  # wait: a mode tried before this one at this size
                    if lighter and not self._ooms(lighter[0]):
                        continue  # wait: the least recompute may fit at this size
                    if i and not self._resolved(chain[i - 1]):
                        continue  # wait: the smaller micro-batch may run out
                    ready += self._gate(c)
        # best first by an admissible estimate: the lower bound on the step the traces so far
        # give (0 where none applies yet: it may be the best), so that the top is known early
        # and the bounds prune more; then cheap and likely first: no pipeline before pipelines
        # (a pipelined candidate traces every stage's micro-batches), the most tensor
        # parallelism first (the least memory per rank), small micro-batches first
        def estimate(c):
            b = lower_bound(c, self.known) if self.top is not None else None
            return b.seconds if b is not None else 0.0

        # a pipeline after the one-micro-batch unpipelined traces of its TP / CP split: its
        # bound reads their kernels (bounds.pipelined_model_kernels); nothing else bounds a
        # pipeline before its own family's trace (s70b's 70B run: its probes, 100-160 CPU s
        # each, went first). Only while unpipelined work is ready or running: never a wait
        # for a candidate that cannot come
        if not brute_force and any(c.layout.pp == 1 for c in (*ready, *self.started)):
            awaited = {_pipeline_twin(c) for c in self.all if c.layout.pp == 1
                       and c.steps == 1 and not self._resolved(c)}
            ready = [c for c in ready if c.layout.pp == 1 or _pipeline_twin(c) not in awaited]

        return sorted(dict.fromkeys(ready), key=lambda c: (
            estimate(c), c.layout.pp, -c.layout.tp, c.layout.dp_replicate,
            c.micro_batch, RECOMPUTE_ORDER.index(c.checkpointing)))

    def _resolved(self, c: Candidate) -> bool:
        return c in self.outcome or c in self.pruned

    def _ran_out_before(self, family: dict, modes: list, c: Candidate) -> Candidate | None:
        """A traced candidate of `c`'s family that ran out of memory with as much recompute or
        more at a micro-batch as small or smaller: `c` holds more (memory grows with the
        micro-batch; checkpointing saves memory)."""
        heavier = modes[modes.index(c.checkpointing):]
        return next((x for m in heavier for x in family[m] if x.micro_batch <= c.micro_batch
                     and x is not c and self._ooms(x)),
                    None)

    def _open(self, c: Candidate) -> bool:
        return c not in self.outcome and c not in self.pruned and c not in self.started

    def _gate(self, c: Candidate) -> list:
        """The last rules before tracing `c`: one that cannot enter the top is out, an HSDP
        candidate waits for its FSDP twin, one whose memory floor exceeds what the allocator can
        hold is out of memory. What to trace now ([] to wait)."""
        if self._above_floor(c):
            return []
        if self._beyond_top(c):
            return []
        if c.layout.dp_replicate > 1:
            twin = replace(c, layout=replace(c.layout, dp_replicate=1,
                                             fsdp=c.layout.fsdp * c.layout.dp_replicate))
            if twin in self.all:
                if self._ooms(twin):
                    self.pruned[c] = (f"out of memory: {twin.label()} already runs out, and "
                                      "HSDP shards less")
                    return []
                if twin not in self.outcome and twin not in self.pruned:
                    return []  # wait for the FSDP twin
        return [c]

    def _above_floor(self, c: Candidate) -> bool:
        """Rule `c` out when its memory floor exceeds what the allocator can use."""
        floor = self._memory_floor(c)
        if floor is None or floor.bytes <= self.capacity:
            return False
        self.pruned[c] = (f"out of memory: pipeline rank {floor.stage} holds at least "
                          f"{floor.bytes / 2**30:,.1f} GiB, above the "
                          f"{self.capacity / 2**30:,.1f} GiB the allocator can use: "
                          f"{floor.reason}")
        return True

    def _memory_floor(self, c: Candidate) -> MemoryFloor | None:
        """memory_floors.memory_floor of a pipelined candidate (None: no source, capacity or
        rule; a model that does not build on meta has no floor)."""
        if c.layout.pp == 1 or self.source is None or self.capacity is None:
            return None
        if self.model is None:
            try:
                self.model = model_parameters(self.source)
            except TapescopeError:
                self.source = None   # the traces will say what the build says
                return None
        added, floor = self.floors.get(c, (-1, None))
        if added != self.twins.added:
            floor = memory_floor(c, self.model, self.twins)
            self.floors[c] = (self.twins.added, floor)
        return floor

    def _beyond_top(self, c: Candidate) -> bool:
        """Prune `c` when its step provably takes longer than the top-th best's."""
        limit = self._limit()
        if limit is None:
            return False
        bound = lower_bound(c, self.known)
        if bound is None or bound.seconds <= limit:
            return False
        self.bounds[c] = bound
        self.pruned[c] = (f"cannot enter the top {self.top}: its step takes at least "
                          f"{bound.seconds * 1e3:,.0f} ms ({bound.reason}), the "
                          f"{_ordinal(self.top)} best {limit * 1e3:,.0f} ms")
        return True

    def left(self) -> int:
        return sum(1 for ch in self.chains.values() for c in ch
                   if c not in self.outcome and c not in self.pruned)


def _dominated(c: Candidate, outcomes: dict) -> bool:
    """A lighter checkpointing mode of the same step fits (in `outcomes`)."""
    lighter = RECOMPUTE_ORDER[:RECOMPUTE_ORDER.index(c.checkpointing)]
    return any(o is not None and o.fits
               for o in (outcomes.get(replace(c, checkpointing=m)) for m in lighter))


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the search; `result` is what it knew (a SearchResult, complete False).
    Uncaught, Python ends as on any Ctrl-C."""

    status = 130   # the shell's 128 + SIGINT, as the CLI exits on Ctrl-C

    def __init__(self, result: SearchResult):
        super().__init__("Ctrl-C stopped the search")
        self.result = result


class SearchTerminated(SystemExit):
    """SIGTERM stopped the search; `result` is what it knew. Uncaught, the process ends with
    status 143 (128 + SIGTERM), as it did before the search kept its result."""

    status = 128 + signal.SIGTERM

    def __init__(self, result: SearchResult):
        super().__init__(self.status)
        self.result = result


class _Stop(BaseException):
    """Raised in the search loop by SIGTERM's handler or the time limit (the timer's handler
    or the loop's clock). A BaseException, as KeyboardInterrupt is: no `except Exception` in a
    trace run in this process swallows it."""

    def __init__(self, why: str, raise_as: type | None = None):
        super().__init__(why)
        self.why = why
        self.raise_as = raise_as   # what the search raises once it has its result (None: the
                                   # time limit, it returns it)


def _stop_signals(time_limit: float | None, why: str):
    """While the search runs, SIGTERM raises _Stop (as Ctrl-C raises KeyboardInterrupt), so that
    the search ends its worker processes instead of leaving them tracing (Python's default
    SIGTERM ends this process alone), and keeps what it knew; with a time limit, a timer
    (SIGALRM) raises _Stop when it runs out, also in the middle of a trace run in this process,
    which the loop's own clock check cannot reach. Returns what disarms the timer and puts the
    old handlers back; signal handlers can only be set from the main thread: elsewhere it
    changes nothing (the loop's clock still stops the search between candidates)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    armed = [True]   # a signal landing while the handlers are put back raises nothing

    def stop(signum, frame):
        if armed[0]:
            raise _Stop("SIGTERM", SearchTerminated)

    def time_up(signum, frame):
        if armed[0]:
            raise _Stop(why)

    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, stop)}
    if time_limit is not None and hasattr(signal, "setitimer"):
        old[signal.SIGALRM] = signal.signal(signal.SIGALRM, time_up)
        signal.setitimer(signal.ITIMER_REAL, time_limit)

    def restore():
        armed[0] = False
        if signal.SIGALRM in old:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in old.items():   # None: a handler set outside Python
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    return restore


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _outcome_of(f: Future, c: Candidate) -> Outcome:
    """A finished candidate's Outcome; one whose trace failed is unprofiled, and says why."""
    try:
        return f.result()
    except TapescopeError as e:
        return Outcome(c, ERROR, reason=str(e).split("\n")[0])
    except Exception as e:  # noqa: BLE001 - a worker died or a trace crashed: the search goes on
        return Outcome(c, ERROR, reason=f"{type(e).__name__}: {e}".split("\n")[0])


def run_search(source: Source, space: SearchSpace, *, pool=None, cache: str | None = None,
               brute_force: bool = False, progress=None, seq_tokens: int | None = None,
               top: int | None = 10, time_limit: float | None = None,
               clock=time.monotonic) -> SearchResult:
    """Trace the candidates of `space` (or every one, `brute_force`), pruning with what the
    traces prove; `top`: the rows kept exact by branch and bound (None: no bound pruning).
    `progress(Progress)` is told of each outcome. `time_limit`: seconds after which the search
    stops and returns what it knows (`complete` False); `clock` reads the time against it (tests
    pass their own). Ctrl-C raises SearchInterrupted, SIGTERM SearchTerminated, each carrying
    that result."""
    from ..options import Options
    from ..report.search import fmt_duration

    start = time.perf_counter()
    pool = pool or InProcess()
    tokens = space.global_batch * (seq_tokens or 1)
    gpu = Options.create(gpu=source.gpu).gpu
    grid = _Grid(space, None if brute_force else top, matmul_rate(gpu), source,
                 allocator_capacity(gpu))
    store = Cache(cache, source, tokens)
    running: dict = {}   # Future -> Candidate
    best: Outcome | None = None
    why_limit = None if time_limit is None else f"the time limit ({fmt_duration(time_limit)})"
    deadline = None if time_limit is None else clock() + time_limit

    def tell(last):
        if progress is not None:
            progress(Progress(len(grid.outcome), len(grid.pruned), grid.left() - len(running),
                              len(running), best, last))

    def record(o: Outcome, cache: bool = True):
        nonlocal best
        grid.outcome[o.candidate] = o   # first: a stop landing in here keeps the outcome
        grid.learn(o)
        if cache:
            store.put(o)
        if o.fits and o.tokens_per_second and (best is None or
                                               o.tokens_per_second > best.tokens_per_second):
            best = o
        tell(o)

    def seconds_left() -> float | None:
        """The time left (None: no limit); past the limit, the stop."""
        if deadline is None:
            return None
        left = deadline - clock()
        if left <= 0:
            raise _Stop(why_limit)
        return left

    def collect(f: Future) -> None:
        c = running.pop(f)
        o = _outcome_of(f, c)   # a worker's Ctrl-C comes back here: c stays started
        grid.started.discard(c)
        # a worker that died (killed with the search's process group by a SIGTERM, out of host
        # memory) says nothing of the candidate: not cached, so a resumed search traces it
        lost = not f.cancelled() and isinstance(f.exception(), BrokenProcessPool)
        record(o, cache=not lost)

    finished = False
    stop: _Stop | None = None
    restore = _stop_signals(time_limit, why_limit)
    try:
        while True:
            seconds_left()
            ready = grid.update(brute_force)
            for c in ready:
                hit = store.get(c)
                if hit is not None:
                    record(hit)
            ready = [c for c in ready if c not in grid.outcome]
            if not ready and not running:
                if grid.update(brute_force):
                    continue
                break
            # one candidate per free worker, none queued behind a busy one: the next is chosen
            # once the trace before it is read, with the bounds and the top it set (two per
            # worker chose search_speed.py's FSDP 4 x TP 2, mb 1, accumulate 4, bound 1.66 s,
            # beside FSDP 8, mb 1, accumulate 2, whose 1.55 s step became the 3rd best; replayed
            # at 8 / 64 GPUs --top 3 in this process, 17 / 19 traces became 16 / 16:
            # docs/search.md)
            for c in ready[:max(0, pool.slots - len(running))]:
                seconds_left()   # in this process a submit is the whole trace
                grid.started.add(c)
                running[pool.submit(evaluate, source, c, tokens)] = c
            if not running:
                continue
            left = seconds_left()
            done, _ = wait(list(running), timeout=left, return_when=FIRST_COMPLETED)
            for f in done:
                collect(f)
        finished = True
    except KeyboardInterrupt:
        if not finished:
            stop = _Stop("Ctrl-C", SearchInterrupted)
    except _Stop as e:
        if not finished:
            stop = e
    finally:
        restore()
        pool.close(abort=not finished)
    if stop is not None:   # traces that finished as the stop came (in this process: all of them)
        for f in [f for f in running if f.done() and not f.cancelled() and f.exception() is None]:
            collect(f)
        grid.update(brute_force)   # what they rule out is ruled out, not left unsearched
    result = _result(grid, stop, source, space, pool.name, time.perf_counter() - start, top)
    if stop is not None and stop.raise_as is not None:
        raise stop.raise_as(result)
    return result


def _result(grid: _Grid, stop: _Stop | None, source: Source, space: SearchSpace, workers: str,
            seconds: float, top: int | None) -> SearchResult:
    """What the grid knows as a SearchResult; stopped, each candidate neither traced nor ruled
    out with the lower bound the traces give its step."""
    evaluated = [grid.outcome[c] for ch in grid.chains.values() for c in ch if c in grid.outcome]
    reasons = {o.reason for o in evaluated}
    if evaluated and all(o.status == ERROR for o in evaluated) and len(reasons) == 1 and \
            (stop is None or stop.raise_as is None):
        raise TapescopeError(f"every candidate failed the same way: {reasons.pop()}")
    pruned = [(c, grid.pruned[c]) for ch in grid.chains.values() for c in ch if c in grid.pruned]
    untraced = [Untraced(c, lower_bound(c, grid.known), c in grid.started)
                for ch in grid.chains.values() for c in ch
                if c not in grid.outcome and c not in grid.pruned] if stop is not None else []
    return SearchResult(source, space, evaluated, pruned, list(grid.skipped), seconds, workers,
                        grid.top, {c: b.seconds for c, b in grid.bounds.items()},
                        # nothing left when it stopped: it searched the whole space
                        None if stop is None or not untraced else stop.why, untraced, top)
