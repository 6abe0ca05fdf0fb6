"""Every `tapescope ...` command in README.md runs, exits 0 and answers as README says it does.

The commands are read from README's ```bash blocks. Each must have a row in COMMANDS (README
command -> what is run, what the output must show, the files it must write); a command added to
README without a row, or a row whose command left README, fails `test_every_readme_command_has_a_row`.
Commands run in-process through the CLI entry (typer's CliRunner), in a fresh folder that sees
the repository's examples/.

Substitutions, to keep the whole file near a minute on 2 cores: a row whose `run` is not README's
command keeps README's command, options and model family and reduces only what costs time and
does not change what is shown:
- torch.compile (inductor compiles on every call): GPT-2 / Llama with 1-2 layers and small
  widths, and budget-sweep over 2 of README's 5 budgets;
- validate runs the real step 7 times on this CPU: GPT-2 with 2 layers, width 64 and a
  128-token vocabulary (README's batch and sequence length kept);
- the pipeline example traces 4 ranks of the default Llama: a 4-layer Llama of width 64, README's
  pipeline flags kept;
- fit --gpus profiles each (FSDP, TP) layout: a 2-layer Llama on 8 GPUs instead of Llama-70B on
  64 (the 70B run takes minutes; its layouts table is the same command's output);
- the 24 GB walk-through: Llama 3 8B's own widths with 4 layers (profile) or 2 (fit) of its 32,
  whose model state is over the RTX 4090 all the same, and examples/lora.py's `build_small` (4
  layers). `fit` exits 1 there, as README says: EXIT_CODES.
- search traces every candidate: README's Llama narrowed to width 64 and a 128-token
  vocabulary, in this process (--workers 1, without tensor parallel candidates: --tp 1; Ray
  with its 2 workers, without pipelined ones: --pp 1).
Every other command runs exactly as README writes it.
"""

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapescope.cli import app

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"

TINY_GPT2 = "zoo:gpt2:n_layer=1,n_embd=64,n_head=4,vocab_size=128,block_size=256"
TINY_LLAMA = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=160,vocab_size=128"

