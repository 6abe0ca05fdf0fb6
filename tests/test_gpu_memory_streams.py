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


def test_memory_outside_ops_is_served_on_the_stream_current_at_its_allocation():
    """The caching allocator serves a block on the stream current when it is allocated
    (CUDACachingAllocator.cpp: `allocate` calls `malloc` with getCurrentCUDAStream), not on the
    stream of the op that ran last. `Tape.bytes_outside_ops` records bytes allocated between ops;
    here the last op ran on a side stream, and the bytes are asked for once with the default
    stream current again and once inside the side stream, as the program's
    `torch.cuda.current_stream()` says at each moment."""
    from tapescope.capture.session import Recorder
    from tapescope.distributed.cuda_standin import cuda_without_gpu

    cuda = torch.device("cuda")
    with cuda_without_gpu() as log:
        tape = Recorder.create(cuda).tape
        tape.streams = log
        with tape, tape.phase(1, "forward"):
            x = torch.empty(256, device=cuda)
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                x + 1
            current = torch.cuda.current_stream()
            held_now = tape.bytes_outside_ops(8, cuda)
            with torch.cuda.stream(side):
                held_side = tape.bytes_outside_ops(8, cuda)
            del held_now, held_side
    trace = tape.trace
    assert trace.ops[-1].stream == side.id != current.id
    *_, now, in_side = trace.storages
    assert (now.nbytes, now.created_by) == (8, len(trace.ops) - 1)
    assert (now.stream, in_side.stream) == (current.id, side.id)


def test_wrapped_numbers_are_host_memory_on_a_cuda_step():
    """What `bytes_outside_ops` records today is the 0-dim tensor a Python number becomes
    (capture/fidelity/wrapped_numbers.py). Torch makes it on the CPU whatever the device of the
    tensor it multiplies: on a fake CUDA step, the number MulBackward0 saves is a CPU float64
    tensor. So it is never the CUDA allocator's, and the rule stays the CPU trace's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, device="cuda", requires_grad=True)
        other = (x * 0.5).grad_fn._saved_other
    assert (other.device.type, other.dtype, other.dim()) == ("cpu", torch.float64, 0)


def _unequal_blocks():
    # every weight and bias has a size of its own: 256 KiB, 2 MiB, 512 KiB; 1 KiB, 8 KiB, 256 B
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2048),
                               torch.nn.Linear(2048, 64))


def _resize_line() -> tuple[str, int]:
    """Where FSDP2 calls `resize_` to re-allocate an unsharded parameter, read from torch's
    own source: `alloc_storage` in _fsdp_param.py."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_param

    lines, first = inspect.getsourcelines(_fsdp_param.alloc_storage)
    line = first + next(i for i, text in enumerate(lines) if ".resize_(" in text)
    return "torch/distributed/fsdp/_fully_shard/_fsdp_param.py", line


def test_fsdp2_re_unshards_are_named_by_what_re_allocated_them():
    """A re-unshard's storage is placed after the last op recorded, another stream's (FSDP2's
    all-gather, or the previous block's reduce-scatter): an out-of-memory label or a "made by"
    naming that op points at a collective. They name the line that called `resize_` (FSDP2's
    `alloc_storage`, found in torch's source) and the module the parameter belongs to (by its
    size: every weight and bias here has its own), in its backward."""
    import dataclasses

    from tapescope.analysis.gpu_memory import predict_cuda_memory
    from tapescope.devices.gpus import cuda_context_bytes

    model = _unequal_blocks()
    module_of_size = {p.numel() * 4: name.rpartition(".")[0]
                      for name, p in model.named_parameters()}
    p = tapescope.profile(model, tapescope.spec((8, 256)), gpu="h100", mesh={"dp": 2},
                          parallelize=_fsdp)
    trace = p.trace
    path, line = _resize_line()
    where = f"{path}:{line} in alloc_storage"
    resized = [s for s in trace.storages if s.resized_by is not None and s.nbytes]
    assert len(resized) == 6  # each block's weight and bias, re-allocated for its backward
    events, labels = _events(trace, p.gpu)
    said = {key[1]: labels.at(trace, events, i) for i, (key, n, *_) in enumerate(events)
            if n is not None and key[0] == "step1"}
    for s in resized:
        expected = f"step1: resize_ at {where}, for module {module_of_size[s.nbytes]}'s backward"
        assert said[s.id] == expected
    # the case this is for: the op recorded before the resize ran on another stream
    assert any(trace.ops[s.created_by].stream != 0 for s in resized)

    # the largest tensors alive at the peak: a re-allocated one is "made by" resize_
    again = [t for t in p.memory.live_at_peak if t.op_name == "resize_"]
    assert again and all((t.module, t.source) == (module_of_size[t.nbytes], where)
                         for t in again)

    # out of memory at a re-unshard, through the public path: lower the GPU's memory 1 MiB at
    # a time until the replay runs out at one (a 2 MiB weight's re-allocation is one of the
    # larger requests; with the cache flushed before failing, only some capacities fail there)
    context = cuda_context_bytes(p.gpu)
    capacity = p.cuda_memory.max_reserved
    while capacity > p.cuda_memory.max_reserved // 2:
        capacity -= 1 << 20
        gpu = dataclasses.replace(p.gpu, reported_memory_bytes=capacity + context)
        cm = predict_cuda_memory(trace, gpu, p.options.alloc_conf)
        if "resize_" in (cm.oom_at or ""):
            break
    assert cm.oom and cm.oom_at in {said[s.id] for s in resized}
