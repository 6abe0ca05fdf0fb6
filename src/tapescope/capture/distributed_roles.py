"""Memory categories of a distributed step, from the ops that fill each storage.

FSDP2 moves parameters through flat buffers with ops of its own (registered in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): `fsdp.all_gather_copy_in` packs the
rank's shards into the all-gather buffer, the collective fills it, `fsdp.split_with_sizes_copy`
copies it out into the unsharded parameters, and in backward `fsdp.chunk_cat` packs gradients
into the reduce-scatter buffer whose output holds the sharded gradients. So a storage's role is
known from the op that wrote it: one small rule per op, below. Roles rank as records.ROLE_ORDER
says: the reduce-scatter output that becomes the sharded .grad is a gradient.

Capture assigns them as a simulated rank's capture ends (session.py), so the Trace leaves capture
complete and no later stage writes it.
"""

from __future__ import annotations

from .records import (ALL_GATHER_BUFFER, PARAMETER, REDUCE_SCATTER_BUFFER,
                               SHARDED_PARAMETER, UNSHARDED_PARAMETER, Trace)

__all__ = ["WRITER_ROLES", "assign_roles", "sharded_parameter_names"]

# op name -> (role, which storages: "outputs" the op returns, "written" the arguments it writes)
WRITER_ROLES = {
    "fsdp.all_gather_copy_in.default": (ALL_GATHER_BUFFER, "outputs"),
    "c10d._allgather_base_.default": (ALL_GATHER_BUFFER, "outputs"),
    "c10d.allgather_into_tensor_coalesced_.default": (ALL_GATHER_BUFFER, "outputs"),
    "fsdp.split_with_sizes_copy.default": (UNSHARDED_PARAMETER, "outputs"),
    "fsdp.chunk_cat.default": (REDUCE_SCATTER_BUFFER, "outputs"),
    "c10d._reduce_scatter_base_.default": (REDUCE_SCATTER_BUFFER, "outputs"),
    "c10d.reduce_scatter_tensor_coalesced_.default": (REDUCE_SCATTER_BUFFER, "outputs"),
}


def sharded_parameter_names(model) -> set:
    """Names of the parameters that are shards (a DTensor sharded on some mesh dimension)."""
    from torch.distributed.tensor import DTensor, Replicate

    return {fqn for fqn, p in model.named_parameters(remove_duplicate=False)
            if isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)}


def assign_roles(trace: Trace, sharded_names: set) -> None:
    """Give the storages of `trace` their distributed roles (in place, as its capture ends).

    sharded_names: the parameters that are shards (sharded_parameter_names of the parallelised
    model); the storages they own become "sharded parameters".
    """
    storages = trace.storages
    sharded_storages = {sid for sid, fqn in trace.storage_owner.items() if fqn in sharded_names}
    for sid in sharded_storages:
        roles = storages[sid].roles
        if PARAMETER in roles:
            roles.discard(PARAMETER)
            roles.add(SHARDED_PARAMETER)
    for op in trace.ops:
        rule = WRITER_ROLES.get(op.name)
        if rule is None:
            continue
        role, _ = rule
        for t in op.outputs:
            if t is not None and t.storage >= 0:
                storages[t.storage].roles.add(role)
