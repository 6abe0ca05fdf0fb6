"""Where a distributed CUDA profile's reserved memory sits, stream by stream: the figures of
docs/distributed.md's "Reserved memory with several streams".

Profiles a zoo model as `tapescope profile SPEC --fsdp N --amp DTYPE -b B -s S --gpu GPU` does
(the preset parallelisation: with --amp, FSDP2's MixedPrecisionPolicy), replays the caching
allocator over its run (analysis.gpu_memory: setup, step 1, the steady step twice), and prints
max_memory_reserved with the streams apart and on one stream, and at the reserved peak: what is
allocated and what is cached free on each stream; then the steady step's allocations on each
side stream, by size; then the same trace replayed with the GPU's memory lowered by each
`--lower` GiB (memory outside the allocator: NCCL's buffers), with the default settings and with
expandable segments.

    python benchmarks/stream_breakdown.py zoo:llama3-8b --fsdp 8 --amp bf16 -b 1 -s 8192
    python benchmarks/stream_breakdown.py zoo:llama:dim=1024,n_layers=4 --fsdp 4 --amp bf16 \
        -b 2 -s 512 [--autocast] [--lower 0,0.5,1,1.5,2,3]

`--autocast` parallelises with plain `fully_shard` per block and the root (no mixed-precision
policy) and runs the step under bf16 autocast instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

import tapescope
from tapescope.analysis.allocator import _CachingAllocator, simulate
from tapescope.analysis.gpu_memory import _events, predict_cuda_memory
from tapescope.distributed.presets import parallelization
from tapescope.zoo import resolve

GIB, MIB = 1 << 30, 1 << 20


def _fully_shard_blocks(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def profile(args):
    m = resolve(args.spec, batch=args.batch, seq=args.seq)
    if args.autocast:
        mesh, parallelize, amp = {"dp_shard": args.fsdp}, _fully_shard_blocks, args.amp
    else:
        mesh, parallelize, amp = parallelization(fsdp=args.fsdp, amp=args.amp)
    return tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                             device="cuda", gpu=args.gpu, amp=amp, mesh=mesh,
                             parallelize=parallelize)


def at_reserved_peak(events, labels, config) -> dict:
    """Replay up to the first event that reaches max_memory_reserved; per stream there: the
    bytes of allocated blocks and of cached free ones."""
    peak_event = simulate(events, None, config).reserved_timeline
    peak_event = peak_event.index(max(peak_event))
    alloc, live = _CachingAllocator(config, None), {}
    for key, nbytes, *on in events[:peak_event + 1]:
        if nbytes is None:
            block = live.pop(key)
            if block is not None:
                alloc.free(block)
        else:
            live[key] = alloc.malloc(nbytes, on[0] if on else 0) if nbytes else None
    allocated, free = Counter(), Counter()
    for block in live.values():
        if block is not None:
            allocated[block.stream] += block.size
    for pool in (alloc.large, alloc.small):
        for stream, size, *_ in pool.keys:
            free[stream] += size
    return {"event": labels[peak_event], "reserved": alloc.reserved,
            "allocated": dict(allocated), "cached_free": dict(free)}


def lowered(p, gib: float) -> dict:
    """The replay with the GPU's memory `gib` GiB lower, default settings and expandable
    segments (the one-stream figure: the same events with every stream made 0)."""
    gpu = dataclasses.replace(p.gpu, reported_memory_bytes=(p.gpu.reported_memory_bytes
                                                            or p.gpu.memory_bytes)
                              - round(gib * GIB))
    expandable = dataclasses.replace(p.options.alloc_conf, expandable_segments=True)
    cm = predict_cuda_memory(p.trace, gpu, p.options.alloc_conf)
    ex = predict_cuda_memory(p.trace, gpu, expandable)
    return {"lower_gib": gib, "capacity": cm.capacity - cm.context_bytes,
            "reserved": cm.max_reserved, "allocated": cm.max_allocated, "oom": cm.oom,
            "expandable_reserved": ex.max_reserved, "expandable_oom": ex.oom,
            "expandable_one_stream": ex.max_reserved - ex.stream_cached}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--fsdp", type=int, required=True)
    ap.add_argument("--amp", default="bf16")
    ap.add_argument("-b", "--batch", type=int, required=True)
    ap.add_argument("-s", "--seq", type=int, required=True)
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--autocast", action="store_true")
    ap.add_argument("--lower", default="", help="GiB, comma-separated")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    p = profile(args)
    cm, config = p.cuda_memory, p.options.alloc_conf
    events, labels = _events(p.trace, p.gpu)
    one = simulate([e[:2] for e in events], None, config)
    side = Counter((e[2], e[1]) for e, label in zip(events, labels)
                   if e[1] is not None and len(e) > 2 and e[2] and label.startswith("step3"))
    out = {"max_reserved": cm.max_reserved, "one_stream_max_reserved": one.max_reserved,
           "stream_cached": cm.stream_cached, "max_allocated": cm.max_allocated,
           "one_stream_max_allocated": one.max_allocated,
           "peak": at_reserved_peak(events, labels, config),
           "steady_side_stream_allocations": [
               {"stream": s, "bytes": n, "count": k} for (s, n), k in sorted(side.items())]}
    out["lowered"] = [lowered(p, float(x)) for x in args.lower.split(",") if x]
    if args.json:
        print(json.dumps(out))
        return
    unit, name = (GIB, "GiB") if cm.max_reserved > 8 * GIB else (MIB, "MiB")
    print(f"max_memory_reserved {cm.max_reserved / unit:.2f} {name} "
          f"(one stream {one.max_reserved / unit:.2f}); max_memory_allocated "
          f"{cm.max_allocated:,} (one stream {one.max_allocated:,})")
    peak = out["peak"]
    print(f"at the reserved peak ({peak['event']}):")
    for s in sorted(set(peak["allocated"]) | set(peak["cached_free"])):
        print(f"  stream {s}: allocated {peak['allocated'].get(s, 0) / unit:.2f} {name}, "
              f"cached free {peak['cached_free'].get(s, 0) / unit:.2f} {name}")
    print("steady step's side-stream allocations:")
    for row in out["steady_side_stream_allocations"]:
        print(f"  stream {row['stream']}: {row['count']} x {row['bytes'] / 1e9:.3f} GB")
    for row in out["lowered"]:
        print(f"capacity {row['capacity'] / GIB:.2f} GiB ({row['lower_gib']} GiB lower): reserved "
              f"{row['reserved'] / GIB:.2f} GiB (allocated {row['allocated'] / GIB:.2f}, oom "
              f"{row['oom']}), expandable segments "
              f"{row['expandable_reserved'] / GIB:.2f} GiB (one stream "
              f"{row['expandable_one_stream'] / GIB:.2f}, oom {row['expandable_oom']})")


if __name__ == "__main__":
    main()
