"""The device mesh a distributed profile simulates (`MeshSpec`: dimension names and sizes,
outermost first, as `init_device_mesh(device, sizes, mesh_dim_names=names)` takes them)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TapescopeError

__all__ = ["MeshSpec", "mesh_spec"]


@dataclass(frozen=True)
class MeshSpec:
    names: tuple
    sizes: tuple

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def coordinate(self, rank: int) -> dict:
        """Rank -> its index along each named dimension (row-major, as init_device_mesh lays
        ranks out)."""
        out = {}
        for name, size in zip(reversed(self.names), reversed(self.sizes)):
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in self.names}

    def as_dict(self) -> dict:
        return dict(zip(self.names, self.sizes))

    def __str__(self) -> str:
        return " x ".join(f"{n} {s}" for n, s in zip(self.names, self.sizes))


def mesh_spec(mesh) -> MeshSpec:
    """A MeshSpec from {"dp": 4, "tp": 2} (or a MeshSpec)."""
    if isinstance(mesh, MeshSpec):
        return mesh
    if not isinstance(mesh, dict) or not mesh:
        raise TapescopeError(f"mesh must name its dimensions and sizes, e.g. mesh={{'dp': 4, 'tp': 2}}; "
                             f"got {mesh!r}")
    for name, size in mesh.items():
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) \
                or size < 1:
            raise TapescopeError(f"mesh dimension {name!r}: {size!r} must be a name and a size >= 1")
    return MeshSpec(tuple(mesh), tuple(mesh.values()))
