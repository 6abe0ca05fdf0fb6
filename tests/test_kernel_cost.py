"""What one kernel costs (analysis/kernel_cost.py): ops that launch no kernel cost nothing, walked
over every registered op; every op class that does launch one costs something."""

import pytest
import torch
import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)

import tapescope
from tapescope.analysis.kernel_cost import kernel_from_aten, kernel_time
from tapescope.analysis.op_classes import (ATTENTION, CONVOLUTION, MATMUL, NO_KERNEL,
                                           NO_KERNEL_NAMES, launches_kernel, op_class)
from tapescope.capture.records import TensorRef
from tapescope.devices.gpus import get_gpu

from . import distributed_models as dm

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")

# a large tensor (2 GiB of bf16): what `_wrap_tensor_autograd` was once costed as copying
BIG = TensorRef((1 << 30,), torch.bfloat16, 0, 0)


def _every_op():
    """Every overload the dispatcher has registered in aten, _c10d_functional and profiler."""
    found = []
    for qualified in sorted(set(torch._C._dispatch_get_all_op_names())):
        namespace, name = qualified.split("::")
        name = name.split(".")[0]
        if namespace not in ("aten", "_c10d_functional", "profiler"):
            continue
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue
        found += [getattr(packet, o) for o in packet.overloads()
                  if getattr(packet, o) not in found]
    return found


def test_every_op_that_launches_no_kernel_costs_nothing():
    """Every registered overload of aten, _c10d_functional and profiler: those that launch no
    kernel (views, in-place metadata changes, allocations, autograd wrappers, host checks) are
    priced at 0 however much they would read and write, on every GPU of the catalogue."""
    no_kernel = [f for f in _every_op() if not launches_kernel(f)]
    names = {str(f.overloadpacket) for f in no_kernel}
    # the rules cover the schema's views and in-place metadata ops, and every listed packet
    assert all(f in no_kernel for f in _every_op()
               if f.is_view or torch.Tag.inplace_view in f.tags)
    assert {str(p) for p in NO_KERNEL} <= names
    assert "_c10d_functional._wrap_tensor_autograd" in names
    assert "_c10d_functional.wait_tensor" in names
    assert {"aten.t_", "aten.as_strided", "aten.view", "aten.detach", "aten.empty",
            "aten.sym_size"} <= names
    assert len(no_kernel) > 100
    for gpu in (get_gpu("h100"), get_gpu("a100"), get_gpu("l4")):
        for f in no_kernel:
            kernel = kernel_from_aten(f, [BIG], [BIG], 10 ** 15, 2 * BIG.nbytes)
            assert kernel.op_class == "none" and kernel_time(kernel, gpu) == (0.0, True), f


def test_every_class_that_launches_a_kernel_costs_time():
    """The compute classes never overlap the no-kernel rules, and each of their ops is priced
    above zero; so is an elementwise op; an op on host tensors only launches no GPU kernel."""
    gpu = get_gpu("h100")
    for packets in (MATMUL, CONVOLUTION, ATTENTION):
        for packet in packets:
            assert not packets & NO_KERNEL and str(packet) not in NO_KERNEL_NAMES
            for overload in packet.overloads():
                f = getattr(packet, overload)
                assert launches_kernel(f), f
                kernel = kernel_from_aten(f, [BIG], [BIG], 10 ** 12, 2 * BIG.nbytes)
                assert kernel.op_class == op_class(f) != "none"
                assert kernel_time(kernel, gpu)[0] > 0
    add = torch.ops.aten.add.Tensor
    assert kernel_time(kernel_from_aten(add, [BIG], [BIG], 0, 2 * BIG.nbytes), gpu)[0] > 0
    host = kernel_from_aten(add, [BIG], [BIG], 0, 2 * BIG.nbytes, on_gpu=False)
    assert kernel_time(host, gpu) == (0.0, True)


def test_a_tensor_parallel_step_prices_its_wrappers_at_zero():
    """A traced FSDP x TP step on CUDA: every op of the step that launches no kernel (the
    `_wrap_tensor_autograd` around each all-reduce's result among them) and every op on host
    tensors only (the optimizer's step counters live on the CPU) has 0 seconds in the schedule."""
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2, "tp": 2}, parallelize=dm.fsdp_tp,
                          device="cuda",
                          gpu="h100")
    t = p.time
    storages = p.trace.storages
    wrapped = cpu = 0
    for op, seconds in zip(p.ops, t.op_seconds):
        f = op.record.func
        devices = {storages[r.storage].device.type for r in (*op.inputs, *op.outputs)
                   if r.storage >= 0}
        if str(f.overloadpacket) == "_c10d_functional._wrap_tensor_autograd":
            wrapped += 1
        if not launches_kernel(f) or devices == {"cpu"}:
            cpu += devices == {"cpu"}
            assert seconds == 0.0, op.name
        elif op_class(f) == "matmul":
            assert seconds > 0
    assert wrapped >= 3 and cpu > 0
    assert t.gpu_busy == pytest.approx(sum(t.op_seconds))


def test_memory_bound_kernels_at_the_measured_stream_bandwidth():
    """Azure's STREAM measurements (ND H100 v5: Copy 2.90, Triad 2.97 TB/s; ND A100 v4: 1.61 /
    1.70): a 2 GiB cast moves at Copy, a 2 GiB add at Triad, plus the 3 us kernel overhead; a GPU
    without a measurement (L4) at 80% of its DRAM peak."""
    from tapescope.devices.efficiency import KERNEL_OVERHEAD_S

    nbytes = 2 * BIG.nbytes
    cast = kernel_from_aten(torch.ops.aten._to_copy.default, [BIG], [BIG], 0, nbytes)
    add = kernel_from_aten(torch.ops.aten.add.Tensor, [BIG], [BIG], 0, nbytes)
    for gpu, copy, triad in (("h100", 2.90e12, 2.97e12), ("a100", 1.61e12, 1.70e12)):
        g = get_gpu(gpu)
        assert kernel_time(cast, g)[0] == pytest.approx(nbytes / copy + KERNEL_OVERHEAD_S)
        assert kernel_time(add, g)[0] == pytest.approx(nbytes / triad + KERNEL_OVERHEAD_S)
    l4 = get_gpu("l4")
    assert kernel_time(add, l4)[0] == pytest.approx(nbytes / (300e9 * 0.8) + KERNEL_OVERHEAD_S)
