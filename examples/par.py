"""Your own parallelisation, as a training script has it: tensor parallel on each block's MLP
(Megatron-style: `up` split by columns, `down` by rows) inside FSDP2 over the data-parallel
dimension, 2-D.

    tapescope profile examples/model.py:build --input 4,2048:int64 \
        --parallelize examples/par.py:parallelize --mesh dp=4,tp=2

tapescope calls `parallelize(model, mesh)` on every simulated rank, with `mesh` a DeviceMesh whose
dimensions are named as `--mesh` names them.
"""

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def parallelize(model, mesh):
    for block in model.layers:
        parallelize_module(block, mesh["tp"],
                           {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])
