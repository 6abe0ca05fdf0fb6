"""`step=` (the user's own training step) with `mesh=` and `parallelize=`: every rank runs the
user's step on its shards. Truth: two real gloo processes running the same step (the built-in
step with the same loss: forward, loss, backward, optimizer step, zero_grad, as the user's step
does), each rank's first and steady peak to the byte."""

import torch

import tapescope
from tapescope.validate.distributed import run_real_distributed

from . import distributed_models as dm
from . import user_step_models as um


def test_user_step_under_fsdp_matches_gloo_runs():
    p = tapescope.profile(dm.build, tapescope.spec((8, 64, dm.D)), mesh={"dp": 2},
                          parallelize=dm.fsdp, step=um.step)
    real = run_real_distributed(dm.build, (torch.randn(8, 64, dm.D),), mesh={"dp": 2},
                                parallelize=dm.fsdp, loss_fn=um.square_mean)
    for r in real:
        assert not r.late_frees and r.unstepped == 0
        assert p.ranks[r.rank].first_step_peak_bytes == r.peaks[1]
        assert p.ranks[r.rank].peak_bytes == r.peaks[2]
