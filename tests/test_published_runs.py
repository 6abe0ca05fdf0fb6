"""The published-run benchmark (benchmarks/published_runs.py) runs end to end on two small rows."""

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "published_runs.py")


def _bench():
    spec = importlib.util.spec_from_file_location("published_runs", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_throughput_row_and_an_oom_row():
    bench = _bench()
    rows = {r.name: r for r in bench.ROWS}
    speed = bench.predict(rows["fms-7b-a100"])
    assert speed["value"] > 0 and speed["comm"] > 0            # HSDP's collectives are timed
    oom = bench.predict(rows["litgpt-13b-lora-mb2"])            # published: OOM on 40 GB
    assert oom["value"] == "OOM"
    text = bench.table([rows["fms-7b-a100"], rows["litgpt-13b-lora-mb2"]],
                       {"fms-7b-a100": speed, "litgpt-13b-lora-mb2": oom})
    assert "calibration" in text and "| right |" in text


def test_torchtune_rows_are_built_as_the_recipe_builds_them():
    """Construction, not predictions: the + compile / + chunked CE / + AC models have
    torchtune's module structure (checked against torchtune 0.4/0.5's recipe and modules):
    + optimizer in backward steps each parameter in its own hook (the recipe's step, run),
    every TransformerSelfAttentionLayer compiled, the plain CrossEntropyLoss not (the recipe
    drops compile_loss's return value), CEWithChunkedOutputLoss's compute_cross_entropy
    compiled, 8 bf16 logit chunks, and each compiled layer inside a CheckpointWrapper."""
    from dataclasses import replace

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    bench = _bench()
    steps = {suffix: opts for suffix, _, _, opts, _ in bench._TUNE_STEPS}
    cfg = replace(bench._L32_3B, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128,
                  vocab_size=256, max_seq_len=32)
    compiled = bench.tune_llama(**steps["packed-compile"])(cfg)()
    assert all(layer._compiled_call_impl is not None for layer in compiled.layers)
    assert compiled.loss._compiled_call_impl is None
    chunked = bench.tune_llama(**steps["packed-compile-chunkedce"])(cfg)()
    assert chunked.loss.compute_cross_entropy._compiled_call_impl is not None
    assert chunked.num_output_chunks == chunked.loss.num_output_chunks == 8
    ac = bench.tune_llama(**steps["packed-compile-chunkedce-ac"])(cfg)()
    assert all(isinstance(layer, CheckpointWrapper) and
               layer._checkpoint_wrapped_module._compiled_call_impl is not None
               for layer in ac.layers)
    # the eager model computes torchtune's loss: chunked and unchunked agree
    tokens = torch.randint(0, 256, (2, 16))
    eager = bench.TuneLlama(cfg)
    chunks = bench.TuneLlama(cfg, num_output_chunks=8)
    chunks.load_state_dict(eager.state_dict())
    assert torch.allclose(eager(tokens, tokens), chunks(tokens, tokens), rtol=1e-2)
    # + optimizer in backward: the row runs the recipe's step; run for real, every parameter
    # is stepped by its own AdamW inside the backward and no gradient outlives it
    row = next(r for r in bench.ROWS if r.name.endswith("optinbwd"))
    assert row.options["step"] is bench.tune_train_step
    optims = row.options["setup"](chunks)
    assert len(optims) == len(list(chunks.parameters()))
    assert all(len(o.param_groups[0]["params"]) == 1 for o in optims.values())
    row.options["step"](chunks, (tokens, tokens), optims)
    assert all(p.grad is None for p in chunks.parameters())
    # (lr 2e-5 moves a bf16 weight by less than its resolution: the state says it stepped)
    assert all(int(o.state[p]["step"]) == 1 for p, o in optims.items())


def test_megatron_rows_convert_model_tflops_by_megatrons_own_formula():
    """Megatron's num_floating_point_operations (training.py) for GPT with a 4h MLP and MHA:
    12 B s L h^2 ((1 + 1 + s/h) + 4 + V / (2 L h)) per step; 1.7B (h 2048, 24 layers, seq 4096,
    vocab 131,072): 11,274,289,152 FLOPs per token, so 408.8 TFLOP/s/GPU is 36,259.5 tokens/s."""
    bench = _bench()
    assert bench.megatron_flops_per_token(2048, 24, 4096) == 12 * 24 * 2048 ** 2 * (
        2 + 4096 / 2048 + 4 + 131072 / (2 * 24 * 2048)) == 11_274_289_152
    rows = {r.name: r for r in bench.ROWS}
    assert rows["megatron-1.7b-h100"].published == 36259.5
    # TP 8: tokens/s of the TP group (8 GPUs share one data-parallel rank's batch)
    r = rows["megatron-32b-h100"]
    assert r.mesh == {"dp": 48, "tp": 8} and r.published == round(
        459.6e12 / bench.megatron_flops_per_token(7168, 48, 4096) * 8, 1)
