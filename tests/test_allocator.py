"""The caching-allocator emulation against numbers derived by hand from CUDACachingAllocator.cpp.

Each test names the C++ rule it checks; the sizes are worked through in its comments. No GPU is
needed: the truth is the source's arithmetic, not a run.
"""

import random
import time

import pytest

from tapescope.analysis.allocator import (AllocatorConfig, _CachingAllocator,
                                          _roundup_power2_next_division, allocation_size,
                                          round_size, simulate)

KiB, MiB = 1 << 10, 1 << 20


def _run(*steps, **kw):
    """Simulate `steps`: a size allocates under the step's index, `free(i)` frees step i's."""
    events = [(s[1], None) if isinstance(s, tuple) else (i, s) for i, s in enumerate(steps)]
    return simulate(events, **kw)


def free(index):
    return ("free", index)


# -- round_size / roundup_power2_next_division ----------------------------------------------------

def test_round_size_to_512_bytes():
    # round_size: below kMinBlockSize -> 512, else up to a multiple of 512
    assert round_size(1) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert round_size(10 * MiB + 1) == 10 * MiB + 512


def test_roundup_power2_divisions():
    # roundup_power2_next_division: the source comment's example, 1200 in 4 steps of [1024, 2048)
    assert _roundup_power2_next_division(1200, 4) == 1280
    four = AllocatorConfig(roundup_power2_divisions=4)
    # round_size only applies it when size > kMinBlockSize * divisions (2048): 1200 -> 1536
    assert round_size(1200, four) == 1536
    # 5 MiB + 1 lies in [4, 8) MiB: steps of 1 MiB -> 6 MiB; a power of two stays
    assert round_size(5 * MiB + 1, four) == 6 * MiB
    assert round_size(4 * MiB, four) == 4 * MiB
    assert round_size(MiB + 1, AllocatorConfig(roundup_power2_divisions=8)) == MiB + 128 * KiB


def test_roundup_power2_divisions_per_interval():
    # parseRoundUpPower2Divisions: [1:1,4:4,>:2] -> interval 0 (<2 MiB): 1, interval 1: 0,
    # interval 2 ([4, 8) MiB): 4, intervals 3.. (>= 8 MiB): 2
    cfg = AllocatorConfig.from_env("roundup_power2_divisions:[1:1,4:4,>:2]")
    assert cfg.roundup_power2_divisions == (1, 0, 4) + (2,) * 13
    assert round_size(3 * MiB + 1, cfg) == 3 * MiB + 512
    assert round_size(5 * MiB + 1, cfg) == 6 * MiB
    assert round_size(9 * MiB, cfg) == 12 * MiB     # [8, 16) MiB in 2 steps of 4 MiB


def test_allocation_size():
    # get_allocation_size: <= 1 MiB -> kSmallBuffer; < 10 MiB -> kLargeBuffer; else 2 MiB steps
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB) == 12 * MiB


# -- pools, segments, splitting -------------------------------------------------------------------

def test_small_requests_share_a_2mib_segment():
    # get_pool: <= kSmallSize -> small pool; one 2 MiB cudaMalloc, split (remainder >= 512)
    r = _run(1000, 1000)
    assert (r.allocated, r.requested, r.reserved) == (2048, 2000, 2 * MiB)
    assert (r.cuda_malloc_calls, r.segments) == (1, 1)


def test_small_segment_fills_exactly_then_a_new_one():
    # should_split (small pool): remainder 0 after the 4th 512 KiB block -> not split; 5th: new
    r = _run(*[512 * KiB] * 4)
    assert (r.reserved, r.cuda_malloc_calls) == (2 * MiB, 1)
    r = _run(*[512 * KiB] * 5)
    assert (r.reserved, r.cuda_malloc_calls, r.allocated) == (4 * MiB, 2, 5 * 512 * KiB)


def test_small_split_keeps_a_512_byte_remainder():
    # should_split (small pool): remaining >= kMinBlockSize. 1 MiB + (1 MiB - 512) leave exactly
    # 512 B of the 2 MiB segment, split off and then used by a 100 B request
    r = _run(MiB, MiB - 512, 100)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (2 * MiB, 2 * MiB, 1)


