"""A tensor whose last reference a communication backend's thread drops: the real-run truth sees
when it was freed.

gloo's worker thread holds a collective's work object (and with it the collective's tensors) for a
moment after the wait returns; when the program has dropped its own references by then, the free
happens on that thread. c10's CPU memory reporter keeps its running total only on threads where
memory profiling is on, so such a free was neither an event nor taken off the total, and the
distributed truth (validate/distributed.py) counted the block live until its address came back:
under CPU load, FSDP's steady step came out one all-gather output (132,352 B) above the program's.
Truth here: the allocator's own events, on a thread the test controls (deterministic), and the
fake process group's collectives (inline, no backend thread of their own).
"""

import threading
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from tapescope.torch_compat import cpu_allocator_counts_every_thread, profiler_event_tree, \
    profiler_event_types
from tapescope.validate.real import _read_allocations


def _allocations(prof) -> list:
    """(bytes, allocator total after it) of every CPU allocation event, in time order; the total
    from its value before the first (the allocator's count is the process's: a block an earlier
    test's thread freed unseen stays in it)."""
    kind = profiler_event_types().Allocation
    out = []

    def walk(e):
        if e.tag == kind and e.extra_fields.device.type == "cpu":
            out.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
        for c in e.children:
            walk(c)

    for root in profiler_event_tree(prof):
        walk(root)
    out.sort()
    base = out[0][2] - out[0][1]
    return [(size, total - base) for _, size, total in out]


def _free_on_another_thread(holder: list) -> None:
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()


def _run(counted: bool) -> list:
    held = []
    with cpu_allocator_counts_every_thread() if counted else nullcontext(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1000)          # 4,000 B
        held.append(torch.empty(3000))  # 12,000 B, its last reference on another thread
        _free_on_another_thread(held)
        b = torch.empty(500)           # 2,000 B
        del a, b
    return _allocations(prof)


def test_a_free_on_an_unprofiled_thread_is_off_the_cpu_total_only_when_every_thread_counts():
    # c10's reporter: the other thread's free is no event, and the total keeps the 12,000 B
    assert _run(counted=False) == [(4000, 4000), (12000, 16000), (2000, 18000),
                                   (-4000, 14000), (-2000, 12000)]
    # every thread counted: still no event, but the total drops by the block at the next event
    assert _run(counted=True) == [(4000, 4000), (12000, 16000), (2000, 6000),
                                  (-4000, 2000), (-2000, 0)]


def test_the_flag_is_restored():
    with cpu_allocator_counts_every_thread() as on:
        assert on
    assert _run(counted=False)[2] == (2000, 18000)  # per-thread again


def _step_on_a_fake_rank(body):
    """The truth (validate/real.py) of one step that `body()` runs on rank 0 of torch's fake
    process group, with every thread's frees counted as validate/distributed.py counts them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with cpu_allocator_counts_every_thread(), profile(activities=[ProfilerActivity.CPU],
                                                          profile_memory=True, record_shapes=True) as prof:
            with record_function("tapescope::step1"):
                body()
        return _read_allocations(prof, torch.device("cpu"), program_only=True)
    finally:
        dist.destroy_process_group()


def _step_with_a_backend_held_tensor():
    """One step: the program all-reduces X (4,000 B) and drops it while a backend-like thread
    still holds it; that thread lets go; then the program makes Y (8,000 B). The program's peak
    is 8,000 B (X is gone before Y), and X's free was a backend thread's."""
    def body():
        held = []
        x = torch.ones(1000)
        dist.all_reduce(x)
        held.append(x)
        del x                        # the program's last reference
        _free_on_another_thread(held)
        y = torch.empty(2000)
        del y

    return _step_on_a_fake_rank(body)


def test_the_truth_times_a_collective_tensor_freed_by_a_backend_thread():
    """Without every thread counted, X stayed live in the truth until its address came back (if
    it ever did: the first test shows the total never drops), and the peak read 12,000 B."""
    real = _step_with_a_backend_held_tensor()
    assert real.peaks[1] == 8000
    assert real.late_frees == {1: 4000}


def test_of_equal_blocks_the_one_freed_in_sight_is_not_the_one_gone():
    """X1 and X2, equal, both all-reduced; a backend-like thread drops X2's last reference, so the
    total drops by one block of their size; the program then makes Y and frees X1 in sight. The
    drop is counted when it happens, and X1's own free tells that X2 was the one gone (taking the
    first block of the size, X1, left X2 live to the end): the peak is X1 + Y (12,000 B)."""
    def body():
        held = []
        x1, x2 = torch.ones(1000), torch.ones(1000)
        dist.all_reduce(x1)
        dist.all_reduce(x2)
        held.append(x2)
        del x2
        _free_on_another_thread(held)
        y = torch.empty(2000)
        del x1
        z = torch.empty(100)  # after X1's free
        del y, z

    real = _step_on_a_fake_rank(body)
    assert real.peaks[1] == 12000
    assert real.late_frees == {1: 4000}
    assert real.events[-1].live == 0


def test_the_blocks_of_one_collective_let_go_together_are_all_gone():
    """A work object holds all of its collective's tensors, and its worker thread lets go of them
    together: one drop of the total, the sum of the input (4,000 B) and output (8,000 B) of an
    all-gather, is both of them (FSDP+TP: the two chunks of a scatter's input)."""
    def body():
        held = []
        inp, out = torch.ones(1000), torch.empty(2000)
        dist.all_gather_into_tensor(out, inp)
        held += [inp, out]
        del inp, out
        _free_on_another_thread(held)
        y = torch.empty(4000)  # 16,000 B
        del y

    real = _step_on_a_fake_rank(body)
    assert real.peaks[1] == 16000
    assert real.late_frees == {1: 12000}
    assert real.events[-1].live == 0
