"""Run the same training step for real and read what the allocator says: the ground truth.

The step is the program tapescope traces (capture/program.py): the built-in `train_step`, or the
user's own `step=fn` with its `setup=`, run here with torch's own engine. Everything the step
touches (model copy, inputs, optimizer) is created inside `torch.profiler.profile(profile_memory=True)`,
so the allocator's own running total (`total_allocated` on each allocation event) covers all of it;
live bytes are that total minus its value before the first allocation.

Each allocation event keeps the aten op that made it, so a disagreement with the trace can be
followed to the op (see `real_allocations`).
"""

from __future__ import annotations

import copy
import gc
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

from ..native_logs import quiet_native_logs

from ..analysis.dispatch import decomposes_above_autograd
from ..capture.model import real_inputs
from ..options import resolve_dtype
from ..capture.program import BuiltinStep, StepRuntime, UserStep, steps_of

__all__ = ["RealStep", "Allocation", "run_real_steps"]


@dataclass(frozen=True)
class Allocation:
    step: int        # 0: setup
    phase: str | None
    op: str | None   # the innermost aten op that allocated (or freed)
    nbytes: int      # positive: allocation, negative: free
    live: int        # live bytes after this event
    top_op: int | None = None  # index in RealStep.ops of the dispatched op it happened in
    ptr: int | None = None     # the block's address: pairs an allocation with its free


@dataclass
class RealStep:
    peaks: dict = field(default_factory=dict)       # step -> peak live bytes
    events: list = field(default_factory=list)      # Allocation, in time order
    ops: list = field(default_factory=list)         # (step, phase, "aten::name"), in order
    # compiled steps: ("dynamo", [source of each graph input]) for each graph dynamo made, then
    # ("forward" | "backward", graph) for each partitioned graph compiled from it, in order
    compiled_graphs: list = field(default_factory=list)
    # step -> bytes of program allocations freed by another thread than the step's (program_only):
    # a backend thread dropped the last reference, at a moment that varies from run to run
    late_frees: dict = field(default_factory=dict)
    base: int = 0                                    # the allocator's total before the run
    # micro-batches run for real whose events were read and dropped (_Sessions): (step, index in
    # `ops` where they would stand, how many, each verified to repeat the micro-batch before)
    repeated: list = field(default_factory=list)

    def scratch_at_peak(self, step: int) -> tuple[int, str | None]:
        """Bytes alive at the step's peak that the op running then allocated and frees before
        it returns (a kernel's scratch, which a fake kernel does not allocate), and that op."""
        events = [e for e in self.events if e.step == step]
        peak = self.peaks.get(step)
        at = next((i for i, e in enumerate(events) if e.live == peak), None)
        if at is None:
            return 0, None
        top = events[at].top_op
        if top is None:
            return 0, None
        alive: dict = {}
        for e in events[:at + 1]:
            if e.nbytes > 0:
                alive[e.ptr] = e
            else:
                alive.pop(e.ptr, None)
        freed_by: dict = {}   # each block's first free after the peak: by which op
        for e in events[at + 1:]:
            if e.nbytes < 0:
                freed_by.setdefault(e.ptr, e.top_op)
        scratch = sum(a.nbytes for a in alive.values()
                      if a.top_op == top and freed_by.get(a.ptr, -1) == top)
        return scratch, self.ops[top][2]

    def merge(self, later: "RealStep", keep: bool, step: int) -> None:
        """Add a later profiler session's reading. keep=False: only its peaks, and its ops
        counted as repeats of the micro-batch before it when they are (else kept in full)."""
        for s, v in later.peaks.items():
            self.peaks[s] = max(self.peaks.get(s, v), v)
        for s, v in later.late_frees.items():
            self.late_frees[s] = self.late_frees.get(s, 0) + v
        if not keep:
            last = self._last_micro_batch(step)
            n = len(last)
            if n and len(later.ops) % n == 0 and all(
                    later.ops[i:i + n] == last for i in range(0, len(later.ops), n)):
                if self.repeated and self.repeated[-1][1] == len(self.ops):
                    s_, at, count = self.repeated[-1]
                    self.repeated[-1] = (s_, at, count + len(later.ops) // n)
                else:
                    self.repeated.append((step, len(self.ops), len(later.ops) // n))
                return
        shift = len(self.ops)
        self.ops += later.ops
        if keep:
            self.events += [replace(e, top_op=None if e.top_op is None else e.top_op + shift)
                            for e in later.events]

    def _last_micro_batch(self, step: int) -> list:
        """The ops of the last micro-batch read so far: from the last forward phase's start."""
        k = len(self.ops)
        while k > 0 and self.ops[k - 1][1] != "forward":
            k -= 1
        while k > 0 and self.ops[k - 1][1] == "forward" and self.ops[k - 1][0] == step:
            k -= 1
        return self.ops[k:]


def _build(model, device, dtype):
    if isinstance(model, nn.Module):
        m = copy.deepcopy(model)  # the user's model stays untouched
    else:
        with torch.device(device):
            m = model()
    m = m.to(device)
    if dtype is not None:
        m = m.to(dtype)
    return m


def run_real_steps(model, inputs=(), input_kwargs=None, *, loss_fn=None, optimizer="adamw",
                   device="cpu", dtype=None, amp=None, steps: int = 2, seed: int = 0,
                   compile=None, accumulate: int = 1, step=None, setup=None) -> RealStep:
    """Run `steps` real training steps on `device` (each of `accumulate` micro-batches) and
    return each step's peak live bytes.

    compile: True, a dict or options.CompileOptions: the model runs as
    `torch.compile(model, mode=..., fullgraph=..., dynamic=...)` (inductor, real kernels), with
    functorch's activation_memory_budget when given, and `optimizer.step` compiled when asked.
    step, setup: the user's own step `step(model, batch, optimizer)` and `setup(model)`, as
    `tapescope.profile` takes them (loss_fn and accumulate are then the step's business); its
    phases are marked as capture marks them.
    """
    device = torch.device(device)
    dtype, amp = resolve_dtype(dtype), resolve_dtype(amp)
    forward_context = (lambda: torch.autocast(device.type, dtype=amp)) if amp else None
    program = UserStep(step, setup, optimizer) if step is not None else \
        BuiltinStep(loss_fn, optimizer, accumulate)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # Garbage of earlier work (a traceback's frames holding tensors, say) must not be collected
    # during the run: its frees would count against this step's live bytes.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        real, graphs = _profiled_steps(program, model, inputs, input_kwargs, device, dtype,
                                       forward_context, steps, gen, activities, compile)
    finally:
        if was_enabled:
            gc.enable()
    real.compiled_graphs = graphs
    return real


class _Sessions:
    """The profiler over the whole run, in sessions: with gradient accumulation over N > 4
    micro-batches, the session is read and a new one begun after the third micro-batch, every
    EVERY micro-batches after it and before the last, so that the events held stay bounded (every
    micro-batch's events were kept: 0.7 s and 3.5 MB each, and --accumulate 20000 was killed at
    12.8 GB). Every micro-batch runs for real; the middle ones' sessions keep their peaks (the
    allocator's total is the same counter across sessions) and their ops only as a count of
    micro-batches verified to repeat the one before, op for op (`RealStep.repeated`)."""

    EVERY = 8

    def __init__(self, activities, device):
        self.activities, self.device = activities, device
        self.result: RealStep | None = None
        self.prof = None
        self.step = 0           # the step running now
        self.began_in = 0       # the step the current session began in
        self.detailed = True    # the current session's events are kept
        self.marker = None      # the open "tapescope::step{N}" record_function

    @contextmanager
    def step_marker(self, step: int):
        """The step's record_function, closed and opened again around each new session: a
        record_function must end in the session it began in (its end reaches the profiler's
        state of that session; one that outlived its session crashed the process)."""
        self.step = step
        self._open()
        try:
            yield
        finally:
            self._close()

    def _open(self) -> None:
        self.marker = record_function(f"tapescope::step{self.step}")
        self.marker.__enter__()

    def _close(self) -> None:
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None

    def start(self) -> None:
        # record_shapes: the recorded inputs tell an op's overload (and so how it is dispatched)
        self.prof = profile(activities=self.activities, profile_memory=True, record_shapes=True)
        self.prof.start()
        self.began_in = self.step

    def read(self) -> None:
        self.prof.stop()
        base = None if self.result is None else self.result.base
        got = _read_allocations(self.prof, self.device, step=self.began_in, base=base)
        # the profile object sits in reference cycles, and the garbage collector is off during
        # the run (run_real_steps): let go of its results by hand, or every session's events
        # stay (7 MB a micro-batch on a tiny GPT-2)
        inner = getattr(self.prof, "profiler", None)
        if inner is not None and hasattr(inner, "kineto_results"):
            inner.kineto_results = None
        self.prof.profiler = None
        self.prof = None
        if self.result is None:
            self.result = got
        else:
            self.result.merge(got, self.detailed, self.began_in)

    def micro_batch_done(self, i: int, n: int) -> bool:
        if n > 4 and (i == 3 or i == n - 1 or (i > 3 and (i - 3) % self.EVERY == 0)):
            self._close()
            self.read()
            self.detailed = i == n - 1  # the last micro-batch, the optimizer: read in full
            self.start()
            self._open()
        return False  # a real run never stops early


def _profiled_steps(program, model, inputs, input_kwargs, device, dtype, forward_context, steps,
                    gen, activities, compile):
    graphs: list = []
    sessions = _Sessions(activities, device)
    with quiet_native_logs():
        sessions.start()
        try:
            with record_function("tapescope::step0"):
                m = _build(model, device, dtype)
                args, kwargs = real_inputs((tuple(inputs), input_kwargs or {}), device, dtype,
                                           gen)
                state = program.setup(m, list(m.parameters()), device)
                m, state = _compiled(m, state, compile, graphs)

            def phase(step, name):
                return record_function(f"tapescope::phase::{name}")

            runtime = StepRuntime(phase=phase, micro_batch_done=sessions.micro_batch_done, **(
                {"forward_context": forward_context} if forward_context else {}))
            with _compile_config(compile), steps_of(program, runtime):
                for s in range(1, steps + 1):
                    with sessions.step_marker(s):
                        # zero_grad included: the phase "zero_grad", where the loss dies
                        program.run(m, args, kwargs, state, s, runtime)
        except BaseException:
            sessions.prof.stop()
            raise
        sessions.read()
    return sessions.result, graphs


def _compiled(model, opt, options, graphs: list):
    """The model (and optimizer.step) as torch.compile runs them, with inductor's real kernels.
    Each graph inductor compiles is appended to `graphs` as (kind, GraphModule)."""
    from ..options import CompileOptions

    options = CompileOptions.of(options)
    if options is None:
        return model, opt
    if options.backend == "inductor":
        # torch.compile(backend="inductor", mode=...) is compile_fx with the mode's config
        # patches; the same call, with an inner compile that keeps each partitioned graph
        from ..torch_compat import inductor_compilers, inductor_mode_options

        compile_fx, compile_fx_inner = inductor_compilers()

        def inner(gm, example_inputs, **kw):
            kind = "backward" if kw.get("is_backward") else (
                "inference" if kw.get("is_inference") else "forward")
            graphs.append((kind, gm))
            return compile_fx_inner(gm, example_inputs, **kw)

        patches = inductor_mode_options(options.mode, options.dynamic) if options.mode else {}

        def backend(gm, example_inputs):
            # compile_fx takes the graph over: keep what its inputs are (their sources) now
            graphs.append(("dynamo", [n.meta["grapharg"].source.name for n in gm.graph.nodes
                                      if n.op == "placeholder"]))
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
    else:
        backend = "aot_eager"
    # through a fresh code object, as tapescope compiles (capture/compiled.py, trampoline):
    # dynamo remembers the sizes each code saw ("automatic dynamic"), so compiling the model's
    # own forward a second time in one process, at other sizes, would trace it with symbolic
    # sizes; each real run is the first compile of its step, as in a fresh process
    from ..capture.compiled import trampoline

    step = torch.compile(trampoline(), backend=backend, fullgraph=options.fullgraph,
                         dynamic=options.dynamic)
    model = _CompiledCall(model, step)
    if opt is not None and options.optimizer:
        opt.step = torch.compile(opt.step, backend=backend)
    return model, opt


class _CompiledCall:
    """`model` called through a compiled trampoline; everything else (parameters, train(),
    zero_grad) is the model's own."""

    def __init__(self, model, step):
        self._model, self._step = model, step

    def __call__(self, *args, **kwargs):
        return self._step(self._model, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _compile_config(options):
    """functorch's config while compiling: the partitioner's activation_memory_budget."""
    from contextlib import nullcontext

    from ..options import CompileOptions

    options = CompileOptions.of(options)
    if options is None:
        return nullcontext()
    from ..torch_compat import compile_configs

    functorch_config = compile_configs()[0]
    # AOTAutograd's cache would skip the partitioner, and with it the graphs we keep
    patches = {"enable_autograd_cache": False}
    if options.activation_memory_budget is not None:
        patches["activation_memory_budget"] = options.activation_memory_budget
    return functorch_config.patch(**patches)


def _overload_name(name: str, inputs=()) -> str:
    """The profiler names ops without overload: the overload whose arguments match the recorded
    inputs (tensors where the schema has tensors; `min(a, b)` is min.other, `min(a)` min.default),
    else the default one."""
    packet = getattr(torch.ops.aten, name.split("::", 1)[1], None)
    if packet is None:
        return name
    names = packet.overloads()
    is_tensor = [type(i).__name__ == "_TensorMetadata" for i in inputs]
    for n in names:
        args = getattr(packet, n)._schema.arguments
        if inputs and len(args) == len(inputs) and all(
                t == isinstance(a.type, torch.TensorType) for a, t in zip(args, is_tensor)):
            return getattr(packet, n).name()
    return getattr(packet, "default" if "default" in names else names[0]).name()


def _read_allocations(prof, device: torch.device, program_only: bool = False, step: int = 0,
                      base: int | None = None) -> RealStep:
    """The allocator's events in time order, live bytes and each step's peak.

    program_only: count only the program's tensors: allocations made by the thread that runs the
    step outside a collective's call. A communication backend allocates staging buffers of its own
    (gloo copies a reduce-scatter's input and gathers into a buffer of its own, partly in its
    worker threads) and frees them when its work object dies, on whichever thread drops it last,
    sometimes where the profiler does not see it; the allocator's total includes them at moments
    that vary from run to run. A GPU backend (NCCL) allocates no tensors. Live bytes are then the
    running sum of the program's allocations and their frees, matched by address.

    step, base: for a profiler session begun inside a step (_Sessions): the step it began in
    (its marker opened before the session) and the allocator's total before the first session.
    """
    from ..torch_compat import profiler_event_tree, profiler_event_types

    _EventType = profiler_event_types()
    raw = []
    out = RealStep()

    step_threads = set()
    collectives = []  # (start, storages a collective read or wrote): record_shapes has them

    def walk(e, step, phase, inside_op):
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device.type:
                raw.append((e.start_time_ns, f.alloc_size, f.total_allocated, e,
                            inside_op if inside_op is not False else None, f.ptr))
        elif e.tag == _EventType.TorchOp:
            name = e.name
            if program_only and name.startswith(_COLLECTIVE_PREFIXES):
                collectives.append((e.start_time_ns, tuple(
                    ptr for i in e.extra_fields.inputs for t in (i if isinstance(i, list) else [i])
                    if (ptr := getattr(t, "storage_data_ptr", None)))))
            if name.startswith("tapescope::step"):
                step_threads.add(e.start_tid)
                step = int(name[len("tapescope::step"):])
            elif name.startswith("tapescope::phase::"):
                phase = name[len("tapescope::phase::"):]
            elif (name.startswith("aten::") and inside_op is False
                  and not decomposes_above_autograd(_overload_name(name, e.extra_fields.inputs),
                                                    device.type)):
                inside_op = len(out.ops)
                out.ops.append((step, phase, name))
        for c in e.children:
            walk(c, step, phase, inside_op)

    for root in profiler_event_tree(prof):
        walk(root, step, None, False)
    raw.sort(key=lambda r: r[0])
    if program_only:
        raw = _program_allocations(raw, step_threads, collectives)
    if not raw:
        out.base = base or 0
        walk = None  # noqa: F841 - the cycle through it, as below
        return out
    out.base = base = raw[0][2] - raw[0][1] if base is None else base
    level = {}
    running = 0
    first_step, phase = step, None
    for _, size, total, e, top, ptr in raw:
        if e is not None:
            step, phase, op = _context(e, first_step)
        if total is None:  # a free a backend thread made, at the step the program was in
            op = None
            out.late_frees[step] = out.late_frees.get(step, 0) - size
        running += size
        live = running if program_only else total - base
        out.events.append(Allocation(step, phase, op, size, live, top, ptr))
        out.peaks[step] = max(out.peaks.get(step, live), live)
        level.setdefault(step, live - size)
    # a step's peak is at least what was alive when it began
    for step, start in level.items():
        out.peaks[step] = max(out.peaks[step], start)
    # the profiler's events die now, while their session is alive: `walk` refers to itself (a
    # cycle that would keep `raw` for the garbage collector, which may run after the session is
    # gone, and an event outliving its session crashes the process)
    raw.clear()
    walk = None  # noqa: F841
    return out


_COLLECTIVE_PREFIXES = ("c10d::", "_c10d_functional::", "gloo:", "nccl:")


def _program_allocations(raw: list, threads: set, collectives: list) -> list:
    """The events of allocations the step's thread made outside a collective, and their frees.

    A collective's tensor can be freed by a backend thread the profiler does not follow. The
    allocator's running total shows it when it counts every thread (c10 counts only the threads
    memory profiling is on for; validate/distributed.py runs under
    torch_compat.cpu_allocator_counts_every_thread): between two recorded events the total
    changes by more than the second event's size. Such a drop of exactly the size of live program
    allocations that a collective used is the free of one of them (emitted with total None). When
    several have that size (tensor parallelism scatters equal weights), which one went is learnt
    later: not one the step's thread frees, but one whose address is handed out again (_Unseen).
    A drop that matches no one block can be several of one collective's, which its work object
    held and its worker thread let go of together (the chunks of a scatter's input).
    A drop that could as well be a block of gloo's own is left alone; a free never seen at all
    shows when its address is handed out again. Every free that did not happen on the step's
    thread is returned with total None (a late free).
    """
    unseen = _Unseen(collectives)
    out = []
    previous = None
    for r in raw:
        size, e = r[1], r[3]
        ptr = r[5]
        total = r[2]
        if previous is not None and total - size < previous:
            dropped = previous - (total - size)
            if unseen.dropped(dropped, r[0]):
                out.append((r[0], -dropped, None, None, None, None))
        previous = total
        if size > 0:
            if e.start_tid not in threads or _inside_collective(e):
                unseen.others[ptr] = size
                continue
            if ptr in unseen.mine and not unseen.reused(ptr):
                # its free happened where the profiler could not see it
                out.append((r[0], -unseen.mine.pop(ptr), None, None, None, ptr))
            unseen.mine[ptr] = size
            out.append(r)
        elif unseen.mine.get(ptr) == -size:
            unseen.freed(ptr)
            # freed by a backend thread the profiler follows: late all the same
            out.append(r if e.start_tid in threads else (r[0], size, None, None, None, ptr))
        elif unseen.others.get(ptr) == -size:
            del unseen.others[ptr]
    return out


class _Unseen:
    """The live blocks of a program-only reading, and which of them went unseen.

    mine: address -> size of a live program allocation; others: the same for allocations that are
    not the program's (a backend's, or made inside a collective's call). A drop in the allocator's
    total that matches k program blocks of one size is one of them gone: a group (addresses, how
    many of them are gone). A member freed in sight is not one of the gone; a member whose address
    is handed out again is; when as many members are left as are gone, all of them are."""

    RECENT = 4  # collectives before a drop whose blocks can be the work a worker thread let go
    MOST = 6    # blocks of one work looked at together (a scatter's input chunks: one a rank)

    def __init__(self, collectives: list):
        self.collectives = sorted(collectives)
        self.collective_ptrs = {p for _, ptrs in collectives for p in ptrs}
        self.mine: dict[int, int] = {}
        self.others: dict[int, int] = {}
        self.groups: list[list] = []  # [set of addresses, how many of them are gone]

    def dropped(self, nbytes: int, at: int) -> bool:
        """A drop of `nbytes` nobody reported, seen at time `at`: True if it is the free of
        program blocks."""
        if any(n == nbytes for n in self.others.values()):
            return False  # as well a block of the backend's own: no telling
        candidates = {p for p, n in self.mine.items() if n == nbytes and p in self.collective_ptrs}
        if not candidates:
            return self._one_work(nbytes, at)
        group = next((g for g in self.groups if g[0] & candidates), None)
        if group is None:
            group = [set(), 0]
            self.groups.append(group)
        group[0] |= candidates
        group[1] += 1
        self._settle(group)
        return True

    def _one_work(self, nbytes: int, at: int) -> bool:
        """Several live program blocks of one recent collective that sum to the drop: gone."""
        recent = [ptrs for start, ptrs in self.collectives if start <= at][-self.RECENT:]
        for ptrs in reversed(recent):
            live = sorted({p for p in ptrs if p in self.mine and not self._undecided(p)})
            for k in range(2, min(len(live), self.MOST) + 1):
                for combo in itertools.combinations(live, k):
                    if sum(self.mine[p] for p in combo) == nbytes:
                        for p in combo:
                            del self.mine[p]
                        return True
        return False

    def _undecided(self, ptr: int) -> bool:
        return any(ptr in group[0] for group in self.groups)

    def freed(self, ptr: int) -> None:
        """A program block freed in sight: not one of a group's gone."""
        del self.mine[ptr]
        for group in self.groups:
            if ptr in group[0]:
                group[0].discard(ptr)
                self._settle(group)
                return

    def reused(self, ptr: int) -> bool:
        """A live program block's address handed out again: True if its free was a group's drop
        (already counted)."""
        for group in self.groups:
            if ptr in group[0]:
                group[0].discard(ptr)
                group[1] -= 1
                del self.mine[ptr]
                self._settle(group)
                return True
        return False

    def _settle(self, group: list) -> None:
        if group[1] and len(group[0]) > group[1]:
            return  # still undecided
        if group[1]:
            for p in group[0]:  # every one left is gone
                self.mine.pop(p, None)
        self.groups.remove(group)


def _inside_collective(e) -> bool:
    p = e.parent
    while p is not None:
        if p.name.startswith(("c10d::", "gloo:", "nccl:")):
            return True
        p = p.parent
    return False


def _context(e, step: int = 0):
    phase, op = None, None
    p = e.parent
    while p is not None:
        name = p.name
        if name.startswith("tapescope::step"):
            step = int(name[len("tapescope::step"):])
            break
        if name.startswith("tapescope::phase::"):
            phase = phase or name[len("tapescope::phase::"):]
        elif op is None and name.startswith("aten::"):
            op = name
        p = p.parent
    return step, phase, op
