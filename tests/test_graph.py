"""The step's FX graph and the forward<->backward map (the SeqNr|OrigAten|SrcFn table)."""

import torch
import torch.nn as nn

import tapescope


class ConvBnFc(nn.Module):
    """The model of the AOTAutograd seq_nr commit: conv, batch norm, relu, add, flatten, fc, L1."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu1 = nn.ReLU()
        self.fc1 = nn.Linear(4 * 6 * 6, 2)
        self.loss_fn = nn.L1Loss()

    def forward(self, x, target):
        y = self.relu1(self.bn1(self.conv1(x))) + 2
        return self.loss_fn(self.fc1(torch.flatten(y, 1)), target)


def _profile():
    return tapescope.profile(ConvBnFc, tapescope.spec((2, 1, 8, 8)), tapescope.spec((2, 2)),
                             optimizer=None, steps=1)


def test_backward_ops_map_to_their_forward_ops():
    p = _profile()
    pairs = {(p.ops[op.forward_op].name.split(".")[1], op.name.split(".")[1])
             for op in p.ops if op.phase == "backward" and op.forward_op is not None}
    # derivatives.yaml: each forward op's backward formula
    expected = {("convolution", "convolution_backward"),
                ("native_batch_norm", "native_batch_norm_backward"),
                ("relu", "threshold_backward"),
                ("addmm", "mm"), ("addmm", "sum"), ("addmm", "view"),
                ("abs", "sgn"), ("abs", "mul"),
                ("mean", "expand"), ("mean", "div")}
    assert expected <= pairs
    mods = {op.name.split(".")[1]: op.module for op in p.ops if op.phase == "backward"}
    assert mods["convolution_backward"] == "conv1"
    assert mods["native_batch_norm_backward"] == "bn1"
    assert mods["threshold_backward"] == "relu1"
    assert mods["sgn"] == "loss_fn"


def test_graph_has_one_node_per_op_with_meta():
    p = _profile()
    gm = p.graph
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "phase" in n.meta]
    assert [n.target for n in calls] == [op.record.func for op in p.ops]
    for n, op in zip(calls, p.ops):
        assert n.meta["phase"] == op.phase and n.meta["seq_nr"] == op.seq_nr
        assert n.meta["nn_module"] == op.module and n.meta["flops"] == op.flops
        assert n.meta["saved"] == op.saved
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    assert {"conv1_weight", "bn1_running_mean", "fc1_bias", "input0", "input1"} <= placeholders
    assert "convolution_backward" in gm.code  # the graph module compiles to Python


def test_backward_reads_the_forward_tensors_it_saved():
    """Saved activations connect forward nodes to the backward nodes that use them."""
    p = _profile()
    gm = p.graph
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    users = {u.target for u in relu.users}
    assert torch.ops.aten.threshold_backward.default in users
    assert relu.meta["saved"]
