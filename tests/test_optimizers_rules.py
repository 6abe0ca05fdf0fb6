"""torch's own optimizer steps run outside the capture's FunctionRulesMode
(capture/optimizers.py, `steps_outside_function_rules`): a speed change that must change nothing.

Two proofs for each optimizer an option names, per-parameter, foreach and fused, with and without
momentum: (1) with the mode kept, the FUNCTION rules the step's own calls (torch/optim's frames)
reach are only torch.tensor (a step counter: the literal's ops are torch.tensor's whether or not
its maker was seen) and mul / div by a Python number with grad off (nothing saved for a backward);
(2) the trace (every op with its arguments, outputs and source line, every storage event) is
the same with the mode lifted as with it kept.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import tapescope
from tapescope.capture import optimizers, session
from tapescope.capture.fidelity import registry
from tapescope.capture.fidelity.literals import LITERAL_OPS, literal_ops
from tapescope.capture.fidelity.wrapped_numbers import _SAVING

OPTIONS = [
    lambda ps: torch.optim.AdamW(ps, foreach=False),
    lambda ps: torch.optim.AdamW(ps, foreach=True, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, foreach=False, weight_decay=0.1, maximize=True),
    lambda ps: torch.optim.Adam(ps, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    lambda ps: torch.optim.AdamW(ps, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
]
IDS = ["adamw", "adamw-foreach-amsgrad", "adam-wd-maximize", "adam-foreach", "sgd-nesterov",
       "sgd-foreach-momentum", "sgd", "adamw-fused", "sgd-fused-momentum"]


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def _trace(opt, keep_mode: bool, monkeypatch):
    if keep_mode:
        monkeypatch.setattr(session, "steps_outside_function_rules", lambda optimizer: False)
    p = tapescope.profile(_model, torch.randn(4, 8), optimizer=opt)
    monkeypatch.undo()
    t = p.trace
    # autograd's sequence numbers count from the process's start: relative to the capture's
    # (AccumulateGrad's, UINT64_MAX, as it is)
    ops = [(op.name, op.phase, op.step, repr(op.args), repr(op.kwargs), op.outputs, op.inputs,
            op.seq_nr - t.seq_base if op.seq_nr is not None and op.seq_nr < 2**63 else op.seq_nr,
            op.owns_node, op.grad_fn,
            op.module, str(op.frame)) for op in t.ops]
    storages = [(s.id, s.nbytes, s.created_by, sorted(s.roles)) for s in t.storages]
    return ops, storages, list(t.events), t.step2, p.peak_bytes


@pytest.mark.parametrize("opt", OPTIONS, ids=IDS)
def test_the_step_reaches_only_rules_that_do_nothing_there(opt, monkeypatch):
    reached = []  # (function, grad enabled) for each rule call made from torch/optim's code
    optim_dir = torch.optim.__file__.rsplit("__init__.py", 1)[0]
    call = registry.FidelityContext.call

    seen = []  # every rule call: the spy's own check (the model's F.linear has a rule)

    def spying(self, func, args, kwargs):
        seen.append(func)
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(optim_dir):
            frame = frame.f_back
        if frame is not None:
            reached.append((func, torch.is_grad_enabled()))
        return call(self, func, args, kwargs)

    monkeypatch.setattr(registry.FidelityContext, "call", spying)
    monkeypatch.setattr(session, "steps_outside_function_rules", lambda optimizer: False)
    tapescope.profile(_model, torch.randn(4, 8), optimizer=opt)
    assert torch.nn.functional.linear in seen, "the spy no longer watches the mode's rule calls"
    for func, grad in reached:
        assert func is torch.tensor or (func in _SAVING and not grad), func
    # a literal made by torch.tensor gives the ops a literal whose maker was not seen gets
    unseen = registry.FidelityContext(torch.device("cpu"))
    assert literal_ops(unseen) == LITERAL_OPS[torch.tensor]


@pytest.mark.parametrize("opt", OPTIONS, ids=IDS)
def test_the_trace_is_the_same_without_the_mode(opt, monkeypatch):
    lifted = _trace(opt, False, monkeypatch)
    kept = _trace(opt, True, monkeypatch)
    assert lifted == kept


def test_only_torchs_own_plain_step_runs_outside_the_mode():
    ps = [nn.Parameter(torch.zeros(2))]
    assert optimizers.steps_outside_function_rules(torch.optim.AdamW(ps))

    class Mine(torch.optim.AdamW):  # may override step()
        pass

    assert not optimizers.steps_outside_function_rules(Mine(ps))
    assert not optimizers.steps_outside_function_rules(torch.optim.AdamW(ps, differentiable=True))
    assert not optimizers.steps_outside_function_rules(torch.optim.RMSprop(ps))  # not audited
    hooked = torch.optim.SGD(ps, lr=0.1)
    handle = hooked.register_step_post_hook(lambda *a: None)
    assert not optimizers.steps_outside_function_rules(hooked)
    handle.remove()
    assert optimizers.steps_outside_function_rules(hooked)
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert not optimizers.steps_outside_function_rules(hooked)
    finally:
        handle.remove()


def test_a_hook_that_makes_a_literal_keeps_its_maker(monkeypatch):
    """A step hook is the user's code: the mode stays, and as_tensor's literal is as_tensor's."""
    def opt(ps):
        o = torch.optim.SGD(ps, lr=0.1)
        o.register_step_post_hook(lambda *a: torch.as_tensor(3.0))
        return o

    ops = [op.name for op in tapescope.profile(_model, torch.randn(4, 8), optimizer=opt).trace.ops
           if op.phase == "optimizer"]
    monkeypatch.setattr(session, "steps_outside_function_rules", lambda optimizer: False)
    kept = [op.name for op in tapescope.profile(_model, torch.randn(4, 8), optimizer=opt).trace.ops
            if op.phase == "optimizer"]
    assert ops == kept
    # one a step, as_tensor's (empty, lift_fresh), not torch.tensor's (an unseen maker's: + detach_)
    assert ops.count("aten.lift_fresh.default") == 2 and "aten.detach_.default" not in ops
