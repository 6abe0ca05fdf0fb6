"""Context parallelism as torch writes it: the user's step wraps forward and backward in
`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`,
which shards the sequence over the "cp" mesh dimension and runs ring attention in place of SDPA
(`step=` with `mesh=`), GPU-less for an H100 (CP takes CUDA's attention ops only).

Truth: the collectives of torch's ring attention, derived by hand from its code
(torch/distributed/tensor/experimental/_context_parallel/_attention.py): forward, the default
all-gather rotater gathers each rank's `cat(key, value)` once; backward gathers it again, and
passes the key/value gradients (fp32: `_cp_options.convert_to_f32`) around the ring with an
all-to-all (`permute_tensor`) at each of its `cp` steps. No real run checks the memory: CP's
attention ops are CUDA's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope

HEADS, HEAD_DIM, SEQ, BATCH, CP = 4, 64, 512, 2, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


def parallelize(model, mesh):
    model.cp_mesh = mesh  # what the step's context_parallel shards over
    return model


def step(model, batch, optimizer):
    from torch.distributed.tensor.experimental import context_parallel

    (x,) = batch
    with context_parallel(model.cp_mesh, buffers=[x], buffer_seq_dims=[1]):
        loss = model(x).float().square().mean()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_context_parallel_ring_attention_collectives():
    p = tapescope.profile(Attention, tapescope.spec((BATCH, SEQ, HEADS * HEAD_DIM)),
                          mesh={"cp": CP}, parallelize=parallelize, step=step, gpu="h100",
                          dtype=torch.bfloat16)
    local = BATCH * HEADS * (SEQ // CP) * HEAD_DIM  # one rank's keys (or values)
    kv_gathered = CP * 2 * local * 2                # cat(k, v) of every rank, bf16
    dkv = 2 * local * 4                             # cat(dk, dv) of this rank, fp32
    seen = [(c.kind, c.nbytes, c.phase) for c in p.collectives]
    assert [s for s in seen if s[2] == "forward"] == [("all_gather", kv_gathered, "forward")]
    assert sorted(s for s in seen if s[2] == "backward") == sorted(
        [("all_gather", kv_gathered, "backward")] + [("all_to_all", dkv, "backward")] * CP)
