"""Step 2 from step 1's records, for a program whose first step does more than the later ones
(a pipelined rank's step, distributed/pipeline.py; issue 35).

A pipelined step is `schedule.step(...)`, `optimizer.step()`, `zero_grad()`. Its first step does
two things no later step does: torch's schedule initialises its stages
(`_initialize_pp_stages`: each stage's receive buffers, one per micro-batch, kept for every later
step), and the optimizer makes its state. Tracing step 2 again cost ~40% of a pipelined 70B
candidate (docs/search.md). Instead, capture (capture/session.py) traces step 1 without its
gradient reset, then step 2's optimizer step alone, then the reset that ends both steps, and
step 2 is step 1's records less the blocks the program marked first-step-only
(`StepRuntime.first_step_only`, a FIRST_STEP_ONLY segment) and less step 1's optimizer step,
then its own optimizer step and the reset (analysis/steps.py `step_segments`). The built-in
step's step 2 is the same construction with nothing marked (capture/session.py `_trace_steps`).

The claim: step 2's ops, allocations and frees are exactly step 1's outside the marked blocks
and the optimizer step ("the repeated part"), in the same order, on the same storages and
shapes. Why, under the conditions below, each checked at run time (`why_not_repeated` before
step 2's optimizer step, `why_reset_differs` after the reset; capture traces step 2 in full
when one fails):

1. The marked blocks do not run again: the program says its first-step work is done
   (`StepProgram.first_step_done`; torch's `_initialize_pp_stages` returns before doing anything
   when the stages' forward and backward are initialised for the same backward mode), and each
   block was one segment (no phase opened inside it: all it ran is left out, nothing else).
2. The code of the repeated part takes the same path: it is a function of the program's
   objects, the model's modules and tensors, the inputs' shapes and the values it reads. The
   model holds the same tensors in the same storages and the same plain Python values after
   step 1 as before it (no cache built, no counter moved, no parameter replaced); no op of the
   repeated part reads a tensor's value; no input gathers a .grad; no data-dependent size was
   given for step 2's own calls. torch's schedules clear their per-step state when a step
   starts (`clear_runtime_states`, the losses), and 3 shows that none of it holds a tensor
   step 1 made.
3. The repeated part's memory is its own: every free in it is of a storage it made earlier, and
   every storage it made is freed inside it or is a gradient the reset frees. So when step 2's
   repeated part starts, the live storages are step 1's starting ones plus what the marked
   blocks and the optimizer left (the receive buffers, the optimizer state), which the
   repeated part neither makes nor frees: it allocates and frees as in step 1, and each level
   of step 2's timeline is step 1's level plus what those left (analysis/steps.py starts
   step 2's view from what step 1 left).
4. Step 1's optimizer step ends it (nothing of the repeated part after it) and frees only
   what it made, so step 2's optimizer step sees step 1's gradients, which are the tensors
   step 2's backward would have made (1-3), and step 2's traced optimizer step is the one
   that follows them.
5. After the reset (shared by both steps): it freed every storage the repeated part had left
   (3's gradients: no other tensor held one), and step 2 ran nothing but its optimizer step and
   the reset. This is known only once the reset ran, after step 2's optimizer step was
   recorded: capture() then runs the capture again with step 2 traced (`StepNotRepeated`).

Assumed, not checked: code that does more the first time it runs without the program marking
it. FSDP2's first unshard of each parameter group makes its all-gather outputs and the
unsharded parameters' views (`init_all_gather_outputs`, `init_unsharded_param`); a reused
step 2 keeps those ops, as the built-in step's step 2 does. They run no kernel and allocate
nothing (tests/test_pipeline_step2.py: step 2's allocations and frees, peaks, FLOPs equal the
traced step 2's), so only the op table counts them. A first-time path that allocated a
temporary would be counted in step 2 as well (one that keeps a storage fails 3).

Checked against the real multi-process gloo runs of tests/test_pipeline.py and
tests/test_pipeline_repeats.py (every schedule they cover: each rank's step-2 peak equal to the
real allocator's) and by tests/test_pipeline_step2.py (a reused step 2 against step 2 traced).
"""

