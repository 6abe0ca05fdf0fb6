"""Published measured training runs, predicted GPU-less: the step-time and memory benchmark.

Each row of ../shared/reference/published_runs.md that tapescope can express is built as that
code runs it (architecture, vocabulary, sequence, micro-batch, precision, activation
checkpointing, sharding, the attention kernel of its stack) and traced on fake CUDA tensors with
the fake process group; the figure the source reports (tokens/s per GPU, peak active or
max_memory_allocated, OOM) is compared with tapescope's. Rows it cannot express are listed with
the reason.

Reduced depth: a Llama's blocks are identical, so a step of L blocks is traced at 2 and 3 blocks
and extrapolated linearly (T(L) = T(2) + (L - 2) (T(3) - T(2))); `--check-linear` traces 4 blocks
too and prints how far T(4) lies from the line (the per-block figures are identical when it is 0).

    python benchmarks/published_runs.py                 # every row (a few minutes), cached
    python benchmarks/published_runs.py --rows fms-7b-a100,litgpt-7b-lora-mb1 --no-cache
    python benchmarks/published_runs.py --write-doc     # the table into docs/validation.md

Calibration: the A100 rows of IBM fms-fsdp are the calibration rows of the step-time model (no
constant was fitted to them: devices/efficiency.py's constants come from published
microbenchmarks; they were used to choose between mechanisms); every other row is held out.
torchtitan's, torchao's and the Ultra-Scale Playbook's tables are never used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import tapescope  # noqa: E402
from tapescope.analysis.collectives import collectives  # noqa: E402
from tapescope.analysis.timing import estimate_step_time  # noqa: E402
from tapescope.devices.gpus import Interconnect, get_gpu, interconnect, usable_memory_bytes  # noqa: E402
from tapescope.zoo.llama import Attention, Llama, LlamaConfig  # noqa: E402

CACHE = os.path.join(ROOT, "benchmarks", ".cache", "published_runs.json")
DOC = os.path.join(ROOT, "docs", "validation.md")
BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"


# ---- models as the runs' code builds them ------------------------------------------------------

class FlashLlama(Llama):
    """The zoo Llama with attention pinned to the flash backend, as fms-fsdp ran it ("SDPA
    implementation of Flash attention v2", torch of early 2024) on A100 and H100 alike. The
    choice is made inside each attention call, so a checkpointed block recomputes with it too."""

    def __init__(self, config):
        super().__init__(config)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for mod in self.modules():
            if isinstance(mod, Attention):
                def forward(x, _f=mod.forward):
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return _f(x)
                mod.forward = forward


class LoRALinear(nn.Module):
    """lit-gpt's LoRA linear (r=8, alpha=16, dropout 0.05): frozen W x + B(A(dropout(x))) r/alpha."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: int = 16):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(F.dropout(x, 0.05))) * self.scale


def lora_llama(cfg: LlamaConfig):
    """lit-gpt finetune/lora.py (commit 8641822) defaults: LoRA on the query and value
    projections only, every other weight frozen."""

    def build():
        m = Llama(cfg)
        for p in m.parameters():
            p.requires_grad_(False)
        for mod in m.modules():
            if isinstance(mod, Attention):
                mod.wq, mod.wv = LoRALinear(mod.wq), LoRALinear(mod.wv)
        return m
    return build


def tied_llama(cfg: LlamaConfig):
    """Llama 3.2 (tied input and output embeddings), as torchtune's llama3_2 builder makes it."""

    def build():
        m = Llama(cfg)
        m.output.weight = m.tok_embeddings.weight
        return m
    return build


class _TuneCrossEntropy(nn.Module):
    """torchtune's loss for the rows before "+ chunked cross-entropy": nn.CrossEntropyLoss on the
    float logits, a module of its own so that `compile_loss` compiles it alone."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets)


class TuneLlama(Llama):
    """torchtune's full_finetune_single_device step around the zoo Llama: the decoder returns
    float logits (TransformerDecoder: `self.output(h).float()`), the recipe's loss module takes
    them."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss = _TuneCrossEntropy()

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.output(self.norm(x)).float()
        return self.loss(logits.view(-1, logits.size(-1)), targets.view(-1))


def compiled_tied_llama(cfg: LlamaConfig):
    """Llama 3.2 with torchtune's `compile: True` (training/_compile.py): `compile_model` calls
    `.compile()` on every TransformerSelfAttentionLayer, `compile_loss` compiles the loss module.
    tapescope compiles exactly the modules the code compiled (with compile=True)."""

    def build():
        m = TuneLlama(cfg)
        m.output.weight = m.tok_embeddings.weight
        for layer in m.layers:
            layer.compile()
        m.loss.compile()
        return m
    return build


def fms_parallelize(ac_every: float):
    """fms-fsdp's FSDP: each block its own unit, bf16 parameters and bf16 gradient reduction
    (policies/mixed_precision.py bfSixteen), non-reentrant checkpointing on the fraction
    `ac_every` of blocks spread evenly (policies/ac_handler.py), here with FSDP2."""

    def parallelize(model, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.utils.checkpoint import checkpoint

        dp = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in mesh.mesh_dim_names \
            else mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        cut, count = 0.5, 0
        for block in model.layers:
            count += 1
            if ac_every and count * ac_every >= cut:
                cut += 1
                fwd = block.forward
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(fwd)
            fully_shard(block, mesh=dp, mp_policy=mp)
        return fully_shard(model, mesh=dp, mp_policy=mp)
    return parallelize


# ---- the rows --------------------------------------------------------------------------------

@dataclass
class Row:
    name: str
    source: str
    metric: str              # "tokens/s/GPU", "GiB active", "GB allocated", "fits"
    published: object        # a number, or "OOM"
    role: str                # "calibration" or "held out"
    gpu: str
    cfg: LlamaConfig
    batch: int
    seq: int
    layers: int
    build: object = None     # cfg -> model builder
    mesh: dict | None = None
    parallelize: object = None
    network_bps: float | None = None   # the cluster's network per node, bytes/s
    amp: str | None = None
    dtype: object = None
    note: str = ""
    options: dict = field(default_factory=dict)


_L2_7B = LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                     ffn_dim=11008, max_seq_len=4096)
_L2_13B = LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40,
                      ffn_dim=13824, max_seq_len=4096)
