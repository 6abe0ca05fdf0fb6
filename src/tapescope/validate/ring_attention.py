"""torch's own ring attention run for real on the CPU: the truth for context-parallel collectives.

torch's context parallelism (`torch.distributed.tensor.experimental.context_parallel`) replaces
SDPA by ring attention only for CUDA's attention ops: its DTensor handlers
(`_attention.custom_ops`) take `_scaled_dot_product_{flash,efficient,cudnn}_attention` and their
backwards, never the CPU's `_scaled_dot_product_flash_attention_for_cpu`. So on a machine without
a GPU nothing of torch's ring code runs, and a CP profile's collectives had only hand counts to
meet. This module runs the user's own step with real CPU tensors, on one rank of torch's fake
process group (a real c10d backend that moves no data), with one substitution:

- the CPU flash op (and its backward), which is what SDPA dispatches to for CPU DTensors, is handed
  to torch's own CUDA flash handler (`_scaled_dot_product_ring_flash_attention[_backward]`, hence
  `_templated_ring_attention[_backward]`, the rotaters and the load balancer as written), and
- inside that handler, the per-block kernel torch calls (`aten._scaled_dot_product_flash_attention`
  and its backward) is the CPU flash kernel with the CUDA op's signature and outputs (the CUDA-only
  outputs - cumulative lengths, philox state, debug mask - as None/ints: the ring code only passes
  them on).

Why the collectives cannot depend on the substitute: the ring's collectives are the rotaters'
(`ft_c.all_gather_single` / `ft_c.permute_tensor`) on `cat(key, value)` and `cat(grad_key,
grad_value)`, whose sizes are those of the local key and value (the gradients are
`zeros_like(key, dtype=fp32)` and are overwritten by the rotated buffer); which iterations run a
collective depends only on the rank, the ring size, `is_causal` and `_cp_options`. The kernel only
fills values (and its gradients are added in place, so their shapes must already match). The
sharding propagation of torch's `_sdpa_handler` is replaced by wrapping the local results as
sequence-sharded DTensors, which is what CP's sharding rules give for these ops.

Every `_c10d_functional` collective of the step is recorded (torch's dispatch mode, re-entered
inside the handler, where DTensor's dispatch runs with modes popped), with nccl-tests' size: the
gathered output of an all-gather, the input otherwise - the convention of
analysis/collectives.py, written here again from the tensors torch passes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..torch_compat import (TorchDispatchMode, context_parallel_module, fake_store, in_backward,
                            patched)

__all__ = ["RingCollective", "torch_ring_collectives"]

_aten = torch.ops.aten


@dataclass(frozen=True)
class RingCollective:
    """One collective a real rank issued."""

    kind: str         # all_gather, all_to_all, ...
    nbytes: int       # gathered output of an all-gather, else the input
    phase: str        # forward or backward (inside autograd's backward)
    group_size: int


_KINDS = {"all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all",
          "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
          "broadcast": "broadcast"}


class _Recorder(TorchDispatchMode):
    """Every functional collective, as torch issues it."""

    def __init__(self):
        super().__init__()
        self.calls: list[RingCollective] = []
        self.ring_runs = 0   # torch's ring handler ran (forward or backward)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _KINDS.get(func.__name__.split(".")[0]) if func.namespace == "_c10d_functional" \
            else None
        if kind is not None:
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            data = out if kind == "all_gather" else args[0]
            phase = "backward" if in_backward() else "forward"
            self.calls.append(RingCollective(kind, data.nbytes, phase, group.size()))
        return out


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                   *, scale=None):
    """The CPU flash kernel behind the CUDA flash op's signature and nine outputs."""
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out, lse, None, None, query.size(2), key.size(2), None, None, None


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                    max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)


class _AtenWithCpuFlash:
    """`aten` as torch's CP module sees it, with the CUDA flash ops answered by the CPU kernel."""

    _scaled_dot_product_flash_attention = staticmethod(_flash_forward)
    _scaled_dot_product_flash_attention_backward = types.SimpleNamespace(default=_flash_backward)

    def __getattr__(self, name):
        return getattr(_aten, name)


def _handlers(recorder: _Recorder) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    cp = context_parallel_module()

    def run(ring, result_count):
        def handler(op_call, args, kwargs):
            info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
            mesh = info.compute_mesh
            recorder.ring_runs += 1
            with recorder:
                local = ring(mesh, *info.local_args, **info.local_kwargs)
            return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False)
                         for t in local[:result_count])
        return handler

    def forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                scale=None):
        if attn_mask is not None:
            raise NotImplementedError("torch's ring attention takes no attention mask")
        return cp._scaled_dot_product_ring_flash_attention(
            mesh, query, key, value, dropout_p, is_causal, scale=scale)

    def backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                 attn_mask=None, scale=None):
        return cp._scaled_dot_product_ring_flash_attention_backward(
            mesh, grad_out, query, key, value, out, logsumexp, None, None, query.size(2),
            key.size(2), dropout_p, is_causal, None, None, scale=scale)

    return {_aten._scaled_dot_product_flash_attention_for_cpu.default: run(forward, 2),
            _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: run(backward, 3)}


def torch_ring_collectives(build, inputs: tuple, parallelize, step, mesh: dict, rank: int = 0,
                           optimizer=None) -> list[RingCollective]:
    """The functional collectives rank `rank` issues in one `step(model, inputs, optimizer)` of
    `parallelize(build(), device_mesh)` (`mesh`: dimension name -> size, outermost first, on
    the CPU), in order, with real CPU tensors on torch's fake process group (module docstring).
    The step's own settings (`set_rotate_method`, `_cp_options.enable_load_balance`) are
    torch's, read as it runs. FSDP2's collectives go through c10d's own ops, not these."""
    from torch.distributed.device_mesh import init_device_mesh

    cp_module = context_parallel_module()

    if dist.is_initialized():
        raise RuntimeError("torch_ring_collectives needs torch.distributed uninitialized")
    recorder = _Recorder()
    world = 1
    for size in mesh.values():
        world *= size
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    # context_parallel merges the module's `custom_ops` into DTensor's handlers on entry
    with patched(cp_module, aten=_AtenWithCpuFlash(),
                 custom_ops={**cp_module.custom_ops, **_handlers(recorder)}):
        try:
            device_mesh = init_device_mesh("cpu", tuple(mesh.values()),
                                           mesh_dim_names=tuple(mesh))
            model = parallelize(build(), device_mesh)
            opt = optimizer(model.parameters()) if optimizer else torch.optim.SGD(
                model.parameters(), lr=1e-3)
            with recorder:
                step(model, inputs, opt)
        finally:
            dist.destroy_process_group()
    if not recorder.ring_runs:
        raise RuntimeError("torch's ring attention never ran: SDPA on these CPU DTensors did not "
                           "dispatch to the CPU flash kernel (a mask, or a case its flash path "
                           "refuses), so these collectives are no ring's")
    return recorder.calls
