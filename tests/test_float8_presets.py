"""`--float8` on the presets (capture/float8.py), against torchao and torchtitan run for real.

Truths: a real-tensor step of the same preset with torch's fake process group, the model converted
by torchao's own `convert_to_float8_training` with torchtitan's filter written out here, gives
the collectives and their sizes (checked by hand below too); torchtitan 0.3.0's own
Float8LinearConverter, run on its llama3 config and built on meta, gives the converted set.
"""

from collections import Counter
import copy
from dataclasses import replace
import functools
import json
import tomllib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import tapescope
from tapescope.distributed.presets import Layout, preset_parallelize
from tapescope.zoo.llama import Llama, LlamaConfig

pytest.importorskip("torchao")

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                     max_seq_len=32)
BATCH, SEQ = 2, 32


class _Collectives(TorchDispatchMode):
    """(kind, bytes) of each collective a real step issues, the largest of the op's tensors, its
    result included (a functional all-gather returns the gathered tensor, not in its args). An op
    on DTensors is let through first (NotImplemented, as torch's CommDebugMode does), so the
    all-reduce DTensor issues inside it (precompute_float8_dynamic_scale_for_fsdp's clamp of a
    Partial(max)) is seen too."""

    KINDS = {"all_reduce": "all_reduce", "_allgather_base_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter",
             # DTensor's redistribute (TP's sequence-parallel boundaries): functional ops
             "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        kind = self.KINDS.get(func._opname)
        if func.namespace in ("c10d", "_c10d_functional") and kind is not None:
            self.seen.append((kind, max(t.numel() * t.element_size()
                                        for t in tree_leaves((args, kwargs, out))
                                        if isinstance(t, torch.Tensor))))
        return out


def _torchtitan_filter(module, fqn):  # module_filter_fn with filter_fqns=["output"]
    return "output" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0


@functools.cache  # the same real run for the preset's and the search's test
def _real_steady_step_collectives(recipe: str, layout: Layout = Layout(fsdp=2)) -> list:
    """Two real AdamW steps of the layout's preset on CPU tensors, fake process group;
    tensorwise as torchtitan runs it (under FSDP: float8 all-gather, scales precomputed after
    each optimizer step). The second step's collectives, rank 0's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)

    dist.init_process_group("fake", rank=0, world_size=layout.world_size, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = Llama(CONFIG)
        gather = recipe == "tensorwise" and layout.fsdp > 1
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if gather else \
            Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=_torchtitan_filter)
        mesh = init_device_mesh("cpu", tuple(layout.mesh.values()),
                                mesh_dim_names=tuple(layout.mesh))
        model = preset_parallelize(layout)(model, mesh)
        opt = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
        for _ in range(2):
            with _Collectives() as log:
                model(tokens, tokens).backward()
                opt.step()
                if gather:
                    precompute_float8_dynamic_scale_for_fsdp(model)
                opt.zero_grad()
        return tuple(log.seen)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_preset_collectives_equal_a_fake_process_group_run(recipe):
    """The steady step's collectives, kind and bytes, in order. By hand: a block's linears hold
    36,864 weights (wq, wo 64x64; wk, wv 32x64; w1, w2, w3 128x64) and its two norms 128 fp32
    values, so tensorwise gathers 36,864 + 512 B per block (float8 weights), rowwise 36,864 x 4
    + 512; the root's embedding and output head stay fp32 (the head is not converted); in the
    steady step tensorwise's one all-reduce is the 14 precomputed scales (56 B), with no amax
    all-reduce per weight."""
    truth = _real_steady_step_collectives(recipe)
    tokens = tapescope.spec((BATCH, SEQ), dtype=torch.int64, high=CONFIG.vocab_size)
    p = tapescope.profile(lambda: Llama(CONFIG), tokens, tokens, gpu="h100",
                          mesh={"dp_shard": 2}, parallelize=preset_parallelize(Layout(fsdp=2)),
                          float8=recipe)
    assert tuple((c.kind, c.nbytes) for c in p.collectives) == truth
    block = 36864 * (1 if recipe == "tensorwise" else 4) + 512
    root = 2 * 256 * 64 * 4 + 64 * 4
    assert list(truth[:4]) == [("all_gather", root)] + [("all_gather", block)] * 3
    assert [n for k, n in truth if k == "all_reduce"] == ([56] if recipe == "tensorwise" else [])


def test_converted_linears_equal_torchtitans_converter():
    """torchtitan 0.3.0's Float8LinearConverter on its llama3 config (emulate: no GPU asked),
    built on meta, against capture/float8.py's choice on the same model unconverted. 0.3's
    head is `lm_head` and its default filters nothing; filtered as its configs filtered
    "output", both leave exactly the head out."""
    from torchtitan.components.quantization import Float8Linear, Float8LinearConverter

    from tapescope.capture.float8 import float8_linear_names

    from .test_torchtitan import _config

    config = _config()
    converter = Float8LinearConverter(Float8LinearConverter.Config(filter_fqns=["lm_head"],
                                                                   emulate=True))
    converted = converter.convert(copy.deepcopy(config))
    with torch.device("meta"):
        model, theirs = config.build(), converted.build()
    expected = sorted(n for n, m in theirs.named_modules() if isinstance(m, Float8Linear))
    assert sorted(float8_linear_names(model)) == expected
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears - set(expected) == {"lm_head"}


@pytest.mark.parametrize("kwargs,says", [
    ({"device": "cpu"}, "add --gpu h100"),
    ({"gpu": "a100"}, "sm80"),
    ({"gpu": "h100", "float8": "delayed"}, "choose one of tensorwise, rowwise"),
    ({"gpu": "h100", "mesh": {"fsdp": 2}, "parallelize": lambda m, mesh: m},
     "with your own --parallelize"),
])
def test_float8_refusals_say_why_in_one_line(kwargs, says):
    """torch's _scaled_mm needs sm89+ (Blas.cpp), as torchtitan's converter checks."""
    from tapescope.options import Options

    with pytest.raises(tapescope.TapescopeError) as e:
        Options.create(**{"float8": "tensorwise", **kwargs})
    assert says in str(e.value) and "\n" not in str(e.value)


SPEC = "zoo:llama:dim=64,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=128,vocab_size=256,max_seq_len=32"


def test_search_float8_is_a_dimension_and_its_candidate_profiles_as_the_real_run():
    """search --float8: every candidate also with float8 (old keys unchanged without it); the
    float8 candidate, profiled as the search profiles it, has the real run's collectives; its
    torchtitan TOML converts as torchtitan's TOML releases name it."""
    from tapescope.layout_search import profile_candidate
    from tapescope.layout_search.config import tapescope_command, torchtitan_toml
    from tapescope.layout_search.evaluate import Source
    from tapescope.layout_search.space import Candidate, SearchSpace, candidate_grid

    space = SearchSpace(2, 4, pp=(1,), tp=(1,), hsdp=False, checkpointing=("none",), seq=SEQ,
                        float8=(None, "tensorwise"))
    grid = candidate_grid(space).candidates
    plain = [c for c in grid if c.float8 is None]
    assert sorted(replace(c, float8=None).key() for c in grid if c.float8) == \
        sorted(c.key() for c in plain) and plain
    assert all("float8" not in c.key() for c in plain)

    source = Source(SPEC, SEQ, "h100", amp=None)
    c = Candidate(Layout(fsdp=2), micro_batch=BATCH, steps=1, float8="tensorwise")
    p = profile_candidate(source, c)
    assert tuple((x.kind, x.nbytes) for x in p.collectives) == \
        _real_steady_step_collectives("tensorwise")
    toml = tomllib.loads(torchtitan_toml(source, c, 4))
    assert toml["model"]["converters"] == ["quantize.linear.float8"]
    assert toml["quantize"]["linear"]["float8"] == {
        "filter_fqns": ["output"], "enable_fsdp_float8_all_gather": True,
        "precompute_float8_dynamic_scale_for_fsdp": True}
    assert "--float8 tensorwise" in tapescope_command(source, c)


def _one_line(text: str) -> str:  # the console wraps at its width
    return " ".join(text.split())


def test_distributed_report_says_float8_and_tp_collectives_equal_a_fake_process_group_run(
        tmp_path):
    """`profile --fsdp 2 --tp 2 --float8 tensorwise`: the distributed console report and --json
    carry the float8 note, saying the TP styles stay plain (torchtitan 0.3.0's dtype-agnostic
    sharding); the step's collectives, FSDP's float8 gathers and TP's sequence-parallel
    boundaries in the model's dtype, equal the real run of that preset and conversion."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["profile", SPEC, "--batch", str(BATCH), "--seq", str(SEQ),
                                 "--fsdp", "2", "--tp", "2", "--float8", "tensorwise",
                                 "--gpu", "h100", "--json", str(out), "-q"])
    assert r.exit_code == 0, r.output
    text = _one_line(r.output)
    assert "Collectives of rank 0 per step" in text  # the distributed report
    assert ("note: float8 tensorwise: 14 Linears of the traced copy swapped to torchao's "
            "Float8Linear; FSDP2 gathers their weights in float8") in text
    assert "the TP styles stay plain, as torchtitan 0.3.0 applies them" in text
    p = json.loads(out.read_text())
    notes = [n for n in p["facts"]["isolation_notes"] if n.startswith("float8 tensorwise")]
    assert len(notes) == 1 and _one_line(notes[0]) in text
    got = Counter()
    for c in p["collectives"]:
        got[(c["kind"], c["bytes_per_rank"])] += c["count_per_step"]
    assert got == Counter(_real_steady_step_collectives("tensorwise", Layout(fsdp=2, tp=2)))


def test_fit_gpus_says_float8_on_the_console_in_json_and_in_its_next_commands(tmp_path):
    """`fit --gpus --float8 rowwise`: a line above the table, "float8" in --json, and (nothing
    fits a 1 MiB budget: the step peaks at about 2 MiB) the next fit and profile commands keep
    --float8."""
    from typer.testing import CliRunner

    from tapescope.cli import app

    out = tmp_path / "fit.json"
    r = CliRunner().invoke(app, ["fit", SPEC, "--batch", str(BATCH), "--seq", str(SEQ),
                                 "--gpus", "1", "--gpu", "h100", "--float8", "rowwise",
                                 "--budget", "1MiB", "--json", str(out), "-q"])
    assert r.exit_code == 1, r.output
    assert ("float8 rowwise in every layout: the Linears torchtitan's converter swaps are "
            "torchao's Float8Linear") in _one_line(r.output)
    assert json.loads(out.read_text())["float8"] == "rowwise"
    commands = [line.strip() for line in r.output.splitlines()
                if line.strip().startswith("tapescope ")]
    assert [c.split()[1] for c in commands] == ["fit", "profile"], r.output
    assert all("--float8 rowwise" in c for c in commands), commands
