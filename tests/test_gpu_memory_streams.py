"""The caching allocator replayed with streams, on a distributed CUDA profile.

FSDP2 allocates its all-gather buffers on its copy-in stream (foreach_all_gather runs
torch.ops.fsdp.all_gather_copy_in under `all_gather_copy_in_stream`) and its reduce-scatter
buffers on the reduce-scatter stream; the caching allocator gives a freed block back only to
requests on the stream that allocated it (CUDACachingAllocator.cpp's header and get_free_block).
The replay must keep those caches apart (the rules themselves: tests/test_allocator.py).
"""

import torch

import tapescope
from tapescope.analysis.allocator import simulate
from tapescope.analysis.gpu_memory import _events


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_fsdp2_side_streams_keep_their_own_cache():
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))
    p = tapescope.profile(model, tapescope.spec((64, 1024)), gpu="h100", mesh={"dp": 2},
                          parallelize=_fsdp)
    events, _ = _events(p.trace, p.gpu)
    side = [(key, n, s) for key, n, *rest in events if n is not None for s in rest if s]
    copy_in = {p.trace.ops[i].stream for i, op in enumerate(p.trace.ops)
               if op.name == "fsdp.all_gather_copy_in.default"}
    assert side and copy_in and all(s != 0 for s in copy_in)
    # a layer's all-gather buffer (its gathered flat parameters: 1024 x 1024 + 1024 fp32 values,
    # which divide evenly over the 2 ranks) is allocated on the copy-in stream
    gathered = (1024 * 1024 + 1024) * 4
    assert any(n == gathered and s in copy_in for _, n, s in side)
    cm = p.cuda_memory
    one = simulate([e[:2] for e in events], None, p.options.alloc_conf)
    many = simulate(events, None, p.options.alloc_conf)
    assert cm.max_reserved == many.max_reserved
    assert cm.stream_cached == many.max_reserved - one.max_reserved > 0
    assert p.to_dict()["cuda_memory"]["stream_cached"] == cm.stream_cached


def test_one_stream_profiles_are_unchanged():
    p = tapescope.profile(torch.nn.Linear(512, 512), tapescope.spec((8, 512)), gpu="h100")
    events, _ = _events(p.trace, p.gpu)
    assert all(len(e) == 2 or e[2] == 0 for e in events)
    assert p.cuda_memory.stream_cached == 0


def test_fsdp2_re_unshards_allocate_on_the_compute_stream():
    """FSDP2 frees a block's all-gather outputs after forward (`resize_(0)`) and re-allocates
    them for backward with `resize_(n)` (_fsdp_param.alloc_storage, from
    alloc_all_gather_outputs in _fsdp_collectives.foreach_all_gather_copy_out). That runs in
    wait_for_unshard on the current (compute) stream, after
    `current_stream().wait_event(all_gather_event)`, with no stream switch before the copy-out
    (`fsdp.split_with_sizes_copy`) that fills them; the all-gather stream only runs the
    collective into the buffer the copy-in stream made, so it allocates nothing
    (foreach_all_gather). A resize dispatches no op: the trace meets it after the all-gather, the
    last op recorded, and must replay it on the stream current at the resize."""
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(3)))
    p = tapescope.profile(model, tapescope.spec((8, 256)), gpu="h100", mesh={"dp": 2},
                          parallelize=_fsdp)
    trace = p.trace
    events, _ = _events(trace, p.gpu)
    allocated_on: dict = {}
    for key, n, *stream in events:
        if n is not None and stream:
            allocated_on.setdefault(key[1], set()).add(stream[0])
    gather_streams = {op.stream for op in trace.ops if op.name == "c10d._allgather_base_.default"}
    assert gather_streams and not gather_streams & set().union(*allocated_on.values())
    refilled = {}   # the storages backward's copy-outs fill -> the copy-out's stream
    for op in trace.ops:
        if op.name == "fsdp.split_with_sizes_copy.default" and op.phase == "backward":
            for ref in op.inputs[1:]:   # after the gathered buffer: the `out` tensors
                refilled[ref.storage] = op.stream
    resized = {sid: s for sid, s in refilled.items() if sid in allocated_on}
    # each block's weight and bias, freed after its forward, re-allocated for its backward (the
    # root, a Sequential, has no parameter of its own)
    assert len(resized) == 6 and set(resized.values()) == {0}
    assert all(allocated_on[sid] == {s} for sid, s in resized.items())
    # where the resize was met: after an op of another stream (the case this test is for)
    assert any(trace.ops[trace.storages[sid].created_by].stream != 0 for sid in resized)