# fms-fsdp utils/config_utils.py: llama2_34b 8192 x 48, 64 heads, 8 kv heads, FFN 22016;
# llama2_70b 8192 x 80, 64 heads, 8 kv heads, FFN 28672
_L2_34B = LlamaConfig(vocab_size=32000, dim=8192, n_layers=48, n_heads=64, n_kv_heads=8,
                      ffn_dim=22016, max_seq_len=4096)
_L2_70B = LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_dim=28672, max_seq_len=4096)
_L32_3B = LlamaConfig(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                      ffn_dim=8192, max_seq_len=4096, rope_theta=500000.0)
_L31_8B = LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0)

_FMS = "IBM fms-fsdp README, Llama-2 throughput (torch.compile, batch 2, seq 4096)"
# selective AC: the fraction of blocks checkpointed, read off the README's HFU / MFU ratio
# (recomputing a block's forward adds 1/3 of its FLOPs): 13B 0.69/0.61 -> about 1/3;
# 34B and 70B 0.74/0.55 -> every block
_FMS_MODELS = (("7b", _L2_7B, 0.0, "hsdp", 4550, 9600), ("13b", _L2_13B, 1 / 3, "fsdp", 2150, 4850),
               ("34b", _L2_34B, 1.0, "fsdp", 820, 1830), ("70b", _L2_70B, 1.0, "fsdp", 410, 890))


