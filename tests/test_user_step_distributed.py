"""`step=` (the user's own training step) with `mesh=` and `parallelize=`: every rank runs the
user's step on its shards. Truth: two real gloo processes running the same step (the built-in
step with the same loss: forward, loss, backward, optimizer step, zero_grad, as the user's step
does), each rank's first and steady peak to the byte. As in tests/test_distributed.py, a real
peak can be higher in one run (gloo's threads free a collective's tensors late): the job runs 3
times for 3 steps, no observation is below the prediction and one equals it, or is above it by
no more than the bytes the harness saw a backend thread free late in that step (the rule of
tests/test_distributed.py: under load every run's first step can have such a late free)."""

import torch

import tapescope
from tapescope.validate.distributed import RealJob

from . import distributed_models as dm
from . import user_step_models as um
from .test_distributed import _matches, _observed_with_late_frees


# run with the other modules' real jobs of 2 ranks, in one spawn of processes (conftest.real_runs)
REAL_JOBS = {"step": [RealJob(dm.build, (torch.randn(8, 64, dm.D),), {"dp": 2}, dm.fsdp,
                              loss_fn=um.square_mean, steps=3)] * 3}


def test_user_step_under_fsdp_matches_gloo_runs(real_runs):
    p = tapescope.profile(dm.build, tapescope.spec((8, 64, dm.D)), mesh={"dp": 2},
                          parallelize=dm.fsdp, step=um.step)
    runs = real_runs[(__name__, "step")]
    for rank in range(2):
        assert all(run[rank].unstepped == 0 for run in runs)
        for predicted, steps in ((p.ranks[rank].first_step_peak_bytes, [1]),
                                 (p.ranks[rank].peak_bytes, [2, 3])):
            _matches(predicted, _observed_with_late_frees(runs, [rank], steps), tolerance=0)