# README command -> (what runs: None = README's own; texts the output shows; files written)
COMMANDS = {
    "tapescope --help": (None, ["profile", "plan", "fit", "validate"], []),
    "tapescope profile": (None, [
        # README's example header: GPT-2 small has 124.4M parameters
        "zoo:gpt2 · cpu · float32 · 8x1024 × 8x1024 · AdamW (for-loop) · 124.4M parameters",
        "Peak memory", "Largest tensors alive at the peak", "FLOPs forward",
        "Top modules by FLOPs", "tapescope never allocated the model"], []),
    "tapescope profile zoo:llama --batch 4 --seq 2048 --json llama.json --graph llama_step.py": (
        None, ["zoo:llama", "4x2048", "wrote llama.json", "wrote llama_step.py"],
        ["llama.json", "llama_step.py"]),
    "tapescope profile torchvision:resnet50 --batch 64 --optimizer sgd": (
        None, ["torchvision:resnet50", "64x3x224x224", "SGD"], []),
    "tapescope profile hf:BertConfig --seq 512": (None, ["hf:BertConfig", "x512"], []),
    "tapescope profile examples/my_model.py:build --input 8,3,224,224 --input 8:int64 "
    "--loss cross-entropy": (None, ["8x3x224x224 × 8", "Peak memory"], []),
    "tapescope profile examples/my_model.py:build --input 8,3,224,224 --input 8:int64 "
    "--step examples/my_step.py:train_step --setup examples/my_step.py:setup": (
        None, ["your step train_step", "AdamW", "| other "], []),
    "tapescope ops zoo:gpt2:n_layer=2": (None, ["SeqNr|OrigAten|SrcFn", "_backward"], []),
    "tapescope profile zoo:llama --pp 4 --microbatches 8 --pp-schedule 1f1b --device cuda --gpu "
    "h100 --amp bf16": (
        "tapescope profile zoo:llama:n_layers=4,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=160,"
        "vocab_size=128 --seq 64 --pp 4 --microbatches 8 --pp-schedule 1f1b --device cuda "
        "--gpu h100 --amp bf16",
        ["Pipeline 1f1b, 4 stages on 4 ranks, 8 micro-batches", "4 micro-batches",
         "1 micro-batch ", "is highest", "with the stages running together"], []),
    "tapescope profile zoo:llama --gpu h100 --amp bf16 --html report.html": (
        None, ["NVIDIA H100", "autocast bfloat16", "wrote report.html"], ["report.html"]),
    "tapescope profile zoo:llama --amp bf16 --calibration examples/calibration_h100.json": (
        None, ["NVIDIA H100 SXM5 80GB", "calibrated: examples/calibration_h100.json (NVIDIA H100 "
               "80GB HBM3, 2026-11-20)"], []),
    "tapescope fit zoo:gpt2 --budget 24GiB --sweep 1..64": (
        None, ["budget 24.00 GiB", "largest batch that fits"], []),
    "tapescope plan zoo:llama --gpu h100 --amp bf16 --budget 4.5GiB --pareto 6": (
        None, ["meets the budget", "Budget -> re-traced peak -> recompute cost",
               "def apply_checkpointing"], []),
    "tapescope explain aten::rms_norm --device cuda": (
        None, ["FusedRmsNormBackward0", "aten._fused_rms_norm_backward.default"], []),
    "tapescope diff zoo:llama --device meta --vs cuda": (None, ["meta vs cuda"], []),
    "tapescope validate zoo:gpt2 --batch 2 --seq 256": (
        f"tapescope validate {TINY_GPT2} --batch 2 --seq 256",
        ["predicted", "measured", "op sequence: identical"], []),
    "tapescope profile torchvision:resnet50 --threads 32 --cpu-isa avx512": (
        None, ["AVX512, 32 threads"], []),
    "tapescope profile zoo:gpt2 --compile": (
        f"tapescope profile {TINY_GPT2} --batch 2 --seq 64 --compile",
        ["Eager vs torch.compile"], []),
    "tapescope profile zoo:llama --compile --activation-memory-budget 0.5 --json llama.json": (
        f"tapescope profile {TINY_LLAMA} --batch 2 --seq 64 --compile "
        "--activation-memory-budget 0.5 --json llama.json",
        ["Eager vs torch.compile", "wrote llama.json"], ["llama.json"]),
    "tapescope budget-sweep zoo:gpt2 --budgets 0,0.25,0.5,0.75,1": (
        f"tapescope budget-sweep {TINY_GPT2} --batch 2 --seq 64 --budgets 0,1",
        ["physical peak per activation_memory_budget"], []),
    "tapescope profile zoo:llama --fsdp 4 --tp 2 --device cuda --gpu h100 --amp bf16": (
        None, ["Mesh dp_shard 4 x tp 2 = 8 ranks, parallelised by the FSDP 4 x TP 2 preset",
               "Per rank", "Collectives of rank 0 per step", "reduce_scatter"], []),
    "tapescope profile hf:LlamaConfig:num_hidden_layers=4 --fsdp 8 --hsdp 2": (
        None, ["Per rank", "Collectives of rank 0 per step"], []),
    "tapescope profile examples/model.py:build --input 4,2048:int64 "
    "--parallelize examples/par.py:parallelize --mesh dp=4,tp=2": (
        None, ["4x2048", "sharded parameters", "Per rank", "all_gather"], []),
    "tapescope fit zoo:llama-70b --gpus 64 --gpu h100 --amp bf16": (
        f"tapescope fit {TINY_LLAMA} --gpus 8 --gpu h100 --amp bf16",
        ["on 8 x NVIDIA H100", "FSDP 8", "FSDP 4 x TP 2", "global batch", "Best layout: "], []),
    # the 24 GB walk-through
    "tapescope profile zoo:llama3-8b --gpu 4090 --batch 1 --seq 2048 --amp bf16": (
        "tapescope profile zoo:llama3-8b:n_layers=4 --gpu 4090 --batch 1 --seq 2048 --amp bf16",
        ["On NVIDIA GeForce RTX 4090: does not fit",
         "why: the model's state alone is over the GPU's memory", "next:",
         "this command with --optimizer sgd", "CPU offload of the optimizer state",
         "an 8-bit AdamW", "examples/lora.py"], []),
    "tapescope fit zoo:llama3-8b --gpu 4090 --batch 1 --amp bf16": (
        "tapescope fit zoo:llama3-8b:n_layers=2 --gpu 4090 --batch 1 --amp bf16",
        ["with seq varying", "nothing fits: seq 1 already needs",
         "why: the model's state alone is over the budget", "--gpus 2 --gpu 4090", "LoRA"], []),
    "tapescope profile examples/lora.py:build --input 1,2048:int64 --input 1,2048:int64 --gpu "
    "4090 --dtype bf16": (
        "tapescope profile examples/lora.py:build_small --input 1,2048:int64 --input "
        "1,2048:int64 --gpu 4090 --dtype bf16",
        ["bfloat16 · 1x2048 × 1x2048", "On NVIDIA GeForce RTX 4090: max_memory_allocated",
         ": fits", "activation checkpointing recomputes"], []),
    "tapescope search zoo:llama:n_layers=2 --gpus 4 --gpu h100 --global-batch 8 --seq 128 "
    "--pp 1,2 --checkpointing none,full": (
        # (a smaller space than README's: tests/test_search.py checks the ranking, tensor
        # parallel candidates included; this checks the command's answer and its config to run)
        f"tapescope search {TINY_LLAMA} --gpus 4 --gpu h100 --global-batch 8 --seq 128 "
        "--pp 1,2 --tp 1 --checkpointing none --workers 1",
        ["on 4 x h100-sxm", "Fits on every rank, fastest first", "Best: ", "torchtitan:",
         "[parallelism]", "torchrun"], []),
    "tapescope search zoo:llama:n_layers=2 --gpus 4 --gpu h100 --global-batch 8 --seq 128 "
    "--pp 1,2 --checkpointing none,full --ray local": (
        f"tapescope search {TINY_LLAMA} --gpus 4 --gpu h100 --global-batch 8 --seq 128 "
        "--pp 1 --checkpointing none --ray local --workers 2",
        ["on 4 x h100-sxm", "Ray at local", "Best: "], []),
}

# README commands that answer with exit status 1 (README says so next to them)
EXIT_CODES = {"tapescope fit zoo:llama3-8b --gpu 4090 --batch 1 --amp bf16": 1}


def readme_commands() -> list[str]:
    """The `tapescope ...` lines of README's ```bash blocks, comments stripped."""
    text = README.read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("tapescope"):
                out.append(" ".join(line.split()))
    return out


def test_every_readme_command_has_a_row():
    commands = readme_commands()
    assert len(commands) == len(set(commands))
    assert set(commands) == set(COMMANDS), (set(commands) ^ set(COMMANDS))


def test_readme_examples_exist():
    for name in ("my_model.py", "model.py", "par.py", "lora.py"):
        assert (REPO / "examples" / name).is_file()
        assert f"examples/{name}" in README.read_text()


@pytest.mark.parametrize("command", list(COMMANDS), ids=[c[10:] or "-" for c in COMMANDS])
def test_readme_command_runs(command, tmp_path, monkeypatch):
    run, shows, files = COMMANDS[command]
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    args = shlex.split(run or command)[1:]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == EXIT_CODES.get(command, 0), f"{run or command}\n{r.output}"
    out = " ".join(r.output.split())  # the console wraps long lines
    for text in shows:
        assert text in out, f"{run or command}: no {text!r} in\n{r.output}"
    for name in files:
        assert (tmp_path / name).stat().st_size > 0
        if name.endswith(".json"):
            json.loads((tmp_path / name).read_text())


    if command.startswith("tapescope plan"):
        _plans_something(out)


def _plans_something(out: str) -> None:
    """README's plan example must plan: its budget is under the peak without checkpointing and
    the plan checkpoints layers to meet it (one that checkpoints nothing would show nothing)."""
    whole = int(re.search(r"checkpointed whole \((\d+)\)", out).group(1))
    selective = int(re.search(r"selective \((\d+)\)", out).group(1))
    assert whole + selective > 0, out
    assert "recompute 0 FLOP" not in out
