"""`--float8` on the presets (capture/float8.py), against torchao and torchtitan run for real.

Truths: a real-tensor step of the same preset with torch's fake process group, the model converted
by torchao's own `convert_to_float8_training` with torchtitan's filter written out here, gives
the collectives and their sizes (checked by hand below too); torchtitan 0.3.0's own
Float8LinearConverter, run on its llama3 config and built on meta, gives the converted set.
"""

import copy
from dataclasses import replace
import functools
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
    """(kind, bytes) of each collective a real step issues, the larger of the op's tensors. An op
    on DTensors is let through first (NotImplemented, as torch's CommDebugMode does), so the
    all-reduce DTensor issues inside it (precompute_float8_dynamic_scale_for_fsdp's clamp of a
    Partial(max)) is seen too."""

    KINDS = {"all_reduce": "all_reduce", "_allgather_base_": "all_gather",
             "_reduce_scatter_base_": "reduce_scatter"}

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
                                        for t in tree_leaves((args, kwargs))
                                        if isinstance(t, torch.Tensor))))
        return out


def _torchtitan_filter(module, fqn):  # module_filter_fn with filter_fqns=["output"]
    return "output" not in fqn and module.in_features % 16 == 0 and module.out_features % 16 == 0


@functools.cache  # the same real run for the preset's and the search's test
def _real_steady_step_collectives(recipe: str) -> list:
    """Two real AdamW steps of the FSDP 2 preset on CPU tensors, world 2, fake process group;
    tensorwise as torchtitan runs it (float8 all-gather, scales precomputed after each optimizer
    step). The second step's collectives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                precompute_float8_dynamic_scale_for_fsdp)

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        torch.manual_seed(0)
        model = Llama(CONFIG)
        tensorwise = recipe == "tensorwise"
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if tensorwise else \
            Float8LinearConfig.from_recipe_name(recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=_torchtitan_filter)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        model = preset_parallelize(Layout(fsdp=2))(model, mesh)
        opt = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ))
        for _ in range(2):
            with _Collectives() as log:
                model(tokens, tokens).backward()
                opt.step()
                if tensorwise:
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
