"""float8 training (torchao) GPU-less, against real runs.

Truths: torch 2.14.1 runs `aten._scaled_mm` on the CPU (an emulation: fp32 copies and an fp32
matmul), so a real CPU step under the profiler gives the allocator's peak of a float8 model; a
real-tensor FSDP2 step with torch's fake process group gives the collectives' sizes; real gloo
processes give each rank's peak. Without truth here: the float8 all-gather's per-rank peak (gloo
cannot all-gather float8: "Invalid scalar type"), and CUDA's own _scaled_mm memory (cuBLASLt's
workspace is modelled as for any GEMM).

torchao 0.18.0 imports against torch 2.14.1: `pip install --no-deps torchao==0.18.0`.
"""

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tapescope
from tapescope.validate.real import run_real_steps

from .float8_models import (D_HIDDEN, D_IN, float8_mlp, float8_mlp_bf16_all_gather,
                            fully_shard_each_linear)

pytest.importorskip("torchao")

BATCH = 64


def _build(recipe, **config):
    def build():
        return float8_mlp(recipe, **config)
    return build


# float8 GEMMs per linear: output, grad input, grad weight ("gw_hp": the grad weight in bf16)
@pytest.mark.parametrize("recipe,config,gemms", [
    ("tensorwise", {}, 6),
    ("rowwise_with_gw_hp", {}, 4),
    (None, {"force_recompute_fp8_weight_in_bwd": True}, 6),
    ("rowwise", {}, 6),
])
def test_float8_linear_peak_matches_a_real_cpu_run(recipe, config, gemms):
    """Each Float8Linear casts its input, weight and gradient to float8 and runs three
    `_scaled_mm`; the CPU kernel's fp32 copies (fidelity/float8.py) are inside the peak, and for
    rowwise, the fp32 copies of the in-place bf16 x fp32 rescaling after the grad-weight GEMM
    (fidelity/promotion.py)."""
    build = _build(recipe, **config)
    p = tapescope.profile(build, tapescope.spec((BATCH, D_IN)), device="cpu", dtype=torch.bfloat16)
    real = run_real_steps(build, [torch.randn(BATCH, D_IN)], dtype=torch.bfloat16)
    assert sum(o.name == "aten._scaled_mm.default" for o in p.ops) == gemms
    # what remains is a few bytes of Python-scalar temporaries (as in test_memory_truth.py)
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 16
    assert abs(p.peak_bytes - real.peaks[2]) <= 16


class _Collectives(TorchDispatchMode):
    """(kind, bytes) of each collective a real step issues: c10d's ops as FSDP2 calls them; the
    bytes are the larger of the op's tensors (the gathered output, the scattered input), as
    tapescope counts them."""

    KINDS = {"all_reduce": "all_reduce", "_allgather_base_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self.KINDS.get(func._opname)
        if func.namespace in ("c10d", "_c10d_functional") and kind is not None:
            sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)]
            self.seen.append((kind, max(sizes)))
        return out