def test_mid_size_requests_share_a_20mib_segment():
    # get_allocation_size: (1, 10) MiB -> kLargeBuffer; the 14 MiB remainder serves the 2nd
    r = _run(3 * MiB, 3 * MiB)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (20 * MiB, 6 * MiB, 1)
    # 15 MiB does not fit the 14 MiB left: its own 16 MiB segment
    r = _run(3 * MiB, 3 * MiB, 15 * MiB)
    assert (r.reserved, r.cuda_malloc_calls) == (36 * MiB, 2)


def test_large_split_needs_more_than_1mib_left():
    # should_split (large pool): remaining > kSmallSize. 11 MiB -> 12 MiB segment, 1 MiB left:
    # not split, so allocated_bytes counts the whole 12 MiB block (block->size, not the request)
    r = _run(11 * MiB)
    assert (r.reserved, r.allocated, r.requested) == (12 * MiB, 12 * MiB, 11 * MiB)
    # 10.5 MiB -> 12 MiB segment, 1.5 MiB left: split; a 1.5 MiB request then fits it exactly
    r = _run(10 * MiB + 512 * KiB)
    assert (r.reserved, r.allocated) == (12 * MiB, 10 * MiB + 512 * KiB)
    r = _run(10 * MiB + 512 * KiB, MiB + 512 * KiB)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (12 * MiB, 12 * MiB, 1)


def test_best_fit():
    # get_free_block: lower_bound on (size, ...) -> the smallest cached block that fits.
    # Cached: 30, 24, 40 MiB. 22 -> 24, 26 -> 30, 35 -> 40: no new segment. Any other choice
    # would leave the 35 MiB request without a block and cost a 4th cudaMalloc.
    r = _run(30 * MiB, 24 * MiB, 40 * MiB, free(0), free(1), free(2),
             22 * MiB, 26 * MiB, 35 * MiB)
    assert (r.cuda_malloc_calls, r.reserved) == (3, 94 * MiB)
    # each split leaves > 1 MiB, so allocated counts the requests
    assert r.allocated == (22 + 26 + 35) * MiB


def test_free_merges_with_free_neighbours():
    # free_block / try_merge_blocks. Three 6 MiB blocks carve one 20 MiB segment: [6][6][6][2].
    # Freeing the 1st and 3rd gives free 6 and 6+2=8 (merged with the tail): a 14 MiB request
    # fits neither and gets its own segment. Freeing the middle merges all into 20 MiB, which
    # then serves a 20 MiB request without a 3rd cudaMalloc.
    r = _run(6 * MiB, 6 * MiB, 6 * MiB, free(0), free(2), 14 * MiB, free(5), free(1), 20 * MiB)
    assert r.cuda_malloc_calls == 2
    assert r.reserved == 34 * MiB
    assert r.allocated == 20 * MiB


def test_freed_block_reused_by_smaller_request():
    # get_free_block + should_split: a cached 50 MiB block serves 40 MiB, 10 MiB stays cached
    r = _run(50 * MiB, free(0), 40 * MiB)
    assert (r.cuda_malloc_calls, r.reserved, r.allocated) == (1, 50 * MiB, 40 * MiB)


# -- max_split_size -------------------------------------------------------------------------------

def test_max_split_size_keeps_oversize_blocks_for_oversize_requests():
    cfg = AllocatorConfig(max_split_size=40 * MiB)
    # get_free_block: a 30 MiB request may not take the cached 100 MiB block (>= max_split_size)
    r = _run(100 * MiB, free(0), 30 * MiB, config=cfg)
    assert (r.reserved, r.cuda_malloc_calls) == (130 * MiB, 2)
    # ... a 90 MiB one may (100 < 90 + max_non_split_rounding 20), whole: oversize never splits
    r = _run(100 * MiB, free(0), 30 * MiB, 90 * MiB, config=cfg)
    assert (r.reserved, r.allocated) == (130 * MiB, 130 * MiB)
    # ... a 79 MiB one may not (100 >= 79 + 20): its own 80 MiB segment
    r = _run(100 * MiB, free(0), 79 * MiB, config=cfg)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (180 * MiB, 80 * MiB, 2)
    # the edge: 100 >= 80 + 20 refuses as well
    assert _run(100 * MiB, free(0), 80 * MiB, config=cfg).cuda_malloc_calls == 2
    # max_non_split_rounding_mb:30 widens that tolerance: 100 < 79 + 30
    wide = AllocatorConfig.from_env("max_split_size_mb:40,max_non_split_rounding_mb:30")
    r = _run(100 * MiB, free(0), 79 * MiB, config=wide)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (100 * MiB, 100 * MiB, 1)


