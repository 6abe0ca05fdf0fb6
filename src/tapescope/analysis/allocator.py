"""PyTorch's CUDA caching allocator, replayed in Python over a step's allocations and frees.

Given the ordered `(key, nbytes)` allocations and `(key, None)` frees of a step, `simulate`
predicts what `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` would report and
whether the step fits in `capacity_bytes` of device memory.

It follows `c10/cuda/CUDACachingAllocator.cpp` rule by rule; each rule names the C++ function it
comes from. Sources read: pytorch/pytorch 001074d25084 (CUDACachingAllocator.cpp) and 01f9ef32eae5
(CUDAAllocatorConfig.cpp), and the newest main as mirrored in cyyever/pytorch 076f02792ce5
(CUDACachingAllocator.cpp) / 106319cb5704 (c10/core/AllocatorConfig.cpp), whose rules win where they
differ (`max_non_split_rounding_mb`, `large_segment_size_mb`, the registration-counter tie-break,
skipping expandable blocks when releasing cached blocks).

Streams: every allocation is made on a stream (the current one when it is requested), and a freed
block is reused only by requests on that same stream ("Allocations are associated with a stream.
Once freed, blocks can be re-allocated on the same stream, but not on any other stream": the
file's header; BlockComparatorSize orders blocks by stream first, get_free_block returns no block
whose stream differs, release_available_cached_blocks frees only the requesting stream's,
find_expandable_block grows only a segment of its stream). A single-GPU step runs on one stream;
FSDP2's all-gather copy-in and reduce-scatter streams allocate their buffers on their own, so
their freed blocks stay cached beside the compute stream's: reserved memory a one-pool replay
would miss. release_cached_blocks (before an OOM) and the garbage collector free every stream's.

What it deliberately leaves out: cross-stream events/record_stream (a block used on another
stream is freed only once that stream's work is done), CUDA-graph private
pools and mempools, free-memory callbacks, IPC, and the cudaMallocAsync backend. Device memory
outside the allocator (the CUDA context, NCCL, other processes) is the caller's to subtract from
`capacity_bytes`.

    >>> r = simulate([("a", 1000), ("b", 3 << 20), ("a", None)])
    >>> r.max_allocated, r.max_reserved      # 1024 + 3 MiB in blocks; 2 MiB + 20 MiB segments
    (3146752, 23068672)
    >>> simulate([("a", 3 << 20, 1), ("a", None), ("b", 3 << 20)]).max_reserved   # two streams
    41943040
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from ..values.allocator import INTERVALS as _INTERVALS
from ..values.allocator import (K_LARGE_BUFFER, K_MIN_LARGE_ALLOC, AllocatorConfig,  # noqa: F401
                                config_syntax_error)

__all__ = ["AllocatorConfig", "AllocatorReport", "simulate", "round_size", "allocation_size"]

_MB = 1 << 20
K_MIN_BLOCK_SIZE = 512          # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = _MB              # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * _MB        # "small" allocations are packed in 2 MiB segments
K_ROUND_LARGE = 2 * _MB         # larger allocations are rounded up to 2 MiB
_SIZE_MAX = (1 << 64) - 1       # std::numeric_limits<size_t>::max(): "no max_split_size"

# ExpandableSegment reserves address space for 9/8 of the GPU's memory; with no capacity given,
# use the 256 TiB address space the source's note mentions, which never runs out.
_UNBOUNDED_DEVICE = 1 << 48


# -- size rules -----------------------------------------------------------------------------------

def _divisions_for(size: int, config: AllocatorConfig) -> int:
    # AcceleratorAllocatorConfig::roundup_power2_divisions(size): interval index = log2(size) - 20
    index = min(max(size.bit_length() - 1 - 20, 0), _INTERVALS - 1)
    return config.roundup_power2_divisions[index]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # roundup_power2_next_division: round up to the next of `divisions` equal steps between
    # the powers of two around size (1200 with 4 divisions of [1024, 2048) -> 1280)
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(nbytes: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """Block size for a request: `DeviceCachingAllocator::round_size`."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = _divisions_for(nbytes, config)
    if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(nbytes, divisions)
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int, config: AllocatorConfig = AllocatorConfig()) -> int:
    """Segment size cudaMalloc'd for a rounded request no cached block can serve:
    `DeviceCachingAllocator::get_allocation_size`."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


# -- allocator state ------------------------------------------------------------------------------

class _Block:
    """A Block: a piece of a segment, free or allocated, linked to its neighbours."""

    __slots__ = ("size", "addr", "counter", "pool", "segment", "mapped", "allocated", "requested",
                 "prev", "next", "gc_base", "stream")

    def __init__(self, size, addr, counter, pool, segment=None, mapped=True, stream=0):
        self.size, self.addr, self.counter, self.pool = size, addr, counter, pool
        self.stream = stream                             # the stream it was allocated on
        self.segment, self.mapped = segment, mapped      # segment: the ExpandableSegment, if any
        self.allocated, self.requested = False, 0
        self.prev = self.next = None
        self.gc_base = 0

    def is_split(self):
        return self.prev is not None or self.next is not None

    def splice(self, before, after):     # Block::splice
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


def _allocatable(b):
    return b is not None and not b.allocated


def _expandable_size(b):
    # get_free_block: a block followed by unmapped pages can grow into them
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


class _Pool:
    """BlockPool: free mapped blocks ordered by stream, then as BlockComparatorSizeCounterAddress
    (size, then the segment's registration counter, then address), unmapped ones by stream and
    address (BlockComparatorAddress)."""

    __slots__ = ("is_small", "keys", "by_addr", "unmapped", "unmapped_by_addr", "calls")

    def __init__(self, is_small):
        self.is_small = is_small
        self.keys: list = []            # sorted (stream, size, counter, addr)
        self.by_addr: dict = {}
        self.unmapped: list = []        # sorted (stream, addr)
        self.unmapped_by_addr: dict = {}
        self.calls = 0                  # get_free_blocks_call_count, the GC clock

    def insert(self, b):                # BlockPool::insert_into_blocks
        b.gc_base = self.calls
        bisect.insort(self.keys, (b.stream, b.size, b.counter, b.addr))
        self.by_addr[b.addr] = b

    def erase(self, b):                 # must run before b.size or b.addr change
        del self.keys[bisect.bisect_left(self.keys, (b.stream, b.size, b.counter, b.addr))]
        del self.by_addr[b.addr]

    def at(self, i):
        return self.by_addr[self.keys[i][3]]

    def insert_unmapped(self, b):
        bisect.insort(self.unmapped, (b.stream, b.addr))
        self.unmapped_by_addr[b.addr] = b

    def erase_unmapped(self, b):
        del self.unmapped[bisect.bisect_left(self.unmapped, (b.stream, b.addr))]
        del self.unmapped_by_addr[b.addr]

    def erase_any(self, b):
        (self.erase if b.mapped else self.erase_unmapped)(b)


@dataclass
class _ExpandableSegment:
    """ExpandableSegment: a reserved address range backed page by page (2 MiB pages for the small
    pool, large_segment_size pages for the large one)."""

    base: int
    page: int
    pages: int


class _CachingAllocator:
    """DeviceCachingAllocator for one device and one stream."""

    def __init__(self, config: AllocatorConfig, capacity: int | None):
        self.cfg, self.capacity = config, capacity
        self.max_split = _SIZE_MAX if config.max_split_size is None else config.max_split_size
        self.max_rounding = (config.large_segment_size if config.max_non_split_rounding_size is None
                             else config.max_non_split_rounding_size)
        self.allowed = None             # allowed_memory_maximum: setMemoryFraction, fraction < 1
        if capacity is not None and config.per_process_memory_fraction < 1.0:
            # std::round: halves away from zero (Python's round() would go to even)
            self.allowed = math.floor(config.per_process_memory_fraction * capacity + 0.5)
        self.gc = self.allowed is not None and (config.garbage_collection_threshold or 0) > 0
        self.small, self.large = _Pool(True), _Pool(False)
        self.total = 0                  # total_allocated_memory: bytes obtained from CUDA
        self.next_addr = 0              # synthetic address space; never reused
        self.counter = -1               # registration_counter_global
        self.expandable: list = []
        self.allocated = self.reserved = self.requested = 0
        self.max_allocated = self.max_reserved = self.max_requested = 0
        self.segments = self.max_segments = 0
        self.device_allocs = self.device_frees = self.alloc_retries = self.ooms = 0

    # stat bookkeeping (increase_stat keeps the peak at every increase)
    def _reserve(self, n):
        self.reserved += n
        self.max_reserved = max(self.max_reserved, self.reserved)

    def _new_addr(self, n):
        addr, self.next_addr = self.next_addr, self.next_addr + n
        self.counter += 1
        return addr

    # -- malloc --
    def malloc(self, orig_size: int, stream=0):
        """DeviceCachingAllocator::malloc on `stream`; None where the real one raises
        OutOfMemoryError."""
        size = round_size(orig_size, self.cfg)
        pool = self.small if size <= K_SMALL_SIZE else self.large      # get_pool
        alloc_size = allocation_size(size, self.cfg)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self.gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size, False, stream)
            # free just enough oversize cached blocks, else every unsplit one, and retry
            if block is None and self._release_available_cached_blocks(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, False, stream)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, size, alloc_size, True, stream)
        if block is None:
            self.ooms += 1
            return None
        return self._alloc_found_block(block, size, orig_size, self._should_split(block, size))

    def _get_free_block(self, pool, size, stream=0):
        """get_free_block: best fit, the smallest cached block of at least `size` on `stream`."""
        if self.gc:
            pool.calls += 1
        i = bisect.bisect_left(pool.keys, (stream, size))
        if i == len(pool.keys) or pool.keys[i][0] != stream:   # none on this stream
            return None
        block = pool.at(i)
        if block.segment is not None:
            # a block that can grow into unmapped pages counts with them: prefer later blocks
            # that could grow less
            while block.segment is not None and i + 1 < len(pool.keys) and \
                    pool.keys[i + 1][0] == stream:
                nxt = pool.at(i + 1)
                if _expandable_size(nxt) >= _expandable_size(block):
                    break
                i, block = i + 1, nxt
        # do not hand a block >= max_split_size to a smaller request, nor one more than
        # max_non_split_rounding_size too big to an oversize request (oversize blocks never split)
        if size < self.max_split and block.size >= self.max_split:
            return None
        if size >= self.max_split and block.size >= size + self.max_rounding:
            return None
        pool.erase(block)
        return block

    def _should_split(self, block, size):
        """should_split: small pool (and expandable segments) keep any remainder >= 512 B;
        large pool only remainders > 1 MiB, and never from an oversize request."""
        remaining = block.size - size
        if block.pool.is_small or self.cfg.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.max_split and remaining > K_SMALL_SIZE

    def _alloc_found_block(self, block, size, orig_size, split):
        """alloc_found_block: carve `size` off the front; the remainder goes back to the pool."""
        if split:
            remaining, pool = block, block.pool
            block = _Block(size, remaining.addr, remaining.counter, pool, remaining.segment,
                           stream=remaining.stream)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next, remaining.prev = remaining, block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated, block.requested = True, orig_size
        # allocated_bytes counts block->size (rounded, whole unsplit block); requested_bytes the ask
        self.allocated += block.size
        self.requested += orig_size
        self.max_allocated = max(self.max_allocated, self.allocated)
        self.max_requested = max(self.max_requested, self.requested)
        return block

    def _alloc_block(self, pool, size, alloc_size, is_retry, stream=0):
        """alloc_block: a new segment from cudaMalloc (or mapped pages of an expandable one)."""
        if is_retry:
            self.alloc_retries += 1
        if self.allowed is not None and self.total + alloc_size > self.allowed:
            return None
        if self.cfg.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream)
        if self.capacity is not None and self.total + alloc_size > self.capacity:
            return None                                   # cudaErrorMemoryAllocation
        self.total += alloc_size
        self.device_allocs += 1
        self.segments += 1
        self.max_segments = max(self.max_segments, self.segments)
        self._reserve(alloc_size)
        addr = self._new_addr(alloc_size)
        return _Block(alloc_size, addr, self.counter, pool, stream=stream)

    # -- free --
    def free(self, block):
        """DeviceCachingAllocator::free (no other stream used it, so straight to free_block)."""
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        self._free_block(block)

    def _free_block(self, block):
        """free_block: merge with free neighbours of the same segment, then cache."""
        pool = block.pool
        for candidate in (block.prev, block.next):
            self._try_merge_blocks(block, candidate, pool)
        pool.insert(block)

    @staticmethod
    def _try_merge_blocks(dst, src, pool):
        """try_merge_blocks: dst (outside the pool) absorbs its free neighbour src."""
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        pool.erase_any(src)
        if dst.prev is src:                               # [src dst]
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:                                             # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- giving memory back --
    def _release_block(self, block):
        """release_block: cudaFree a whole cached segment."""
        assert block.segment is None and not block.is_split()
        self.device_frees += 1
        self.total -= block.size
        self.segments -= 1
        self.reserved -= block.size
        block.pool.erase(block)

    def _release_available_cached_blocks(self, pool, size, stream=0):
        """release_available_cached_blocks: with max_split_size set, free the smallest oversize
        block of the stream that covers the request, else its oversize blocks from the largest
        down until enough."""
        if self.max_split == _SIZE_MAX:
            return False
        key = max(size, self.max_split)
        i = bisect.bisect_left(pool.keys, (stream, key))
        if i < len(pool.keys) and pool.keys[i][0] == stream and pool.at(i).segment is None:
            self._release_block(pool.at(i))
            return True
        if i == 0:
            return False
        released, i = 0, i - 1
        while released < key and pool.at(i).size >= self.max_split and \
                pool.keys[i][0] == stream:
            cur = pool.at(i)
            if cur.segment is None:
                released += cur.size
                self._release_block(cur)          # deletes keys[i]; keys below i stay put
            if i == 0:
                break
            i -= 1
        return released >= key

    def _release_cached_blocks(self):
        """release_cached_blocks: cudaFree every unsplit cached segment, unmap free pages."""
        for pool in (self.large, self.small):
            self._release_blocks(pool)

    def _release_blocks(self, pool):
        """release_blocks"""
        to_unmap = []
        for key in list(pool.keys):
            block = pool.by_addr[key[3]]
            if block.segment is not None:
                to_unmap.append(block)
            elif not block.is_split():
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if not block.mapped and not block.is_split():
                self._release_expandable_segment(block)

    def _garbage_collect_cached_blocks(self):
        """garbage_collect_cached_blocks: above threshold * allowed memory, free unsplit large
        cached blocks idle for at least the average number of get_free_block calls, oldest
        first, until total_allocated_memory is back under the threshold."""
        threshold = int(self.cfg.garbage_collection_threshold * self.allowed)
        if self.total <= threshold:
            return
        target, reclaimed = self.total - threshold, 0
        pool = self.large
        ages = [pool.calls - pool.by_addr[k[3]].gc_base for k in pool.keys
                if not pool.by_addr[k[3]].is_split()]
        total_age, count = sum(ages), len(ages)
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.by_addr[key[3]]
                age = pool.calls - block.gc_base
                if not block.is_split() and block.segment is None and age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # -- expandable segments --
    def _find_expandable_block(self, pool, size, stream=0):
        """find_expandable_block: the lowest-address free-or-unmapped run of `size` bytes in an
        existing segment of `stream`, else a fresh segment's whole unmapped range."""
        first = bisect.bisect_left(pool.unmapped, (stream,))
        for s, addr in pool.unmapped[first:]:
            if s != stream:
                break
            c = pool.unmapped_by_addr[addr]
            if _allocatable(c.prev):
                c = c.prev
            run, b = 0, c
            while run < size and _allocatable(b):
                run += b.size
                b = b.next
            if run >= size:
                return c
        page = K_SMALL_BUFFER if pool.is_small else self.cfg.large_segment_size
        device = self.capacity if self.capacity is not None else _UNBOUNDED_DEVICE
        pages = -(-(device + device // 8) // page)
        if pages * page < size:           # one allocation cannot span segments
            return None
        base = self._new_addr(pages * page)
        seg = _ExpandableSegment(base, page, pages)
        self.expandable.append(seg)
        candidate = _Block(pages * page, seg.base, self.counter, pool, seg, mapped=False,
                           stream=stream)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map, size):
        """map_block: back the pages under [to_map, to_map + size) with memory; all or none."""
        seg, pool = to_map.segment, to_map.pool
        begin = (to_map.addr - seg.base) // seg.page                  # segmentLeft
        end = -(-(to_map.addr + size - seg.base) // seg.page)         # segmentRight
        mapped = (end - begin) * seg.page
        if self.capacity is not None and self.total + mapped > self.capacity:
            return False                                               # cuMemCreate OOM
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.size - mapped, to_map.addr + mapped, to_map.counter, pool, seg,
                          mapped=False, stream=to_map.stream)
            rest.splice(to_map, to_map.next)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total += mapped
        self.device_allocs += 1
        self._reserve(mapped)
        return True

    def _try_allocate_expandable_block(self, pool, size, stream=0):
        """try_allocate_expandable_block"""
        c = self._find_expandable_block(pool, size, stream)
        if c is None:
            return None
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:              # free -> unmapped: map more and merge
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.erase(c)
        return c

    def _unmap_block(self, block):
        """unmap_block: give back the whole pages of a free block; partial pages stay mapped."""
        seg, pool = block.segment, block.pool
        begin = -(-(block.addr - seg.base) // seg.page)               # segmentRight
        end = (block.addr + block.size - seg.base) // seg.page         # segmentLeft
        if begin >= end:
            return
        start, length = seg.base + begin * seg.page, (end - begin) * seg.page
        pool.erase(block)
        before = start - block.addr
        if before > 0:
            head = _Block(before, block.addr, block.counter, pool, seg, stream=block.stream)
            head.splice(block.prev, block)
            pool.insert(head)
        after = block.size - before - length
        if after > 0:
            tail = _Block(after, start + length, block.counter, pool, seg, stream=block.stream)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.addr, block.size, block.mapped = start, length, False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self.total -= length
        self.reserved -= length
        self.device_frees += 1

    def _release_expandable_segment(self, block):
        """release_expandable_segment: drop a segment with nothing mapped."""
        block.pool.erase_unmapped(block)
        self.expandable.remove(block.segment)


@dataclass(frozen=True)
class AllocatorReport:
    """What the caching allocator would report over the sequence (all sizes in bytes)."""

    max_allocated: int          # torch.cuda.max_memory_allocated()
    max_reserved: int           # torch.cuda.max_memory_reserved()
    max_requested: int          # memory_stats()["requested_bytes.all.peak"]
    allocated: int              # at the end
    reserved: int
    requested: int
    allocated_timeline: list    # after each event
    reserved_timeline: list
    segments: int               # cudaMalloc'd segments at the end (memory_stats "segment.all")
    peak_segments: int
    expandable_segments: int    # live expandable segments at the end
    cuda_malloc_calls: int      # cudaMalloc + cuMemMap calls ("num_device_alloc")
    cuda_free_calls: int        # cudaFree + cuMemUnmap calls ("num_device_free")
    cache_flushes: int          # release-all-cached-blocks-and-retry ("num_alloc_retries")
    oom: bool
    first_oom_event: int | None
    num_ooms: int
    fragmentation: float        # 1 - allocated / reserved when allocated memory peaks
    config: AllocatorConfig = field(default_factory=AllocatorConfig)

    @property
    def fits(self) -> bool:
        return not self.oom

    def to_dict(self, with_timeline: bool = False) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__
             if k not in ("allocated_timeline", "reserved_timeline", "config")}
        if with_timeline:
            d["allocated_timeline"] = list(self.allocated_timeline)
            d["reserved_timeline"] = list(self.reserved_timeline)
        return d


def simulate(events, capacity_bytes: int | None = None,
             config: AllocatorConfig = AllocatorConfig()) -> AllocatorReport:
    """Replay `(key, nbytes)` allocations and `(key, None)` frees through the caching allocator.
    An allocation may name its stream, `(key, nbytes, stream)` (default 0): its block is reused
    only by later allocations on the same stream.

    `capacity_bytes` is the device memory the allocator can get from CUDA; without it cudaMalloc
    never fails. A request that cannot be met even after the cache is flushed is an OOM: the real
    allocator raises there; the simulation records it, skips that allocation (its free becomes a
    no-op) and carries on, so the timelines stay one entry per event. A size of 0 allocates
    nothing, as `NativeCachingAllocator::allocate` skips malloc for it.
    """
    alloc = _CachingAllocator(config, capacity_bytes)
    live: dict = {}
    allocated_tl, reserved_tl = [], []
    first_oom = None
    for index, (key, nbytes, *on) in enumerate(events):
        if nbytes is None:
            if key not in live:
                raise ValueError(f"event {index}: free of {key!r}, which is not allocated")
            block = live.pop(key)
            if block is not None:
                alloc.free(block)
        else:
            if key in live:
                raise ValueError(f"event {index}: {key!r} is already allocated")
            if nbytes < 0:
                raise ValueError(f"event {index}: negative size {nbytes}")
            block = alloc.malloc(nbytes, on[0] if on else 0) if nbytes else None
            if block is None and nbytes and first_oom is None:
                first_oom = index
            live[key] = block
        allocated_tl.append(alloc.allocated)
        reserved_tl.append(alloc.reserved)

    # Measured when allocated memory peaks: the reserved bytes that hold no block while the
    # allocator is under the most pressure. Not at the event that first reaches the reserved
    # maximum: once a step's large blocks are freed and cached, a small request later in the step
    # (an optimizer's per-parameter state: <= 1 MiB requests take a new 2 MiB small-pool segment,
    # they cannot use the cached large blocks) raises reserved by 2 MiB while little is
    # allocated, and that event would report the cache as fragmentation (0.98 under FSDP 128).
    fragmentation = 0.0
    if allocated_tl and max(allocated_tl) > 0:
        peak = allocated_tl.index(max(allocated_tl))
        fragmentation = 1.0 - allocated_tl[peak] / reserved_tl[peak]
    return AllocatorReport(
        max_allocated=alloc.max_allocated, max_reserved=alloc.max_reserved,
        max_requested=alloc.max_requested, allocated=alloc.allocated, reserved=alloc.reserved,
        requested=alloc.requested, allocated_timeline=allocated_tl, reserved_timeline=reserved_tl,
        segments=alloc.segments, peak_segments=alloc.max_segments,
        expandable_segments=len(alloc.expandable), cuda_malloc_calls=alloc.device_allocs,
        cuda_free_calls=alloc.device_frees, cache_flushes=alloc.alloc_retries,
        oom=first_oom is not None, first_oom_event=first_oom, num_ooms=alloc.ooms,
        fragmentation=fragmentation, config=config)
