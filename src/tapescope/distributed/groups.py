"""Which mesh dimensions each process group of a simulated rank spans.

Collectives name their group by a ProcessGroup object (c10d ops) or by its name (functional
collectives, what DTensor issues). While the fake world of a rank exists, every group it created
is listed with its global ranks (`distributed_c10d._world.pg_group_ranks`); the mesh dimensions a
group spans are those along which its ranks' coordinates differ. That covers the mesh's own
dimensions, groups the user flattened (`mesh["dp", "cp"]._flatten()`) and groups made by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from .mesh import MeshSpec

__all__ = ["GroupInfo", "process_groups", "group_name_of", "collective_groups"]


@dataclass(frozen=True)
class GroupInfo:
    name: str          # the process group's name (c10d group_name)
    size: int
    dims: tuple        # mesh dimensions its ranks span, outermost first
    ranks: tuple       # global ranks, in group-rank order

    @property
    def label(self) -> str:
        return "+".join(self.dims) if self.dims else "self"


def process_groups(spec: MeshSpec) -> dict[str, GroupInfo]:
    """group name -> GroupInfo for every group this (fake) rank belongs to."""
    from torch.distributed import ProcessGroup

    from ..torch_compat import process_group_ranks

    out = {}
    for pg, ranks in process_group_ranks().items():
        if not isinstance(pg, ProcessGroup):
            continue  # a group this rank is not a member of
        order = tuple(sorted(ranks, key=ranks.get))
        coords = [spec.coordinate(r) for r in order]
        dims = tuple(d for d in spec.names if len({c[d] for c in coords}) > 1)
        out[pg.group_name] = GroupInfo(pg.group_name, len(order), dims, order)
    return out


def group_name_of(arg) -> str | None:
    """The group name a collective's argument names: a ProcessGroup (boxed in a ScriptObject when
    it went through the dispatcher) or a name."""
    import torch
    from torch.distributed import ProcessGroup

    if isinstance(arg, str):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            arg = ProcessGroup.unbox(arg)
        except Exception:  # noqa: BLE001 - another kind of script object
            return None
    if isinstance(arg, ProcessGroup):
        return arg.group_name
    return None


_GROUP_ARGS = ("process_group", "group_name", "group", "pg")


def collective_groups(trace) -> dict:
    """op index -> the name of the group each collective of the trace ran on (call while the
    rank's process groups exist: a c10d op names its group by the ProcessGroup object)."""
    from ..analysis.collectives import kind_of

    out = {}
    for rec in trace.ops:
        if kind_of(rec.func) is None:
            continue
        for i, arg in enumerate(rec.func._schema.arguments):
            if arg.name in _GROUP_ARGS:
                a = rec.args[i] if i < len(rec.args) else rec.kwargs.get(arg.name)
                name = group_name_of(a)
                if name is not None:
                    out[rec.index] = name
                break
    return out