def _fake_process_group_step(float8_all_gather: bool) -> list:
    """One FSDP2 step of the float8 MLP on real CPU tensors, world 2, torch's fake process group
    (every collective returns at once; the tensors are real, so are their sizes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = fully_shard_each_linear(
            float8_mlp(enable_fsdp_float8_all_gather=float8_all_gather),
            init_device_mesh("cpu", (2,)))
        with _Collectives() as log:
            model(torch.randn(BATCH, D_IN)).sum().backward()
        return log.seen
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("float8_all_gather", [True, False])
def test_fsdp_float8_all_gather_bytes_equal_a_fake_process_group_run(float8_all_gather):
    """`enable_fsdp_float8_all_gather`: FSDP2 gathers each weight in float8 (1 byte an element,
    after an all-reduce of its 4-byte amax) instead of fp32 (4 bytes); gradients are
    reduce-scattered in fp32 either way. Profiled GPU-less for an H100."""
    truth = _fake_process_group_step(float8_all_gather)
    p = tapescope.profile(lambda: float8_mlp(enable_fsdp_float8_all_gather=float8_all_gather),
                          tapescope.spec((BATCH, D_IN)), gpu="h100", mesh={"fsdp": 2},
                          parallelize=fully_shard_each_linear, loss_fn="sum")
    assert [(c.kind, c.nbytes) for c in p.collectives] == truth
    weight = D_IN * D_HIDDEN
    gathered = {n for k, n in truth if k == "all_gather"}
    assert gathered == ({weight} if float8_all_gather else {weight * 4})


def _float8_real_jobs() -> dict:
    from tapescope.validate.distributed import RealJob

    return {"fsdp": [RealJob(float8_mlp_bf16_all_gather, (torch.randn(BATCH, D_IN),),
                             {"fsdp": 2}, fully_shard_each_linear, steps=3)] * 3}


# run with the other modules' real jobs of 2 ranks, in one spawn of processes (conftest.real_runs)
REAL_JOBS = _float8_real_jobs()


def test_float8_fsdp_rank_peaks_equal_gloo_runs(real_runs):
    """float8 linears under FSDP2 without the float8 all-gather (fp32 weights gathered, then cast
    to float8 for each GEMM), real gloo processes: every rank's first and steady peak to the
    byte. A real peak can be higher in one run than another (gloo's worker threads free a
    collective's tensors when they let go of them, tests/test_distributed.py), so as there: the
    job runs 3 times for 3 steps, no observation is below the prediction and one equals it.
    (gloo cannot all-gather float8, so the float8 all-gather has no such truth.)"""
    p = tapescope.profile(float8_mlp_bf16_all_gather, tapescope.spec((BATCH, D_IN)),
                          device="cpu", mesh={"fsdp": 2}, parallelize=fully_shard_each_linear)
    runs = real_runs[(__name__, "fsdp")]
    for rank in range(2):
        assert all(run[rank].unstepped == 0 for run in runs)
        for predicted, steps in ((p.ranks[rank].first_step_peak_bytes, [1]),
                                 (p.ranks[rank].peak_bytes, [2, 3])):
            observed = [run[rank].peaks[s] for run in runs for s in steps]
            assert min(observed) == predicted, (predicted, sorted(observed))


def test_scaled_mm_is_refused_on_a_gpu_without_float8():
    """CUDA's _scaled_mm runs on sm89 and newer (Blas.cpp, _scaled_mm_allowed_device): an A100
    (sm80) refuses the step with torch's message, in one line; an L4 (sm89) runs it."""
    build = _build("tensorwise")
    with pytest.raises(tapescope.TapescopeError) as e:
        tapescope.profile(build, tapescope.spec((BATCH, D_IN)), gpu="a100", dtype=torch.bfloat16)
    message = str(e.value)
    assert "\n" not in message
    assert "_scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9" \
        in message and "sm80" in message
    p = tapescope.profile(build, tapescope.spec((BATCH, D_IN)), gpu="l4", dtype=torch.bfloat16)
    assert sum(o.name == "aten._scaled_mm.default" for o in p.ops) == 6


def _torchtitan_float8_llama(recipe):
    """torchtitan's own path: model_registry(flavor, converters=[Float8LinearConverter.Config])
    converts the model config (the converter asks has_cuda_capability(8, 9) when it is made),
    then the trainer's sharding config; the debug model with 2 layers, SDPA attention."""
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    return _torchtitan_converted_llama(Float8LinearConverter.Config(recipe_name=recipe))


def _torchtitan_converted_llama(converter):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = model_registry("debugmodel", attn_backend="varlen", converters=[converter]).model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg.build()


def test_torchtitan_float8_converter_asks_the_profiled_gpu():
    """torchtitan 0.3.0's Float8LinearConverter (rowwise; 0.3.0 has no tensorwise recipe and no
    float8 all-gather) under its own parallelize_llama with FSDP 2, GPU-less. By hand: each of
    the 2 layers has 5 linears (fused wqkv, wo, w1, w2, w3), plus lm_head: 11, every dim a
    multiple of 16, so 11 float8 GEMMs forward and 2 per linear backward (and the ones selective
    AC recomputes). On an A100 the converter refuses, and the profile says so in one line."""
    pytest.importorskip("torchtitan")
    from .test_torchtitan import _loss, _parallelize

    def build():
        return _torchtitan_float8_llama("rowwise")

    p = tapescope.profile(build, tapescope.spec((2, 128), dtype=torch.long), loss_fn=_loss,
                          mesh={"fsdp": 2}, parallelize=_parallelize, gpu="h100")
    gemms = [o.phase for o in p.ops if o.name == "aten._scaled_mm.default"]
    assert gemms.count("forward") == 11
    assert gemms.count("backward") >= 22
    with pytest.raises(tapescope.TapescopeError) as e:
        tapescope.profile(build, tapescope.spec((2, 128), dtype=torch.long), loss_fn=_loss,
                          mesh={"fsdp": 2}, parallelize=_parallelize, gpu="a100")
    message = str(e.value)
    assert "\n" not in message
    assert "float8 is only supported on NVIDIA SM89 or later" in message and "sm80" in message


def _torchtitan_mxfp8_llama():
    """torchtitan's MXFP8LinearConverter (torchao's moe_training MXFP8Linear): its constructor
    asks has_cuda_capability(10, 0)."""
    from torchtitan.components.quantization.mx import MXFP8LinearConverter

    return _torchtitan_converted_llama(MXFP8LinearConverter.Config())


def _profile_mxfp8(gpu):
    from .test_torchtitan import _loss, _parallelize

    return tapescope.profile(_torchtitan_mxfp8_llama, tapescope.spec((2, 128), dtype=torch.long),
                             loss_fn=_loss, mesh={"fsdp": 2}, parallelize=_parallelize, gpu=gpu)


def test_torchtitan_mxfp8_is_refused_on_an_h100_with_the_reason():
    """MXFP8 (block-scaled float8, e8m0 scales per 32 values) runs on sm100: torchtitan's converter
    refuses an H100 (sm90) with its own reason, in one line naming the profiled GPU."""
    pytest.importorskip("torchtitan")
    with pytest.raises(tapescope.TapescopeError) as e:
        _profile_mxfp8("h100")
    message = str(e.value)
    assert "\n" not in message
    assert "MXFP8 is only supported on SM100 or later" in message and "(sm90)" in message


def test_torchtitan_mxfp8_converter_swaps_for_a_b200():
    """The B200's capability answered (sm100): the converter makes every Linear of the model an
    MXFP8Linear (by hand: 5 per layer, 2 layers, and lm_head)."""
    pytest.importorskip("torchtitan")
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    from tapescope.capture.gpu_less import capability_answered
    from tapescope.devices.gpus import get_gpu

    with capability_answered(get_gpu("b200")):
        model = _torchtitan_mxfp8_llama()
    assert sum(isinstance(m, MXFP8Linear) for m in model.modules()) == 11


@pytest.mark.xfail(strict=True, raises=tapescope.TapescopeError,
                   reason="torchao 0.18 picks its MX cast kernels when it is imported, by the "
                          "machine's own GPU (mx_formats/kernels.py `_triton_kernels_available`):"
                          " on a GPU-less machine it defines stubs that raise 'needs triton'")
def test_torchtitan_mxfp8_profiles_on_a_b200():
    pytest.importorskip("torchtitan")
    p = _profile_mxfp8("b200")
    assert any(o.name.startswith("aten._scaled_mm") for o in p.ops)


def test_a_module_the_model_compiled_runs_eagerly_with_a_printed_line():
    """A model whose own code called `Module.compile()` (torchtitan's apply_compile), profiled
    without compile=True: the console says those modules ran eagerly and how to compile them."""
    from tapescope.report.console import render_summary

    def build():
        m = float8_mlp("tensorwise")
        m[0].compile()
        return m

    p = tapescope.profile(build, tapescope.spec((BATCH, D_IN)), device="cpu")
    console = Console(record=True, width=200)
    render_summary(p, console)
    text = console.export_text()
    assert "ran eagerly in this profile; pass --compile (compile=True)" in text


def test_torchtitan_float8_compiled_on_cuda_without_a_gpu():
    """torchtitan's float8 (rowwise) + `--compile.enable` + FSDP 2, compile=True, GPU-less.
    Inductor's code calls `_scaled_mm(..., out=buf)`, which torch has no fake kernel for (before:
    FakeTensorMode ran the real kernel, "Found no NVIDIA driver"). Truths: torchtitan compiles
    each block with fullgraph=True, so one region shared by both layers and no graph break; by
    hand, a block has 5 float8 linears (fused wqkv, wo, w1, w2, w3): 5 float8 GEMMs in its
    forward graph, 2 per linear in its backward (and the ones selective AC recomputes)."""
    pytest.importorskip("torchtitan")
    from .test_torchtitan import _loss, _parallelize_compiled

    p = tapescope.profile(lambda: _torchtitan_float8_llama("rowwise"),
                          tapescope.spec((2, 128), dtype=torch.long), loss_fn=_loss,
                          mesh={"fsdp": 2}, parallelize=_parallelize_compiled, gpu="h100",
                          compile=True)
    c = p.compiled
    assert c.regions == 1 and not c.graph_breaks

    def gemms(kind):
        return sum(1 for g in c.graphs if g.kind == kind for n in g.graph.graph.nodes
                   if n.op == "call_function" and "_scaled_mm" in str(n.target))

    assert gemms("forward") == 5
    assert gemms("backward") >= 10


class _NotTraced(torch.nn.Module):
    """A block whose forward dynamo is told not to trace: torch.compile runs it eagerly (its
    frame is skipped; dynamo makes no graph)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(D_IN, D_IN)

    @torch._dynamo.disable
    def forward(self, x):
        return self.linear(x).relu()


def test_a_compiled_profile_with_no_graph_says_it_ran_eagerly():
    """compile=True on a model whose compiled blocks dynamo does not trace: by hand, dynamo makes
    no graph, so the step is the eager one, op for op; the console says so."""
    from tapescope.report.console import render_summary

    def build():
        m = torch.nn.Sequential(_NotTraced(), _NotTraced())
        for block in m:
            block.compile()
        return m

    p = tapescope.profile(build, tapescope.spec((8, D_IN)), device="cpu", compile=True)
    assert p.compiled.regions == 0
    assert [o.name for o in p.ops] == [o.name for o in p.eager.ops]
    console = Console(record=True, width=300)
    render_summary(p, console)
    assert "dynamo produced no graph for this step" in console.export_text()


def test_cli_refuses_float8_on_an_a100_in_one_line(tmp_path):
    """`tapescope profile file.py:build --gpu a100` on a torchao float8 model: exit 1, one
    `error:` line with torch's refusal and the GPU; --gpu l4 profiles it."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    f = tmp_path / "fp8_model.py"
    f.write_text("import torch.nn as nn\n"
                 "from torchao.float8 import convert_to_float8_training\n\n\n"
                 "def build():\n"
                 "    m = nn.Sequential(nn.Linear(256, 512, bias=False), nn.ReLU(),\n"
                 "                      nn.Linear(512, 256, bias=False))\n"
                 "    convert_to_float8_training(m)\n"
                 "    return m\n")
    args = ["profile", f"{f}:build", "--input", "64,256", "--dtype", "bf16"]
    r = CliRunner().invoke(app, [*args, "--gpu", "a100"])
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "compute capability >= 9.0 or 8.9" in errors[0], r.output
    assert "Traceback" not in r.output
    r = CliRunner().invoke(app, [*args, "--gpu", "l4"])
    assert r.exit_code == 0, r.output


def test_a_builder_that_asks_for_a_gpu_builds_for_the_named_one():
    """A CUDA profile's builder sees the named GPU (is_available, its capability): one that puts
    its tensors on "cuda" when there is a GPU gets them on meta (no driver needed), then the
    step traced on the GPU. By hand: three 64 x 64 Linears with bias and a 3-float buffer, on
    cuda:0, as on a machine with that GPU."""
    def build():
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (8, 9)
        m = torch.nn.Sequential(torch.nn.Linear(64, 64, device="cuda"),
                                torch.nn.Linear(64, 64).cuda(),
                                torch.nn.Linear(64, 64).to(torch.device("cuda", 0)))
        m.register_buffer("scale", torch.ones(3, device="cuda"))
        return m

    here = torch.cuda.is_available()
    p = tapescope.profile(build, tapescope.spec((8, 64)), gpu="l4", optimizer=None, steps=1)
    assert p.device == "cuda:0"
    assert p.memory.at_peak["parameters"] == 3 * (64 * 64 + 64) * 4
    assert torch.cuda.is_available() == here  # answered for the build only