def _fms_rows():
    rows = []
    for size, cfg, ac, strategy, a100, h100 in _FMS_MODELS:
        for gpu, world, gbps, published, role in (("a100-sxm-80gb", 128, 400, a100, "calibration"),
                                                  ("h100-sxm", 96, 800, h100, "held out")):
            mesh = {"dp_replicate": world // 8, "dp_shard": 8} if strategy == "hsdp" else \
                {"dp_shard": world}
            rows.append(Row(
                f"fms-{size}-{gpu.split('-')[0]}", _FMS, "tokens/s/GPU", published, role, gpu, cfg,
                2, 4096, cfg.n_layers, build=lambda c: (lambda: FlashLlama(c)), mesh=mesh,
                parallelize=fms_parallelize(ac), network_bps=gbps * 1e9 / 8,
                note=f"{strategy.upper()} {world} GPUs, {gbps} Gb/s per node, AC on "
                     f"{'every' if ac == 1 else 'none of the' if not ac else '1/3 of the'} "
                     "blocks; traced eagerly (the run compiled)"))
    return rows


_LITGPT = "litgpt tutorials/resource-tables.md (A100-SXM4-40GB, bf16-true, LoRA, Alpaca)"
# the longest Alpaca example in Llama 2's tokenizer: 1304 tokens (the same page); batches pad to it
_LORA = (("7b", _L2_7B, 1, 21.30), ("7b", _L2_7B, 2, 29.07), ("7b", _L2_7B, 4, "OOM"),
         ("13b", _L2_13B, 1, 38.12), ("13b", _L2_13B, 2, "OOM"))

ROWS = [
    *_fms_rows(),
    Row("torchtune-3b-packed", "torchtune README, optimization flags (PR #2003): + packed",
        "GiB active", 60.0, "held out", "a100-sxm-80gb", _L32_3B, 2, 4096, 28,
        build=tied_llama, dtype=torch.bfloat16,
        note="full_finetune_single_device, bf16 parameters and AdamW state, no AC, eager"),
    Row("torchtune-3b-packed-speed", "torchtune README, optimization flags (PR #2003): + packed",
        "tokens/s/GPU", 7075, "held out", "a100-sxm-80gb", _L32_3B, 2, 4096, 28,
        build=tied_llama, dtype=torch.bfloat16, note="as the row above"),
    Row("torchtune-3b-packed-compile", "torchtune README, optimization flags (PR #2003): + compile",
        "GiB active", 51.0, "held out", "a100-sxm-80gb", _L32_3B, 2, 4096, 28,
        build=compiled_tied_llama, dtype=torch.bfloat16, options={"compile": True},
        note="as torchtune-3b-packed, every layer and the loss compiled (inductor, GPU-less)"),
    *[Row(f"litgpt-{size}-lora-mb{mb}", _LITGPT, "GB allocated", pub, "held out",
          "a100-sxm-40gb", cfg, mb, 1304, cfg.n_layers, build=lora_llama, dtype=torch.bfloat16,
          note="LoRA r=8 on query and value, micro-batch padded to the longest example (1304)")
      for size, cfg, mb, pub in _LORA],
    Row("litgpt-8b-full-a10g", "litgpt config_hub/finetune/README.md: llama-3.1-8b/full.yaml",
        "fits", "OOM", "held out", "a10g", _L31_8B, 4, 512, 32, build=lambda c: (lambda: Llama(c)),
        dtype=torch.bfloat16, note="bf16-true full finetune, AdamW, micro-batch 4, seq 512"),
]

NOT_EXPRESSIBLE = [
    ("Megatron-LM H100 weak scaling (9 rows)", "Megatron-Core with Transformer Engine kernels, "
     "distributed optimizer, --tp-comm-overlap, pipeline parallelism for 70B and up; global "
     "batch per GPU without the micro-batch size"),
    ("Megatron-LM A100 (Narayanan et al. 2021, 10 rows)", "pipeline parallelism (MP > 8), "
     "Megatron's fused kernels; micro-batch sizes not in the table"),
    ("Korthikanti et al. 2022, Table 5 / Figure 1", "175B and up need pipeline parallelism "
     "(interleaved); 22B TP 8 with Megatron's sequence parallelism and fused fp16 kernels is "
     "expressible with a TP plan for GPT but not done yet; Figure 1 is computed, not measured"),
    ("torchtune + chunked CE, AC, optimizer in backward, offloading, 8-bit AdamW",
     "activation offloading (CPU), bitsandbytes 8-bit AdamW and optimizer-in-backward are not "
     "expressible; chunked CE and AC are, not done yet"),
    ("torchtune baseline (unpacked)", "sequence lengths follow the data (Alpaca padded per batch)"),
    ("torchtune 8B on RTX 4090 / A6000", "PagedAdamW8bit (bitsandbytes) and CPU paging"),
    ("litgpt A10G full finetunes: llama-3.2-1b 8.70, llama-3.2-3b 16.51, phi-3 17.01, "
     "tiny-llama 14.10 GB", "the stated config cannot hold its own state on one A10G: bf16 "
     "parameters, gradients and AdamW state are 8 B/parameter (3.2B -> 25.7 GB, phi-3 3.8B -> "
     "30.6 GB > 24 GB); the figures fit a 4-GPU FSDP run, so the run's layout is unknown"),
    ("DeepSpeed max-batch sweep (OpenTau PR #429)", "DeepSpeed ZeRO-2/3 and a Qwen3-VL backbone"),
    ("pith-train DualPipeV; Megatron-LM PR #482", "pipeline parallelism (DualPipeV, PP 2); the "
     "TP 8 row runs Megatron-Core's kernels"),
]


# ---- prediction --------------------------------------------------------------------------------

def _a10g():
    """The A10G (GA102, sm86, as the RTX 3090 whose kernel rules it shares) with its memory:
    24 GB GDDR6 (AWS G5 documentation), 23,028 MiB as nvidia-smi reports it."""
    g = get_gpu("rtx-3090")
    return replace(g, key="a10g", name="NVIDIA A10G", memory_bytes=24 << 30,
                   reported_memory_bytes=23028 << 20)


def _gpu(row):
    return _a10g() if row.gpu == "a10g" else get_gpu(row.gpu)


def _trace(row, layers: int) -> dict:
    cfg = replace(row.cfg, n_layers=layers)
    gpu = _gpu(row)
    inputs = [tapescope.spec((row.batch, row.seq), dtype=torch.long)] * 2
    p = tapescope.profile(row.build(cfg), *inputs, device="cuda", gpu=gpu, mesh=row.mesh,
                          parallelize=row.parallelize, dtype=row.dtype, amp=row.amp,
                          **row.options)
    out = {"flops": p.flops["total"]}
    if row.metric == "tokens/s/GPU":
        ic = None
        if row.network_bps is not None:
            base = interconnect(gpu)
            ic = Interconnect(base.intra_node, base.intra_kind, row.network_bps / base.gpus_per_node,
                              f"{row.network_bps * 8 / 1e9:.0f} Gb/s per node", base.gpus_per_node,
                              row.source)
        comm = {c.op: c.seconds for c in collectives(p.ops, p.facts, gpu, ic)} if row.mesh else None
        t = estimate_step_time(p.ops, p.trace, gpu, comm)
        out.update(seconds=t.seconds, exposed_comm=t.exposed_comm, comm=t.comm)
    else:
        m = p.cuda_memory
        out.update(allocated=m.max_allocated, reserved=m.max_reserved, oom=m.oom)
    return out


def _line(a: dict, b: dict, layers: int, lo: int) -> dict:
    return {k: (a[k] + (layers - lo) * (b[k] - a[k]) if isinstance(a[k], (int, float)) and
                not isinstance(a[k], bool) else b[k]) for k in a}


def predict(row) -> dict:
    t0 = time.time()
    a, b = _trace(row, 2), _trace(row, 3)
    full = _line(a, b, row.layers, 2)
    full["trace_s"] = time.time() - t0
    gpu = _gpu(row)
    if row.metric == "tokens/s/GPU":
        full["value"] = row.batch * row.seq / full["seconds"]
    elif row.metric == "GiB active":
        full["value"] = full["allocated"] / 2**30
    elif row.metric == "GB allocated":
        full["value"] = full["allocated"] / 1e9
    if row.metric in ("GB allocated", "fits", "GiB active"):
        full["oom"] = full["reserved"] > usable_memory_bytes(gpu)
        if row.published == "OOM" or row.metric == "fits":
            full["value"] = "OOM" if full["oom"] else "fits"
    return full


def check_linear(row) -> float:
    """Relative distance of T(4) (or memory) from the line through 2 and 3 blocks."""
    a, b, c = (_trace(row, n) for n in (2, 3, 4))
    key = "seconds" if "seconds" in a else "allocated"
    return (c[key] - _line(a, b, 4, 2)[key]) / c[key]


# ---- the table ------------------------------------------------------------------------------

def _error(pred, pub):
    if isinstance(pub, str) or isinstance(pred, str):
        return None
    return pred / pub - 1


def table(rows, results) -> str:
    lines = ["| row | GPU | metric | published | predicted | error | role | how it is built |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        res = results.get(r.name)
        if res is None:
            continue
        pred, pub = res["value"], r.published
        err = _error(pred, pub)
        shown = pred if isinstance(pred, str) else f"{pred:,.0f}" if pred > 100 else f"{pred:.2f}"
        if isinstance(pub, str) and isinstance(pred, str):
            errtext = "right" if pred == pub else "WRONG"
        elif isinstance(pub, str):
            errtext = "right" if (pub == "OOM") == res.get("oom") else "WRONG"
            shown = f"{shown} ({'OOM' if res.get('oom') else 'fits'})"
        else:
            errtext = f"{err:+.1%}"
            if r.metric != "tokens/s/GPU":
                errtext += "" if not res.get("oom") else " (called OOM: WRONG)"
        depth = f"{r.layers} blocks from 2 and 3"
        lines.append(f"| {r.name} | {r.gpu} | {r.metric} | {pub} | {shown} | {errtext} | "
                     f"{r.role} | {r.note}; {depth} |")
    return "\n".join(lines)


def summary(rows, results) -> str:
    out = []
    for metric_kind, metrics in (("step time (tokens/s)", ("tokens/s/GPU",)),
                                 ("memory", ("GiB active", "GB allocated"))):
        for role in ("calibration", "held out"):
            errs = [abs(_error(results[r.name]["value"], r.published)) for r in rows
                    if r.name in results and r.metric in metrics and r.role == role
                    and _error(results[r.name]["value"], r.published) is not None]
            if errs:
                out.append(f"- {metric_kind}, {role} rows: median |error| "
                           f"{statistics.median(errs):.1%}, worst {max(errs):.1%} ({len(errs)} rows)")
    verdicts = [(r, results[r.name]) for r in rows if r.name in results
                and (isinstance(r.published, str) or r.metric == "fits" or
                     r.metric in ("GB allocated", "GiB active"))]
    right = sum(1 for r, res in verdicts
                if (r.published == "OOM") == bool(res.get("oom")))
    out.append(f"- fits / OOM verdicts: {right} of {len(verdicts)} right")
    return "\n".join(out)


def not_expressible() -> str:
    lines = ["| published rows | why not yet |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in NOT_EXPRESSIBLE]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row names (prefixes work)")
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--write-doc", action="store_true")
    ap.add_argument("--check-linear", action="store_true")
    args = ap.parse_args(argv)
    rows = ROWS
    if args.rows:
        wanted = args.rows.split(",")
        rows = [r for r in ROWS if any(r.name.startswith(w) for w in wanted)]
    cache = {}
    if not args.no_cache and os.path.exists(CACHE):
        with open(CACHE) as f:
            cache = json.load(f)
    for r in rows:
        if args.check_linear:
            print(f"{r.name}: 4 blocks off the 2-3 line by {check_linear(r):+.4%}", flush=True)
            continue
        if r.name not in cache:
            cache[r.name] = predict(r)
            os.makedirs(os.path.dirname(CACHE), exist_ok=True)
            with open(CACHE, "w") as f:
                json.dump(cache, f, indent=1)
        print(f"{r.name}: published {r.published}, predicted {cache[r.name]['value']}", flush=True)
    if args.check_linear:
        return
    text = table(rows, cache) + "\n\n" + summary(rows, cache)
    print(text)
    if args.write_doc:
        doc = open(DOC).read()
        block = f"{BEGIN}\n{text}\n\nRows not expressed yet:\n\n{not_expressible()}\n{END}"
        if BEGIN in doc:
            doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
        else:
            doc = doc.rstrip("\n") + "\n\n" + block + "\n"
        with open(DOC, "w") as f:
            f.write(doc)


if __name__ == "__main__":
    main()
