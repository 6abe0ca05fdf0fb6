"""The device mesh a profile simulates, and a fake world of ranks to build it in one process.

`mesh={"dp": 8, "tp": 8}` names the mesh dimensions, outermost first, as
`init_device_mesh(device, (8, 8), mesh_dim_names=("dp", "tp"))` does; the world size is their
product. Each simulated rank runs in this process against torch's fake process group
(`torch.testing._internal.distributed.fake_pg`: collectives complete at once and move no data),
so the user's own torch.distributed code builds exactly the mesh, sub-groups and sharded
parameters it builds on that rank of a real job.

The default process group is process-wide state in torch.distributed: `fake_world` creates it for
one rank, and destroys it on exit, so two profiles never see each other's. A process that already
has a process group (a real job) is refused rather than disturbed.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from ..errors import TapescopeError
from ..values.mesh import MeshSpec, mesh_spec

__all__ = ["MeshSpec", "mesh_spec", "fake_world"]


@contextmanager
def fake_world(spec: MeshSpec, rank: int, device_type: str):
    """Be `rank` of a fake world of `spec.world_size` ranks; yields the DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..torch_compat import fake_store

    if not dist.is_available():
        raise TapescopeError("this build of PyTorch has no torch.distributed")
    if dist.is_initialized():
        raise TapescopeError(
            "a process group is already initialised in this process; tapescope simulates the ranks "
            "of a distributed job with torch's fake process group and needs a process without one "
            "(run it outside the training job)")
    # init_process_group wraps sys.excepthook to prefix tracebacks with "[rank<r>]: " and
    # destroy_process_group leaves the wrapper: restored here, or every traced rank would add one
    # more prefix to every later traceback of the user's process
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=spec.world_size)
    try:
        yield init_device_mesh(device_type, spec.sizes, mesh_dim_names=spec.names)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook
