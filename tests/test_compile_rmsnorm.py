"""The forum post's program (shared/reference/000_*.txt): nn.RMSNorm(8) compiled with
`aot_autograd(fw_compiler=...)`, dynamic=True, an input that requires grad. Its forward and backward
graphs, as tapescope shows them, against (1) the same program run for real with torch.compile on
this machine, node for node, and (2) the graphs the post printed.

Which graphs a device gets is decided in two places, both keyed on the device:
- autograd: `rms_norm` (CompositeImplicitAutograd) calls `_fused_rms_norm`, whose Autograd kernel
  records `FusedRmsNormBackward0` on every device, so the backward is `_fused_rms_norm_backward`;
- below autograd, AOTAutograd's functionalization and proxy modes decompose a
  CompositeImplicitAutograd op only if "autograd would have decomposed" it, i.e. the device has no
  backend kernel for it (`torch.utils._python_dispatch.autograd_would_have_decomposed`, PyTorch
  PR #164939, Oct 2025). `_fused_rms_norm` has a CUDA kernel and none for Meta or CPU.

So with this torch: meta gives a decomposed forward and the fused backward - node for node the
post's CUDA pair; CUDA keeps `_fused_rms_norm` in the forward too (the post's build, of July 2025,
predates #164939 and decomposed it); the CPU, where autograd decomposes above the fused op, gives
the post's meta pair. CUDA cannot be compiled for real without a GPU (the C++ engine stops in the
joint trace); its truth here is torch.compile's own pipeline with the same dispatch decision: a
CPU kernel registered for `_fused_rms_norm` for the test's duration, and real torch's forward
decision on fake CUDA tensors (an inference compile, which needs no backward). Detach chains
(saved-variable unpacking) moved between versions, so comparisons with the post leave them out.
"""

import re
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd

import tapescope

OPTIONS = {"backend": "aot_eager", "dynamic": True, "fullgraph": True}

# The post's graphs: (node name, aten op) of each call_function node but detach, and what the
# forward returns (its output, then what it saves) with primals named by what they are.
POST_META_FORWARD = [("pow_1", "pow.Tensor_Scalar"), ("mean", "mean.dim"), ("add_9", "add.Scalar"),
                     ("rsqrt", "rsqrt.default"), ("mul_8", "mul.Tensor"), ("mul_11", "mul.Tensor")]
POST_META_SAVES = ["weight", "input", "rsqrt", "mul_8", "batch"]
POST_META_BACKWARD = [
    ("mul_17", "mul.Tensor"), ("mul_18", "mul.Tensor"), ("sum_1", "sum.dim_IntList"),
    ("view", "view.default"), ("mul_19", "mul.Tensor"), ("mul_20", "mul.Tensor"),
    ("sum_2", "sum.dim_IntList"), ("mul_21", "mul.Scalar"), ("pow_2", "pow.Tensor_Scalar"),
    ("mul_22", "mul.Tensor"), ("expand", "expand.default"), ("div", "div.Scalar"),
    ("pow_3", "pow.Tensor_Scalar"), ("mul_23", "mul.Scalar"), ("mul_24", "mul.Tensor"),
    ("add_25", "add.Tensor")]
POST_CUDA_FORWARD = [("pow_1", "pow.Tensor_Scalar"), ("mean", "mean.dim"), ("add_9", "add.Scalar"),
                     ("rsqrt", "rsqrt.default"), ("mul_6", "mul.Tensor"), ("mul_9", "mul.Tensor")]
POST_CUDA_SAVES = ["weight", "input", "rsqrt", "batch"]
POST_CUDA_BACKWARD = [("_fused_rms_norm_backward", "_fused_rms_norm_backward.default"),
                      ("getitem", "getitem"), ("getitem_1", "getitem")]
POST_CUDA_BACKWARD_OPS = [op for _, op in POST_CUDA_BACKWARD]


def _build():
    return nn.RMSNorm(8)


def _tapescope_graphs(device):
    p = tapescope.profile(_build, tapescope.spec((4, 8), requires_grad=True), device=device,
                          optimizer=None, steps=1, compile=OPTIONS)
    g = {x.kind: x.graph for x in p.compiled.graphs}
    return g["forward"], g["backward"], p


def _real_graphs(device, fake=False):
    """The post's own program, run for real here (on fake tensors of the device if `fake`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode() if fake else nullcontext():
        x = torch.randn(4, 8, device=device, requires_grad=True)
        rmsnorm = nn.RMSNorm(8, device=device)

    def example_rmsnorm(tensor):
        return rmsnorm(tensor)

    fn = torch.compile(example_rmsnorm, backend=aot_autograd(fw_compiler=backend), **{
        k: v for k, v in OPTIONS.items() if k != "backend"})
    fn(x).sum().backward()
    return graphs[0], graphs[1]


def _what(node) -> str:
    """A placeholder by what it is: the weight, the input, the symbolic batch; else its name."""
    v = node.meta.get("val")
    if isinstance(v, torch.SymInt):
        return "batch"
    if node.op == "placeholder" and node.name.startswith("primals"):
        return "weight" if v.dim() == 1 else "input"
    return node.name


def _canonical(gm) -> list:
    """Each node as (name, op, shape), placeholders by what they are, symbols as 's'."""
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        shape = None
        if isinstance(v, torch.Tensor):
            shape = tuple(re.sub(r"s\d+", "s", str(d)) for d in v.shape)
        if n.op == "placeholder":
            out.append(("input", _what(n), shape))
        elif n.op == "call_function":
            out.append((n.name, str(getattr(n.target, "__name__", n.target)), shape))
        elif n.op == "output":
            out.append(("output", tuple(None if a is None else _what(a) for a in n.args[0]), None))
    return out


def _sorted_placeholders(c):
    return sorted(x for x in c if x[0] == "input") + [x for x in c if x[0] != "input"]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_graphs_equal_torch_compile_here_node_for_node(device):
    fw, bw, _ = _tapescope_graphs(device)
    real_fw, real_bw = _real_graphs(device)
    for ours, real in ((fw, real_fw), (bw, real_bw)):
        a, b = _canonical(ours), _canonical(real)
        # graph inputs come in a different order (tapescope's trampoline passes the input
        # first); every node, its name, op and symbolic shape, is the same
        assert _sorted_placeholders(a)[:-1] == _sorted_placeholders(b)[:-1]
        out_a, out_b = a[-1][1], b[-1][1]
        assert sorted(map(str, out_a)) == sorted(map(str, out_b))


def _ops(gm, phase_nodes="call_function"):
    return [(n.name, str(n.target.__name__ if hasattr(n.target, "__name__") else n.target))
            for n in gm.graph.nodes if n.op == phase_nodes
            and "detach" not in str(n.target)]


def test_post_meta_graph_is_todays_decomposed_graph():
    """The post's meta graphs, node for node (detach nodes aside): the decomposition autograd
    records when `_fused_rms_norm` has no kernel for the device - on this torch, the CPU."""
    fw, bw, p = _tapescope_graphs("cpu")
    assert _ops(fw) == POST_META_FORWARD
    # the same nodes; two independent ones (pow_2, mul_21) come in the other topological order
    assert sorted(_ops(bw)) == sorted(POST_META_BACKWARD)
    saves = [_what(a) for a in next(iter(reversed(fw.graph.nodes))).args[0][1:]]
    assert sorted(s for s in saves if not s.startswith("detach")) == sorted(POST_META_SAVES)
    # the batch is one symbol everywhere (dynamic=True)
    symbols = {str(d) for n in list(fw.graph.nodes) + list(bw.graph.nodes)
               for d in getattr(n.meta.get("val"), "shape", ()) if not isinstance(d, int)}
    assert len(symbols) == 1 and re.fullmatch(r"s\d+", symbols.pop())


def _saves(fw) -> list:
    """What the forward returns for the backward, a detach (saved-variable unpacking, which moved
    between versions) by the node it detaches."""
    out = []
    for a in next(iter(reversed(fw.graph.nodes))).args[0][1:]:
        while a.op == "call_function" and a.target is torch.ops.aten.detach.default:
            a = a.args[0]
        out.append(_what(a))
    return sorted(out)


def test_post_cuda_pair_is_todays_meta_pair():
    """The post's CUDA graphs, node for node (names and ops, detach nodes aside): a decomposed
    forward saving the rsqrt, and one `_fused_rms_norm_backward`. With this torch that is what a
    device without a `_fused_rms_norm` kernel gives, meta (the real compile's, above)."""
    fw, bw, _ = _tapescope_graphs("meta")
    assert _ops(fw) == POST_CUDA_FORWARD
    assert _ops(bw) == POST_CUDA_BACKWARD
    assert _saves(fw) == sorted(POST_CUDA_SAVES)


def test_cuda_graphs_equal_torch_compile_where_the_kernel_exists():
    """On cuda (fake tensors, no GPU) tapescope's forward keeps `_fused_rms_norm` and the backward
    is `_fused_rms_norm_backward`: node for node (names, ops, symbolic shapes, what is saved) the
    graphs real torch.compile makes on a device with a `_fused_rms_norm` kernel; and real torch
    keeps the op in the forward on fake CUDA tensors (GPU-less inference compile, no backward)."""
    fw, bw, _ = _tapescope_graphs("cuda")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")
    # a CPU kernel for `_fused_rms_norm` while the real compile runs, as CUDA has one (it computes
    # the op's own decomposition): the dispatcher then answers "does the device have a backend
    # kernel?" as for CUDA, on a device whose autograd engine runs without a GPU (the Python
    # dispatcher caches per op which kernel a key resolves to: emptied when the kernel comes and
    # when it goes)
    op = torch.ops.aten._fused_rms_norm.default
    with torch.library._scoped_library("aten", "IMPL") as lib:
        lib.impl("_fused_rms_norm", lambda x, shape, w, eps: op.decompose(x, shape, w, eps), "CPU")
        op._dispatch_cache.clear()
        try:
            real_fw, real_bw = _real_graphs("cpu", fake=True)
        finally:
            op._dispatch_cache.clear()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU")
    for ours, real in ((fw, real_fw), (bw, real_bw)):
        a, b = _canonical(ours), _canonical(real)
        assert _sorted_placeholders(a)[:-1] == _sorted_placeholders(b)[:-1]
        assert sorted(map(str, a[-1][1])) == sorted(map(str, b[-1][1]))
    assert _ops(fw) == [("_fused_rms_norm", "_fused_rms_norm.default"), ("getitem", "getitem"),
                        ("getitem_1", "getitem")]

    # the forward decision on CUDA itself, by real torch.compile without a GPU
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []
    torch._dynamo.reset()
    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
        rmsnorm = nn.RMSNorm(8, device="cuda")
    fn = torch.compile(lambda t: rmsnorm(t), backend=aot_autograd(
        fw_compiler=lambda gm, ex: graphs.append(gm) or gm.forward), dynamic=True, fullgraph=True)
    with torch.no_grad():
        fn(x)
    assert [op for _, op in _ops(graphs[0])] == ["_fused_rms_norm.default", "getitem"]


def test_post_cuda_graph_without_a_gpu():
    """On cuda (fake tensors, no GPU): the forward saves the rsqrt and the primals, and the
    backward is the post's, one `_fused_rms_norm_backward` (its getitems numbered after the
    forward's, which keeps the fused op on this torch)."""
    fw, bw, p = _tapescope_graphs("cuda")
    assert [op for _, op in _ops(bw)] == POST_CUDA_BACKWARD_OPS
    assert _saves(fw) == sorted(["weight", "input", "getitem_1", "batch"])  # getitem_1: the rstd
    saved = {s.input or s.name: s for s in p.compiled.saved}
    assert set(saved) == {"input 0", "weight", next(s.name for s in p.compiled.saved
                                                    if s.input is None)}
    rsqrt = next(s for s in p.compiled.saved if s.input is None)
    assert rsqrt.shape[1:] == (1,) and rsqrt.dtype == "float32"  # rsqrt of the mean: [batch, 1]
    assert p.compiled.saved_symbols  # the symbolic batch is saved for the backward's shapes


def test_cli_compile_side_by_side_json(tmp_path):
    """`tapescope profile --compile` prints eager and compiled side by side and --json has both
    (aot_eager on cuda without a GPU: the cheap compile, and the CUDA joint trace)."""
    import json

    from typer.testing import CliRunner

    from tapescope.cli import app

    from .conftest import TINY_GPT2

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", TINY_GPT2, "--batch", "2", "--seq", "16",
                                 "--device", "cuda", "--compile-backend", "aot_eager",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Eager vs torch.compile" in r.output and "peak bytes" in r.output
    d = json.loads(out.read_text())
    side = d["eager_vs_compiled"]
    assert side["peak_bytes"]["compiled"] == d["peak_bytes"]
    assert side["peak_bytes"]["eager"] == d["eager"]["peak_bytes"]
    assert d["compiled"]["saved"] and d["compiled"]["regions"] == 1


def test_what_is_not_modelled_is_refused_with_the_reason(monkeypatch):
    import importlib.util

    from tapescope.errors import TapescopeError

    spec = tapescope.spec((4, 8), requires_grad=True)
    # inductor's CUDA code is Triton code: without triton installed, the fix is named
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(TapescopeError, match="install triton"):
        tapescope.profile(_build, spec, device="cuda", compile=True)
    monkeypatch.undo()
    with pytest.raises(TapescopeError, match="optimizer"):
        tapescope.profile(_build, spec, compile={"optimizer": True})