def test_max_split_size_stops_splitting():
    # should_split: size >= max_split_size -> never split. 44.5 MiB -> 46 MiB segment, 1.5 MiB left
    assert _run(44 * MiB + 512 * KiB).allocated == 44 * MiB + 512 * KiB
    r = _run(44 * MiB + 512 * KiB, config=AllocatorConfig(max_split_size=40 * MiB))
    assert r.allocated == 46 * MiB


# -- capacity: flush and retry, OOM ---------------------------------------------------------------

def test_flush_cache_and_retry_when_cudamalloc_fails():
    # malloc: alloc_block fails (60 cached + 70 > 100) -> release_cached_blocks -> retry
    r = _run(60 * MiB, free(0), 70 * MiB, capacity_bytes=100 * MiB)
    assert not r.oom
    assert (r.cache_flushes, r.cuda_free_calls, r.cuda_malloc_calls) == (1, 1, 2)
    assert (r.reserved, r.max_reserved) == (70 * MiB, 70 * MiB)
    assert r.reserved_timeline == [60 * MiB, 60 * MiB, 70 * MiB]


def test_release_available_cached_blocks_frees_just_one_oversize_block():
    # release_available_cached_blocks: with max_split_size 40 MiB, a 50 MiB request (after
    # get_free_block refused the cached 80 MiB block: 80 >= 50 + 20) frees that block alone and
    # retries; the 16 MiB one stays cached and no full flush happens.
    cfg = AllocatorConfig(max_split_size=40 * MiB)
    r = _run(80 * MiB, 16 * MiB, free(0), free(1), 50 * MiB, capacity_bytes=100 * MiB, config=cfg)
    assert (r.cache_flushes, r.cuda_free_calls, r.reserved) == (0, 1, 66 * MiB)
    # without max_split_size the 80 MiB block is simply split for the request
    r = _run(80 * MiB, 16 * MiB, free(0), free(1), 50 * MiB, capacity_bytes=100 * MiB)
    assert (r.cuda_malloc_calls, r.reserved, r.allocated) == (2, 96 * MiB, 50 * MiB)


def test_oom_when_flushing_is_not_enough():
    # malloc: still no block after release_cached_blocks -> OutOfMemoryError (recorded, skipped)
    r = _run(60 * MiB, 60 * MiB, free(1), 30 * MiB, capacity_bytes=100 * MiB)
    assert r.oom and not r.fits
    assert (r.first_oom_event, r.num_ooms, r.cache_flushes) == (1, 1, 1)
    assert r.allocated_timeline == [60 * MiB, 60 * MiB, 60 * MiB, 90 * MiB]


def test_memory_fraction_caps_the_allocator():
    # alloc_block: total_allocated_memory + size > allowed_memory_maximum -> fail
    cfg = AllocatorConfig(per_process_memory_fraction=0.5)
    assert _run(120 * MiB, capacity_bytes=200 * MiB, config=cfg).oom
    assert not _run(100 * MiB, capacity_bytes=200 * MiB, config=cfg).oom


def test_garbage_collection_frees_old_blocks_before_cudamalloc():
    # garbage_collect_cached_blocks (needs a memory fraction): allowed 100 MiB, threshold 50 MiB.
    # At the 70 MiB request 100 MiB is held; cached blocks are 40 MiB (idle 2 get_free_block
    # calls) and 60 MiB (idle 1): the average age 1.5 frees the 40, then 1.0 frees the 60, and
    # the 70 MiB cudaMalloc succeeds without a cache flush.
    events = (40 * MiB, free(0), 60 * MiB, free(2), 70 * MiB)
    gc = AllocatorConfig(per_process_memory_fraction=0.5, garbage_collection_threshold=0.5)
    r = _run(*events, capacity_bytes=200 * MiB, config=gc)
    assert (r.cache_flushes, r.cuda_free_calls, r.reserved, r.max_reserved) == (
        0, 2, 70 * MiB, 100 * MiB)
    # without GC the same request fails once and flushes the whole cache
    no_gc = AllocatorConfig(per_process_memory_fraction=0.5)
    r = _run(*events, capacity_bytes=200 * MiB, config=no_gc)
    assert (r.cache_flushes, r.cuda_free_calls, r.reserved) == (1, 2, 70 * MiB)


# -- expandable segments --------------------------------------------------------------------------

