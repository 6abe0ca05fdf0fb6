"""Shared helpers: small models, and the real-run ground truth."""

import math
import os

import pytest
import torch
import torch.nn as nn

import tapescope
from tapescope.zoo import resolve

# Small zoo configurations: every layer kind of the full models, at test speed.
TINY_GPT2 = "zoo:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=128,block_size=64"
TINY_LLAMA = "zoo:llama:dim=64,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=160,vocab_size=128"


def optimizer_in_backward(model, make_optimizer):
    """torchtune's optimizer_in_bwd: one optimizer per parameter (`make_optimizer([p])`), stepped
    by the parameter's post-accumulate-grad hook as soon as its gradient is accumulated, the
    gradient freed right after. Returns the optimizers (what a step's setup keeps)."""
    optimizers = {p: make_optimizer([p]) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return optimizers


def tiny(spec, batch=2, seq=32):
    return resolve(spec, batch=batch, seq=seq)


def profile_spec(m, **kw):
    return tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn, **kw)


class MLP(nn.Module):
    def __init__(self, d=16, h=32, out=4):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), nn.GELU(), nn.Linear(h, out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_calibration_from_the_environment(monkeypatch):
    """A TAPESCOPE_CALIBRATION of the shell running the tests would price every CUDA profile's
    time from that file; tests that use one set it themselves."""
    monkeypatch.delenv("TAPESCOPE_CALIBRATION", raising=False)


@pytest.fixture(scope="session")
def real_runs(request):
    """The real gloo runs of every collected test module that declares REAL_JOBS ({key: [RealJob,
    ...]}), run in one spawn of processes per world size: starting a world (each process imports
    torch and tapescope) costs about 9 s of CPU for 2 ranks, more than a small job. Each job is a
    profiler session of its own, read from its own allocator events (validate/distributed.py), as
    the jobs of one module already were. Returns {(module name, key): [each job's ranks]}.

    Only the modules with a selected test that uses this fixture contribute, in name order, so a
    file run alone runs its own jobs alone. Under pytest-xdist a worker is sent its files one at a
    time and never knows which it will get, so there each module's jobs run when the module first
    asks for them (one spawn per module and world size)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return _RealRunsPerModule(request.session)
    modules = {item.module for item in request.session.items
               if "real_runs" in getattr(item, "fixturenames", ())}
    return _run_modules_jobs(modules)


def _run_modules_jobs(modules) -> dict:
    """{(module name, key): [each job's ranks]} for every REAL_JOBS of `modules`, one spawn of
    processes per world size."""
    from tapescope.validate.distributed import run_real_jobs

    by_world: dict = {}  # world size -> [(module name, key, jobs)]
    for module in sorted(modules, key=lambda m: m.__name__):
        for key, jobs in module.REAL_JOBS.items():
            worlds = {math.prod(job.mesh.values()) for job in jobs}
            assert len(worlds) == 1, (module.__name__, key, worlds)
            by_world.setdefault(worlds.pop(), []).append((module.__name__, key, list(jobs)))
    out = {}
    for groups in by_world.values():
        runs = iter(run_real_jobs([job for _, _, jobs in groups for job in jobs]))
        for name, key, jobs in groups:
            out[(name, key)] = [next(runs) for _ in jobs]
    return out


class _RealRunsPerModule(dict):
    """real_runs under pytest-xdist: a module's jobs run on its first lookup."""

    def __init__(self, session):
        super().__init__()
        self._modules = {item.module.__name__: item.module for item in session.items
                         if "real_runs" in getattr(item, "fixturenames", ())}

    def __missing__(self, key):
        self.update(_run_modules_jobs([self._modules[key[0]]]))
        return self[key]
