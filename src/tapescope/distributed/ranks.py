"""Which simulated ranks run the same step, so that one trace stands for all of them.

A rank's step is its program (the same code on every rank) run on its shards. After the user's
`parallelize(model, mesh)` every parameter is a DTensor whose local shape on any rank follows from
its global shape, placements and that rank's mesh coordinate (DTensor's own
`_compute_local_shape_and_global_offset`, the rule FSDP2 and tensor parallelism shard by). Ranks
whose parameters have the same local shapes run the same ops on tensors of the same shapes, so
their memory and FLOPs are the same: tapescope traces the lowest rank of each such class and
reports it for all. This holds unless the step's code branches on the rank number itself (a
pipeline stage, a rank that alone computes a metric); such code is outside what these classes see.

Uneven shards make classes: FSDP over 128 ranks of a 16,032-row embedding gives 127 ranks 126 rows
and the last one 30; that rank's parameter, gradient and optimizer-state shards are smaller, and it
is traced on its own.

A rank's coordinate in a parameter's mesh is read from that mesh's structure, not from the names of
its dimensions: the user's code may build its own meshes (`init_device_mesh(..., ("fsdp",))`,
`fully_shard` without a mesh, torchtitan's ParallelDims) under names of its own. DeviceMesh keeps a
layout over the world's ranks (`_layout`, `_rank_map`: torch 2.9 and later), and
`_layout.remap_to_tensor` lists every copy of the mesh, one per group of ranks: on rank 0 it
says, for every rank, which coordinate that rank has in its own copy. Where a mesh has no layout
(older torch), a mesh whose dimension names are the profile's own is read by name; otherwise the
classes cannot be proven and every rank is traced (profile.py says so, with the time it will
take, before it starts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mesh import MeshSpec

__all__ = ["RankClasses", "rank_classes", "shard_layouts", "mesh_coordinates"]


@dataclass(frozen=True)
class RankClasses:
    """Ranks grouped by the local shapes of their parameters; `members[i]` run the same step."""

    members: tuple                 # tuple of tuples of ranks, each sorted, ordered by first rank
    provable: bool = True          # False: some parameter's mesh could not be read; every rank
                                   # is its own class

    @property
    def representatives(self) -> tuple:
        return tuple(m[0] for m in self.members)

    def of(self, rank: int) -> int:
        """The representative whose trace stands for `rank`."""
        for m in self.members:
            if rank in m:
                return m[0]
        raise KeyError(rank)


def shard_layouts(model: torch.nn.Module, spec: MeshSpec) -> list:
    """(global shape, placements, mesh shape, coordinates) of each DTensor parameter, each
    distinct layout once. `coordinates[r]` is rank r's coordinate in its copy of the parameter's
    mesh; None where the mesh does not say (then the classes cannot be proven)."""
    from torch.distributed.tensor import DTensor

    seen: dict = {}
    meshes: dict = {}   # id(mesh) -> (mesh, index into tables): each mesh read once
    tables: dict = {}   # coordinates -> index (equal meshes built twice share one)
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        known = meshes.get(id(mesh))
        if known is None:
            known = meshes[id(mesh)] = (mesh, tables.setdefault(mesh_coordinates(mesh, spec),
                                                                len(tables)))
        seen.setdefault((tuple(p.shape), tuple(p.placements), tuple(mesh.shape), known[1]), None)
    coordinates = {i: c for c, i in tables.items()}
    return [(shape, placements, mesh_shape, coordinates[i])
            for shape, placements, mesh_shape, i in seen]


def mesh_coordinates(mesh, spec: MeshSpec) -> tuple | None:
    """Every rank's coordinate in its copy of `mesh` (the copy of the mesh's layout that holds
    it), by the mesh's structure; None if some rank's cannot be read."""
    from ..torch_compat import unset_fake_mode

    world = spec.world_size
    shape = tuple(mesh.shape)
    layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
    if layout is None or rank_map is None or not hasattr(layout, "remap_to_tensor"):
        names = mesh.mesh_dim_names
        if names is None or not set(names) <= set(spec.names):
            return None
        return tuple(tuple(spec.coordinate(r)[d] for d in names) for r in range(world))
    with unset_fake_mode():  # the rank map is a small real CPU tensor
        copies = layout.remap_to_tensor(rank_map).reshape(-1, *shape).tolist()
    out: list = [None] * world
    for copy in copies:
        for index, rank in _cells(copy, ()):
            if 0 <= rank < world:
                out[rank] = index
    return None if any(c is None for c in out) else tuple(out)


def _cells(nested, index):
    """(coordinate, value) of each cell of a nested list."""
    if not isinstance(nested, list):
        yield index, nested
        return
    for i, x in enumerate(nested):
        yield from _cells(x, index + (i,))


def _chunk(n: int, k: int, i: int) -> int:
    """Size of chunk i of n split into k (torch.chunk, as DTensor's Shard and FSDP2 split)."""
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def _shape_rule(shape, mesh_shape, placements, coords):
    """coordinate -> local shape for one layout. DTensor's own rule
    (`_compute_local_shape_and_global_offset`) builds index tensors for a strided shard (FSDP2
    over a tensor-parallel dimension): ~3 ms per coordinate, minutes for 1,024 ranks. For the
    placements FSDP2 and tensor parallelism use, the shape is nested torch.chunk sizes: the plain
    Shard dims first, then the strided ones (FSDP2 shards the tensor-parallel shard). That rule is
    checked against DTensor's at the mesh's extremes and a spread of coordinates; on any
    difference, or another placement, DTensor's rule is used for every coordinate."""
    from torch.distributed.tensor import Replicate, Shard

    from ..torch_compat import StridedShard, local_shard_shape

    def exact(c):
        return local_shard_shape(shape, mesh_shape, c, placements)

    if not all(isinstance(p, (Replicate, Shard, StridedShard)) for p in placements):
        return exact
    order = [m for m, p in enumerate(placements) if type(p) is Shard] + \
            [m for m, p in enumerate(placements) if isinstance(p, StridedShard)]

    def fast(c):
        sizes = list(shape)
        for m in order:
            d = placements[m].dim
            sizes[d] = _chunk(sizes[d], mesh_shape[m], c[m])
        return tuple(sizes)

    distinct = sorted(set(coords))
    step = max(1, len(distinct) // 8)
    for c in distinct[::step] + distinct[-1:]:
        if fast(c) != exact(c):
            return exact
    return fast


def rank_classes(spec: MeshSpec, layouts: list) -> RankClasses:
    """Group the ranks of `spec` by the local shapes of every layout in `layouts`."""
    world = spec.world_size
    if any(coords is None for _, _, _, coords in layouts):
        return RankClasses(tuple((r,) for r in range(world)), provable=False)
    signatures: list[list] = [[] for _ in range(world)]
    for shape, placements, mesh_shape, coords in layouts:
        local_shape = _shape_rule(shape, mesh_shape, placements, coords)
        cache: dict = {}
        for r in range(world):
            c = coords[r]
            local = cache.get(c)
            if local is None:
                local = cache[c] = local_shape(c)
            signatures[r].append(local)
    groups: dict = {}
    for r in range(world):
        groups.setdefault(tuple(signatures[r]), []).append(r)
    members = sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])
    return RankClasses(tuple(members))