def test_expandable_segments_grow_by_pages():
    cfg = AllocatorConfig(expandable_segments=True)
    # try_allocate_expandable_block / map_block: 3 MiB maps one 20 MiB page of a new segment;
    # 30 MiB grows the 17 MiB free tail by one more page (40 MiB mapped, where cudaMalloc
    # segments would hold 20 + 30 = 50 MiB); should_split keeps any remainder >= 512 B.
    r = _run(3 * MiB, 30 * MiB, config=cfg)
    assert (r.reserved, r.allocated, r.cuda_malloc_calls) == (40 * MiB, 33 * MiB, 2)
    assert (r.expandable_segments, r.segments) == (1, 0)
    assert _run(3 * MiB, 30 * MiB).reserved == 50 * MiB
    # a 7 MiB request takes the 7 MiB left exactly; a small one opens a 2 MiB-page segment
    r = _run(3 * MiB, 30 * MiB, 7 * MiB, 1000, config=cfg)
    assert (r.reserved, r.allocated, r.expandable_segments) == (42 * MiB, 40 * MiB + 1024, 2)


def test_expandable_segments_unmap_on_flush():
    # 50 MiB maps three 20 MiB pages (60 MiB = capacity). A small request then cannot map its
    # 2 MiB page; release_cached_blocks unmaps the free pages (unmap_block) and drops the empty
    # large segment (release_expandable_segment), and the retry maps the page.
    cfg = AllocatorConfig(expandable_segments=True)
    r = _run(50 * MiB, free(0), 1000, capacity_bytes=60 * MiB, config=cfg)
    assert not r.oom
    assert r.reserved_timeline == [60 * MiB, 60 * MiB, 2 * MiB]
    assert (r.cache_flushes, r.cuda_free_calls, r.expandable_segments) == (1, 1, 1)


def test_expandable_segments_avoid_fragmentation_oom():
    # A 100 MiB segment carved into [45 free][45 live][10 free]: cudaMalloc segments cannot give
    # back a split segment (release_blocks frees only unsplit ones), so a 60 MiB request needs
    # 100 + 60 > 150 MiB and OOMs with 45 MiB allocated.
    events = (100 * MiB, free(0), 45 * MiB, 45 * MiB, free(2), 60 * MiB)
    r = _run(*events, capacity_bytes=150 * MiB)
    assert (r.oom, r.first_oom_event, r.allocated) == (True, 5, 45 * MiB)
    # Expandable: growing the 10 MiB tail by three 20 MiB pages fails first (160 > 150), then
    # unmap_block returns the two whole pages under the free 45 MiB block, and the retry fits.
    r = _run(*events, capacity_bytes=150 * MiB, config=AllocatorConfig(expandable_segments=True))
    assert not r.oom
    assert (r.reserved, r.allocated, r.cache_flushes, r.cuda_free_calls) == (
        120 * MiB, 105 * MiB, 1, 1)


# -- configuration string -------------------------------------------------------------------------

