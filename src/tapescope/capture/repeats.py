"""A step traced with fewer micro-batches than it runs, extended to all of them where the trace
proves that its steady state repeats.

A pipeline schedule over N micro-batches runs a warm-up, a steady state and a cool-down; the
steady state is one block of actions (1F1B: a backward and a forward, with their sends and
receives) repeated until the micro-batches run out. tapescope traces the schedule over M < N
micro-batches of the same size (distributed/pipeline.py), finds the step's repeating regions
here, proves that their last two blocks are the same program, and stands the traced block for the
N - M micro-batches it did not trace:

- ops: the last block's ops run `runs` times (`Trace.repeated`, read by the op table, FLOPs and
  time);
- memory, exactly for the peak: a block may leave some storages alive past the region (the last
  stage's losses, kept to the step's end; GPipe's activations, freed by the backward region).
  Those are "persistent": each untraced block leaves one more. Each gets `runs - 1` stand-in
  storages (`Trace.stand_ins`), allocated when the last traced block starts and freed with the
  storage they stand for. The timeline then runs through the same levels as the full one where it
  can peak: every level before the last block is the full run's own; the last block and
  everything after it until the stand-ins die are the full run's last block and what follows it,
  byte for byte (the untraced blocks in between are below the last one, each having less of the
  persistent memory); after the stand-ins die the levels are the full run's again.

The proof, for two consecutive blocks X and Y (the last two of the region): the same ops on the
same shapes, no op that reads a value, and the same allocations and frees at the same positions,
of the same sizes, each free of a storage made at the same place relative to its block - in the
block itself, or the same number of blocks earlier in a region, with the same position there.
A free of anything else (a storage made before the region) cannot be continued by an untraced
block: no proof. Storages a region's first block leaves alive past the region are persistent;
those it frees within the region are not (their lifetime must be shorter than the region: the
caller traces enough micro-batches, more than a stage keeps in flight). A region whose proof
fails is not extended, and the caller traces every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .records import BACKWARD, FORWARD, StorageRecord, Trace

__all__ = ["ACTIONS", "Births", "Proof", "Region", "extend_regions", "prove_region",
           "repeating_regions"]

ACTIONS = (FORWARD, BACKWARD)     # the phases a schedule's compute actions are traced as
_READS_A_VALUE = torch.ops.aten._local_scalar_dense.default


@dataclass(frozen=True)
class Region:
    """Blocks of `period` consecutive segments (indices into Trace.segments), `count` of them from
    `start`, with the same phases and as many ops and events each."""

    start: int
    period: int
    count: int

    def block(self, k: int) -> range:
        first = self.start + k * self.period
        return range(first, first + self.period)

    @property
    def end(self) -> int:
        return self.start + self.count * self.period


def _signature(trace: Trace, s: int) -> tuple:
    seg = trace.segments[s]
    return seg.phase, seg.label, len(seg.ops), len(seg.events)


def repeating_regions(trace: Trace, segments: list[int], min_count: int = 3) -> list[Region]:
    """Maximal runs of at least `min_count` blocks of equal signatures among `segments` (one
    step's, consecutive), each with a compute action, found left to right, the shortest period
    first."""
    sig = [_signature(trace, s) for s in segments]
    out, i, n = [], 0, len(segments)
    while i < n:
        found = None
        for period in range(1, (n - i) // min_count + 1):
            if not any(sig[i + j][0] in ACTIONS for j in range(period)):
                continue
            count = 1
            while i + (count + 1) * period <= n and \
                    sig[i + count * period:i + (count + 1) * period] == sig[i:i + period]:
                count += 1
            if count >= min_count:
                found = Region(segments[i], period, count)
                break
        if found is None:
            i += 1
        else:
            out.append(found)
            i += found.count * found.period
    return out


def _span(trace: Trace, block: range) -> tuple[range, range]:
    segs = trace.segments
    first, last = segs[block.start], segs[block.stop - 1]
    return range(first.ops.start, last.ops.stop), range(first.events.start, last.events.stop)


@dataclass(frozen=True)
class Proof:
    """What extending a region needs: the last block's op and event ranges (its stand-ins are
    allocated before the first event), and its persistent storages (what each untraced block
    leaves alive past the region). Without a region: a run of ops of the step's own (the
    schedule's per-micro-batch setup) whose last op stands for the untraced ones."""

    region: Region | None
    ops: range
    events: range
    persistent: tuple      # storage ids, made in the last block


class Births:
    """Where each storage was allocated: event index, and the (region, block) it falls in."""

    def __init__(self, trace: Trace, regions: list[Region]):
        self.event = {}
        for e, (_, sid, delta) in enumerate(trace.events):
            if delta > 0 and sid not in self.event:
                self.event[sid] = e
        self.blocks = []   # (events range, region index, block index)
        for r, region in enumerate(regions):
            for k in range(region.count):
                self.blocks.append((_span(trace, region.block(k))[1], r, k))

    def place(self, sid: int):
        """(region index, block index, offset in the block's events), or None."""
        e = self.event.get(sid)
        if e is None:
            return None
        for events, r, k in self.blocks:
            if e in events:
                return r, k, e - events.start
        return None


