"""FSDP2 with each block compiled (torchtitan's apply_compile), against real multi-process runs.

Truth: `validate.distributed.run_real_jobs` runs the step in one process per rank (gloo, CPU),
with a parallelize function that compiles each block for real (`block.compile(fullgraph=True)`,
inductor's C++ backend) and then applies FSDP2 to every block and the root, in torchtitan's order;
each rank's allocator is read through torch.profiler memory events. tapescope profiles the same
model with `mesh=` and `compile=True`: it compiles each transformer block of the parallelised
model (or the modules the parallelize compiled itself) with its own backend (compile_blocks).
One spawn of 2 processes for both jobs; the real compile dominates the time.
"""

import pytest

import tapescope
from tapescope.validate.distributed import RealJob, run_real_jobs

from . import distributed_models as dm

STEPS = 3    # steps 2 and 3 are both the steady state
REPEATS = 2  # gloo may free a collective's buffer late (tests/test_distributed.py): more observations


@pytest.fixture(scope="module")
def real():
    jobs = [RealJob(dm.build, (dm.INPUT,), {"dp": 2}, par, steps=STEPS)
            for par in (dm.fsdp_compiled, dm.fsdp) for _ in range(REPEATS)]
    runs = run_real_jobs(jobs)
    return runs[:REPEATS], runs[REPEATS:]


def _matches(pred: int, observed: list, tolerance: int = 16) -> None:
    # a late free only ever raises a peak: the least observation is the program's own, and none
    # is below it; 16 B: the CPU kernels' Python-scalar temporaries (tests/test_distributed.py)
    assert abs(min(observed) - pred) <= tolerance, (pred, sorted(observed))
    assert all(o >= pred - tolerance for o in observed), (pred, sorted(observed))


@pytest.mark.parametrize("parallelize", [dm.fsdp, dm.fsdp_compiled],
                         ids=["tapescope compiles the blocks", "parallelize compiles them"])
def test_fsdp_with_compiled_blocks_matches_every_real_rank(real, parallelize):
    """With the plain FSDP2 parallelize, tapescope compiles each transformer block; with the one
    that calls `block.compile()` itself, those modules are the ones compiled (with tapescope's
    backend)."""
    compiled, eager = real
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=parallelize,
                          compile=True)
    assert p.compiled is not None and not p.compiled.graph_breaks
    for side, runs in ((p, compiled), (p.eager, eager)):
        for members in side.distributed.classes.members:
            rep = side.ranks[members[0]]
            _matches(rep.first_step_peak_bytes, [run[r].peaks[1] for run in runs for r in members])
            _matches(rep.peak_bytes, [run[r].peaks[s] for run in runs for r in members
                                      for s in range(2, STEPS + 1)])
    # compiling the blocks lowers the peaks, in reality and in tapescope
    assert min(run[0].peaks[1] for run in compiled) < min(run[0].peaks[1] for run in eager)
    assert p.ranks[0].peak_bytes < p.eager.ranks[0].peak_bytes


def test_distributed_compile_needs_repeated_blocks():
    import torch.nn as nn

    from tapescope.errors import TapescopeError

    with pytest.raises(TapescopeError, match="transformer block"):
        tapescope.profile(lambda: nn.Sequential(nn.Linear(64, 64)), dm.INPUT, mesh={"dp": 2},
                          parallelize=lambda m, mesh: m, compile=True)


def test_cli_fsdp_compiled_llama_on_h100():
    """`tapescope profile zoo:llama --device cuda --gpu h100 --amp bf16 --compile --fsdp 2`,
    GPU-less: FSDP2 with each block compiled, eager and compiled side by side."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_LLAMA

    r = CliRunner().invoke(app, ["profile", TINY_LLAMA, "--batch", "2", "--seq", "32",
                                 "--device", "cuda", "--gpu", "h100", "--amp", "bf16",
                                 "--compile", "--fsdp", "2", "-q"])
    assert r.exit_code == 0, r.output
    assert "Eager vs torch.compile (backend=inductor" in r.output and "dp_shard 2" in r.output
    assert "0 graph breaks" in r.output


def test_modules_the_model_compiled_run_eagerly_without_compile(real):
    """Without compile=, modules compiled by the user's code run eagerly (a real compile would
    run inductor's kernels on fake tensors) and the profile says so: the eager truth."""
    _, eager = real
    p = tapescope.profile(dm.build, dm.INPUT, mesh={"dp": 2}, parallelize=dm.fsdp_compiled)
    assert any("Module.compile()" in n for n in p.facts["isolation_notes"])
    _matches(p.ranks[0].first_step_peak_bytes, [run[r].peaks[1] for run in eager for r in (0, 1)])