def test_from_env():
    cfg = AllocatorConfig.from_env("expandable_segments:True,max_split_size_mb:128")
    assert cfg.expandable_segments and cfg.max_split_size == 128 * MiB
    cfg = AllocatorConfig.from_env(
        "garbage_collection_threshold:0.6, roundup_power2_divisions:4,backend:native,"
        "pinned_use_cuda_host_register:True")
    assert cfg.garbage_collection_threshold == 0.6
    assert cfg.roundup_power2_divisions == (4,) * 16
    # parseRoundUpPower2Divisions: the first interval also fills those below it, '>' the rest
    cfg = AllocatorConfig.from_env("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert cfg.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert AllocatorConfig.from_env("") == AllocatorConfig()


@pytest.mark.parametrize("bad", [
    "max_split_size_mb:10",                 # parseMaxSplitSize: must be >= 20 (kLargeBuffer)
    "garbage_collection_threshold:1.5",     # must be in (0, 1)
    "roundup_power2_divisions:3",           # power of 2
    "expandable_segments:yes",
    "backend:cudaMallocAsync",              # a different allocator, not modelled
    "no_such_option:1",
    "max_split_size_mb",
])
def test_from_env_rejects(bad):
    with pytest.raises(ValueError):
        AllocatorConfig.from_env(bad)


# -- sequence handling ----------------------------------------------------------------------------

def test_zero_bytes_allocate_nothing():
    # NativeCachingAllocator::allocate: size 0 -> no malloc, null pointer; freeing it is a no-op
    r = simulate([("a", 0), ("b", 100), ("a", None)])
    assert r.allocated_timeline == [0, 512, 512]
    assert r.reserved_timeline == [0, 2 * MiB, 2 * MiB]


def test_bad_sequences():
    with pytest.raises(ValueError):
        simulate([("a", None)])
    with pytest.raises(ValueError):
        simulate([("a", 1), ("a", 1)])


# -- invariants on random sequences ---------------------------------------------------------------

def _random_events(rng, n, max_live=64, streams=1):
    live, events, key = [], [], 0
    for _ in range(n):
        if live and (len(live) >= max_live or rng.random() < 0.45):
            events.append((live.pop(rng.randrange(len(live))), None))
        else:
            # log-uniform sizes from 1 B to 256 MiB: both pools, all get_allocation_size branches
            size = int(2 ** rng.uniform(0, 28))
            events.append((key, size) if streams == 1 else (key, size, rng.randrange(streams)))
            live.append(key)
            key += 1
    return events, live


def _check_structure(alloc, live_blocks):
    """Blocks tile their segments; free neighbours are merged; counters match the blocks."""
    blocks = list(live_blocks)
    for pool in (alloc.small, alloc.large):
        blocks += [pool.by_addr[k[-1]] for k in pool.keys]
        blocks += [pool.unmapped_by_addr[a[-1]] for a in pool.unmapped]
    assert len({id(b) for b in blocks}) == len(blocks)
    mapped = allocated = heads = 0
    for b in blocks:
        if b.next is not None:
            assert b.next.prev is b and b.addr + b.size == b.next.addr
            # try_merge_blocks leaves no two free blocks of the same kind side by side
            assert b.allocated or b.next.allocated or b.mapped != b.next.mapped
        mapped += b.size if b.mapped else 0
        allocated += b.size if b.allocated else 0
        heads += b.prev is None and b.segment is None
    assert mapped == alloc.reserved          # reserved is the sum of the segments' mapped bytes
    assert allocated == alloc.allocated
    assert heads == alloc.segments


CONFIGS = {
    "default": (AllocatorConfig(), None),
    "max_split": (AllocatorConfig(max_split_size=64 * MiB), None),
    "roundup": (AllocatorConfig(roundup_power2_divisions=4), None),
    "expandable": (AllocatorConfig(expandable_segments=True), None),
    "tight": (AllocatorConfig(max_split_size=32 * MiB), 1024 * MiB),
    "tight_expandable": (AllocatorConfig(expandable_segments=True), 1024 * MiB),
    "gc": (AllocatorConfig(per_process_memory_fraction=0.8, garbage_collection_threshold=0.5),
           1024 * MiB),
}


@pytest.mark.parametrize("streams", (1, 3))
@pytest.mark.parametrize("name", CONFIGS)
def test_random_structure(name, streams):
    cfg, capacity = CONFIGS[name]
    rng = random.Random(name)
    events, _ = _random_events(rng, 1500, streams=streams)
    alloc, live = _CachingAllocator(cfg, capacity), {}
    for key, nbytes, *on in events:
        if nbytes is None:
            block = live.pop(key)
            if block is not None:
                alloc.free(block)
        else:
            live[key] = alloc.malloc(nbytes, *on)
            assert live[key] is None or live[key].stream == (on[0] if on else 0)
        _check_structure(alloc, [b for b in live.values() if b is not None])
        if capacity is not None:
            assert alloc.total <= capacity
    for block in live.values():
        if block is not None:
            alloc.free(block)
    _check_structure(alloc, [])
    assert alloc.allocated == 0
    if not cfg.expandable_segments:
        # everything freed: each cudaMalloc segment has merged back into one unsplit block,
        # so release_cached_blocks can give all of it back
        alloc._release_cached_blocks()
        assert alloc.reserved == 0 and alloc.segments == 0


@pytest.mark.parametrize("name", CONFIGS)
def test_random_invariants(name):
    cfg, capacity = CONFIGS[name]
    rng = random.Random(name + "!")
    events, live = _random_events(rng, 5000)
    events += [(k, None) for k in live]                 # free everything at the end
    r = simulate(events, capacity, cfg)
    assert all(a <= s for a, s in zip(r.allocated_timeline, r.reserved_timeline))
    assert r.allocated == 0 and r.requested == 0
    assert r.max_allocated == max(r.allocated_timeline)
    assert r.max_requested <= r.max_allocated          # blocks are never smaller than requests
    if capacity is None:
        assert r.max_reserved == max(r.reserved_timeline)
        assert not r.oom
    else:
        assert r.max_reserved <= capacity
        assert r.max_reserved >= max(r.reserved_timeline)
    assert 0.0 <= r.fragmentation < 1.0


def test_speed_100k_events():
    rng = random.Random(0)
    events, _ = _random_events(rng, 100_000, max_live=2000)
    start = time.perf_counter()
    r = simulate(events)
    elapsed = time.perf_counter() - start
    assert len(r.reserved_timeline) == 100_000
    assert elapsed < 2.0, elapsed


def test_expandable_best_fit_prefers_blocks_that_cannot_grow():
    # get_free_block: an expandable block's size counts with the unmapped pages after it, so a
    # later, larger free block that cannot grow wins over the free tail of the segment.
    # [a 10][b 10] fill one page, c maps a second: [a][b][c 12][8 free][unmapped]; freeing a
    # leaves free 10 (inner) and 8 (tail). 6 MiB goes to the inner block (4 left), so 9 MiB
    # finds no block and grows the tail by a page: 60 MiB reserved. (Plain best fit would have
    # put 6 in the tail and 9 in the inner 10.)
    cfg = AllocatorConfig(expandable_segments=True)
    r = _run(10 * MiB, 10 * MiB, 12 * MiB, free(0), 6 * MiB, 9 * MiB, config=cfg)
    assert r.reserved_timeline == [20 * MiB] * 2 + [40 * MiB] * 3 + [60 * MiB]


def test_fragmentation_is_measured_at_the_allocated_peak():
    """A step frees its large blocks (cached, still reserved), then a small request takes a new
    2 MiB small-pool segment: reserved reaches its maximum with 1 KiB allocated. Fragmentation
    is taken when allocated memory peaks (100 MiB in a 100 MiB segment: 0), not at that event
    (which would say 1 - 1024 / 102 MiB, 0.99: the FSDP 128 report of issue 20)."""
    mib = 1 << 20
    r = simulate([("act", 100 * mib), ("act", None), ("state", 1000)])
    assert r.max_reserved == 102 * mib and r.max_allocated == 100 * mib
    assert r.fragmentation == 0.0
    # a real gap: 3 MiB in the 20 MiB segment a 1-10 MiB request gets
    r = simulate([("a", 3 * mib)])
    assert r.fragmentation == pytest.approx(1 - 3 / 20)


# ---- streams: a freed block is reused only on the stream it was allocated on -----------------
# CUDACachingAllocator.cpp: "Allocations are associated with a stream. Once freed, blocks can be
# re-allocated on the same stream, but not on any other stream" (BlockComparatorSize orders by
# stream first; get_free_block: `(*it)->stream != p.stream()` -> no block). Figures by hand from
# the size rules: 3 MiB rounds to a 20 MiB segment (kLargeBuffer), 200 KiB to a 2 MiB one.

def test_a_block_freed_on_one_stream_is_not_reused_on_another():
    one = simulate([("a", 3 * MiB, 1), ("a", None), ("b", 3 * MiB, 0)])
    assert one.max_reserved == 40 * MiB and one.segments == 2     # a second 20 MiB segment
    same = simulate([("a", 3 * MiB, 1), ("a", None), ("b", 3 * MiB, 1)])
    assert same.max_reserved == 20 * MiB and same.segments == 1   # reused on its stream
    small = simulate([("a", 200 * 1024, 2), ("a", None), ("b", 200 * 1024)])
    assert small.max_reserved == 4 * MiB                           # small pool: per stream too


def test_expandable_segments_grow_per_stream():
    cfg = AllocatorConfig(expandable_segments=True)
    r = simulate([("a", 30 * MiB, 1), ("a", None), ("b", 30 * MiB, 0)], None, cfg)
    # each stream maps its own 20 MiB pages: 40 MiB on stream 1, then 40 more on stream 0
    assert r.max_reserved == 80 * MiB and r.expandable_segments == 2


def test_an_oom_flush_frees_every_streams_cache():
    # release_cached_blocks frees every unsplit cached segment, of any stream, then retries
    r = simulate([("a", 60 * MiB, 1), ("a", None), ("b", 60 * MiB, 0)], 100 * MiB)
    assert not r.oom and r.cache_flushes == 1 and r.reserved == 60 * MiB