from __future__ import annotations

import torch

from .records import FIRST_STEP_ONLY, OPTIMIZER, ZERO_GRAD, Trace

__all__ = ["StepNotRepeated", "why_not_repeated", "why_reset_differs", "nested_first_step"]

_READS_A_VALUE = torch.ops.aten._local_scalar_dense.default  # .item(), bool(t), int(t)


class StepNotRepeated(Exception):
    """Condition 5 failed once step 2's optimizer step and the reset were recorded: capture()
    runs the capture again with step 2 traced in full."""


def nested_first_step(trace: Trace, first: int) -> bool:
    """True if a phase opened inside a first-step-only block whose segments begin at `first`
    (the block's own segment and, when a phase was open around it, that phase's end before
    it): a segment of another label after the block's first one."""
    made = trace.segments[first:]
    at = next((i for i, s in enumerate(made) if s.label == FIRST_STEP_ONLY), None)
    return at is None or any(s.label != FIRST_STEP_ONLY for s in made[at:])


def why_not_repeated(trace: Trace, first: int, gradients: set) -> tuple[str | None, frozenset]:
    """Conditions 3 and 4 and the value reads of 2 on step 1's records from segment `first`
    (step 1's first; its optimizer step recorded, its gradient reset not yet): (why not, or
    None; the storages the repeated part left alive, all in `gradients`, the storage ids of the
    parameters' .grad now)."""
    ops, events = trace.ops, trace.events
    made: set = set()        # by the repeated part
    by_optimizer: set = set()
    left: set = set()        # made by the repeated part and alive
    stepped = False          # an optimizer step ran
    for seg in trace.segments[first:]:
        repeated = seg.phase != OPTIMIZER and seg.label != FIRST_STEP_ONLY
        stepped |= seg.phase == OPTIMIZER
        if repeated and stepped and (seg.ops or seg.events):
            return "an optimizer stepped before step 1's end (in a backward hook?)", frozenset()
        reads = next((i for i in seg.ops if ops[i].func is _READS_A_VALUE), None) \
            if repeated else None
        if reads is not None:
            return f"step 1 reads a tensor's value ({ops[reads].name})", frozenset()
        for i in seg.events:
            _, sid, delta = events[i]
            if delta > 0:
                if repeated:
                    made.add(sid)
                    left.add(sid)
                elif seg.phase == OPTIMIZER:
                    by_optimizer.add(sid)
            elif repeated:
                if sid not in made:
                    return ("step 1 frees a storage made before it or by its first-step work",
                            frozenset())
                left.discard(sid)
            elif seg.phase == OPTIMIZER:
                if sid not in by_optimizer:
                    return "step 1's optimizer step frees a storage it did not make", frozenset()
            elif sid in made:
                return "step 1's first-step work frees a storage of the repeated part", frozenset()
    if not left <= gradients:
        return (f"step 1 leaves {len(left - gradients)} storage(s) alive that are not "
                f"gradients"), frozenset()
    return None, frozenset(left)


def why_reset_differs(trace: Trace, step2_first: int, left: frozenset) -> str | None:
    """Condition 5, once step 2's optimizer step and the reset (its segments from `step2_first`)
    are recorded: the reset freed all of `left`, and step 2 ran nothing else."""
    freed = set()
    for seg in trace.segments[step2_first:]:
        if seg.label not in (OPTIMIZER, ZERO_GRAD) and (seg.ops or seg.events):
            return f"step 2 ran {len(seg.ops)} op(s) outside its optimizer step and reset"
        if seg.label == ZERO_GRAD:
            freed |= {trace.events[i][1] for i in seg.events if trace.events[i][2] < 0}
    if not left <= freed:
        return f"the gradient reset left {len(left - freed)} of step 1's storages alive"
    return None