def prove_region(trace: Trace, regions: list[Region], index: int, births=None,
                 back: int = 1) -> Proof | str:
    """Proof that region `index`'s blocks `back` and `back + 1` from its end are the same
    program (the module docstring), or why not. (back=2: the region's last block may free what
    the block after another region's end made - GPipe's last backward frees the last forward's
    activations, a forward whose sends differ from the others': the copies go in before it.)"""
    region = regions[index]
    if region.count < back + 2:
        return f"fewer than {back + 2} blocks"
    births = births or Births(trace, regions)
    xk, yk = region.count - back - 1, region.count - back
    x_ops, x_events = _span(trace, region.block(xk))
    y_ops, y_events = _span(trace, region.block(yk))
    ops = trace.ops
    for a, b in zip(ops[x_ops.start:x_ops.stop], ops[y_ops.start:y_ops.stop]):
        if a.func is _READS_A_VALUE:
            return f"{a.name} reads a value"
        if a.func != b.func or [t.shape for t in a.tensor_outputs()] != \
                [t.shape for t in b.tensor_outputs()] or \
                [t.shape for t in a.tensor_inputs()] != [t.shape for t in b.tensor_inputs()]:
            return f"op {a.name} of one block is {b.name} in the next"
    storages, events = trace.storages, trace.events
    for (xo, xs, xd), (yo, ys, yd) in zip(events[x_events.start:x_events.stop],
                                          events[y_events.start:y_events.stop]):
        sx, sy = storages[xs], storages[ys]
        if xo - x_ops.start != yo - y_ops.start or xd != yd or sx.nbytes != sy.nbytes \
                or sx.device != sy.device:
            return "the blocks allocate or free differently"
        if xd < 0:
            px, py = births.place(xs), births.place(ys)
            if px is None or py is None:
                return "a block frees a storage made before its region"
            # made at the same place relative to each block: the same region and position, as
            # many blocks before (or in another region, a block index as far from its own)
            if (px[0], px[1] - xk, px[2]) != (py[0], py[1] - yk, py[2]):
                return "the blocks free storages made in different places"
    persistent = _persistent(trace, region, y_events)
    if isinstance(persistent, str):
        return persistent
    return Proof(region, y_ops, y_events, persistent)


def _persistent(trace: Trace, region: Region, y_events: range) -> tuple | str:
    """The storages the last block makes that stand for one per block past the region: those
    whose counterpart in the region's first block is still alive when the region ends."""
    events = trace.events
    first_events = _span(trace, region.block(0))[1]
    region_end = _span(trace, region.block(region.count - 1))[1].stop
    freed_at = {}
    for e in range(first_events.start, len(events)):
        _, sid, delta = events[e]
        if delta < 0:
            freed_at.setdefault(sid, e)
    out = []
    made_first = [(e - first_events.start, events[e][1]) for e in first_events
                  if events[e][2] > 0]
    made_last = {e - y_events.start: events[e][1] for e in y_events if events[e][2] > 0}
    for offset, sid in made_first:
        if freed_at.get(sid, len(events)) < region_end:
            continue  # freed within the region: each block frees as many as it leaves
        last = made_last.get(offset)
        if last is None:
            return "the region's first and last blocks allocate differently"
        out.append(last)
    return tuple(out)


def extend_regions(trace: Trace, extensions: list) -> None:
    """Stand each proven region's last block for `extra` more blocks ([(Proof, extra)]): its ops
    run 1 + extra times, and each persistent storage gets `extra` stand-ins, allocated as the
    block starts and freed with it (the module docstring says why that keeps the peak)."""
    events, storages = trace.events, trace.storages
    freed_at = {}
    for e, (_, sid, delta) in enumerate(events):
        if delta < 0:
            freed_at.setdefault(sid, e)
    inserts: dict = {}   # event index -> events inserted before it
    runs: dict = {}      # (first op, end op) -> runs
    for proof, extra in extensions:
        if extra <= 0:
            continue
        span = (proof.ops.start, proof.ops.stop)
        runs[span] = runs.get(span, 1) + extra   # (an op may stand for k per micro-batch)
        at, op_at = proof.events.start, proof.ops.start
        for sid in proof.persistent:
            model = storages[sid]
            end = freed_at.get(sid)
            for _ in range(extra):
                stand_in = StorageRecord(len(storages), model.nbytes, model.device,
                                         model.created_by, set(model.roles), model.stream,
                                         model.resized_by)
                storages.append(stand_in)
                trace.stand_ins[stand_in.id] = sid
                owner = trace.storage_owner.get(sid)
                if owner is not None:
                    trace.storage_owner[stand_in.id] = owner
                inserts.setdefault(at, []).append((op_at, stand_in.id, +1))
                if end is not None:   # freed right after the storage it stands for
                    inserts.setdefault(end + 1, []).append((events[end][0], stand_in.id, -1))
    trace.repeated += [(first, end, n) for (first, end), n in runs.items()]
    if not inserts:
        return
    # inserts before event e belong with e: a block's stand-ins are allocated inside it
    out, new_index = [], []
    for e, event in enumerate(events):
        new_index.append(len(out))
        out.extend(inserts.get(e, ()))
        out.append(event)
    new_index.append(len(out))
    out.extend(inserts.get(len(events), ()))
    trace.events[:] = out
    trace.segments[:] = [replace(s, events=range(new_index[s.events.start],
                                                  new_index[s.events.stop]))
                         for s in trace.segments]
