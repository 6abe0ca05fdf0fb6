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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mesh import MeshSpec

__all__ = ["RankClasses", "rank_classes", "shard_layouts"]


@dataclass(frozen=True)
class RankClasses:
    """Ranks grouped by the local shapes of their parameters; `members[i]` run the same step."""

    members: tuple                 # tuple of tuples of ranks, each sorted, ordered by first rank
    provable: bool = True          # False: some parameter's mesh could not be read; every rank
                                   # with distinct coordinates is its own class

    @property
    def representatives(self) -> tuple:
        return tuple(m[0] for m in self.members)

    def of(self, rank: int) -> int:
        """The representative whose trace stands for `rank`."""
        for m in self.members:
            if rank in m:
                return m[0]
        raise KeyError(rank)


def shard_layouts(model: torch.nn.Module) -> list:
    """(global shape, placements, mesh dim names, mesh shape) of each DTensor parameter, each
    distinct layout once; None for a mesh without names."""
    from torch.distributed.tensor import DTensor

    seen = {}
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        key = (tuple(p.shape), tuple(p.placements), mesh.mesh_dim_names, tuple(mesh.shape))
        seen.setdefault(key, None)
    return list(seen)


def _chunk(n: int, k: int, i: int) -> int:
    """Size of chunk i of n split into k (torch.chunk, as DTensor's Shard and FSDP2 split)."""
    c = -(-n // k)
    return max(0, min(c, n - i * c))


def _shape_rule(shape, mesh_shape, placements, dims, coords):
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

    distinct = sorted({tuple(co[d] for d in dims) for co in coords})
    step = max(1, len(distinct) // 8)
    for c in distinct[::step] + distinct[-1:]:
        if fast(c) != exact(c):
            return exact
    return fast


def rank_classes(spec: MeshSpec, layouts: list) -> RankClasses:
    """Group the ranks of `spec` by the local shapes of every layout in `layouts`."""
    world = spec.world_size
    names = set(spec.names)
    provable = all(dims is not None and set(dims) <= names for _, _, dims, _ in layouts)
    if not provable:
        return RankClasses(tuple((r,) for r in range(world)), provable=False)
    # per layout, the local shape depends only on the coordinates along its mesh's dims
    signatures: list[list] = [[] for _ in range(world)]
    coords = [spec.coordinate(r) for r in range(world)]
    for shape, placements, dims, mesh_shape in layouts:
        local_shape = _shape_rule(shape, mesh_shape, placements, dims, coords)
        cache: dict = {}
        for r in range(world):
            c = tuple(coords[r][d] for d in dims)
            local = cache.get(c)
            if local is None:
                local = cache[c] = local_shape(c)
            signatures[r].append(local)
    groups: dict = {}
    for r in range(world):
        groups.setdefault(tuple(signatures[r]), []).append(r)
    members = sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])
    return RankClasses(tuple(members))
