"""Published measured training runs, predicted GPU-less: the step-time and memory benchmark.

Each row of ../shared/reference/published_runs.md that tapescope can express is built as that
code runs it (architecture, vocabulary, sequence, micro-batch, precision, activation
checkpointing, sharding, the attention kernel of its stack) and traced on fake CUDA tensors with
the fake process group; the figure the source reports (tokens/s per GPU, peak active or
max_memory_allocated, OOM) is compared with tapescope's. Rows it cannot express are listed with
the reason.

Reduced depth, for step time only: a Llama's blocks are identical, so a step of L blocks is
traced at 2 and 3 blocks and extrapolated linearly (T(L) = T(2) + (L - 2) (T(3) - T(2)));
`--check-linear` traces 4 blocks too and prints how far T(4) lies from the line. Memory rows are
traced at full depth: the peak is a maximum over the step, and where it sits can change with
depth (torchtune's "+ activation checkpointing": the loss's backward at 2 and 3 blocks, the
foreach AdamW step at 28), so extrapolating the peak from two small depths is wrong there.

    python benchmarks/published_runs.py                 # every row (a few minutes), cached
    python benchmarks/published_runs.py --rows fms-7b-a100,litgpt-7b-lora-mb1 --no-cache
    python benchmarks/published_runs.py --write-doc     # the table into docs/validation.md
    (--no-cache re-predicts the rows asked for; --write-doc always writes every row, the rows
    not asked for from the cache, so `--rows X --no-cache --write-doc` refreshes one row.)

Calibration: the A100 rows of IBM fms-fsdp are the calibration rows of the step-time model (no
constant was fitted to them: devices/efficiency.py's constants come from published
microbenchmarks; they were used to choose between mechanisms, e.g. which ops run on FSDP2's
side streams); every other row is held out. `--write-doc` also writes the calibration rows'
step-time errors, by kind of step, into src/tapescope/devices/time_bands.py: the error band
every predicted time shows, widened by the uncertainty of its mechanisms (analysis/time_band.py;
the band's column marks whether the published figure lies inside the band that row shows).
Korthikanti's and Megatron's rows were changed once after their first predictions (the
program, not a constant; said at each). The single-GPU rows are built with the runs' own
model code (lit-gpt's GPT + LoRA, torchtune's modules), re-expressed from their sources, not
tuned to the published figures.
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
from tapescope.analysis.time_band import band_for, profile_band  # noqa: E402
from tapescope.analysis.timing import estimate_step_time  # noqa: E402
from tapescope.devices.gpus import Interconnect, get_gpu, interconnect, usable_memory_bytes  # noqa: E402
from tapescope.zoo.llama import Attention, Llama, LlamaConfig  # noqa: E402

CACHE = os.path.join(ROOT, "benchmarks", ".cache", "published_runs.json")
BANDS = os.path.join(ROOT, "src", "tapescope", "devices", "time_bands.py")
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


class LitRMSNorm(nn.Module):
    """lit_gpt/rmsnorm.py (commit 8641822): unfused, in the input's dtype; autograd keeps the
    normalised input and the reciprocal root besides the input."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x_normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return self.weight * x_normed


def _lit_rope(x, cos, sin):
    # lit_gpt/model.py apply_rope: cos and sin are float16 (build_rope_cache returns .half() for a
    # bf16 default dtype), so bf16 x times them promotes to float32 before type_as(x)
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class LitLoRAQKV(nn.Module):
    """lit_gpt/lora.py LoRAQKVLinear with LoRA on query and value (r=8, alpha=16, dropout 0.05):
    one fused frozen qkv projection; the update B(A(dropout x)) is a grouped conv1d, then
    zero-padded to the full qkv width (index_copy into new zeros) and scaled."""

    def __init__(self, dim: int, r: int = 8, alpha: int = 16):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim, bias=False)
        self.linear.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.zeros(2 * r, dim))
        self.lora_B = nn.Parameter(torch.zeros(2 * dim, r))
        self.dropout = nn.Dropout(0.05)
        self.scaling = alpha / r
        self.dim = dim

    def forward(self, x):
        pretrained = self.linear(x)
        after_a = F.linear(self.dropout(x), self.lora_A)
        after_b = F.conv1d(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1),
                           groups=2).transpose(-2, -1)
        xt = after_b.transpose(0, 1)
        index = torch.tensor([*range(self.dim), *range(2 * self.dim, 3 * self.dim)],
                             device=x.device)
        padded = xt.new_zeros((*xt.shape[:-1], 3 * self.dim)).view(-1, 3 * self.dim)
        padded = padded.index_copy(1, index, xt.reshape(-1, 2 * self.dim))
        lora = padded.view((*xt.shape[:-1], 3 * self.dim)).transpose(0, 1) * self.scaling
        return pretrained + lora


class LitBlock(nn.Module):
    """lit_gpt/model.py Block for a Llama 2 config (multi-head: query groups = heads, no
    parallel residual, LLaMAMLP)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.norm_1, self.norm_2 = LitRMSNorm(c.dim), LitRMSNorm(c.dim)
        self.attn = LitLoRAQKV(c.dim)
        self.proj = nn.Linear(c.dim, c.dim, bias=False)
        self.fc_1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.fc_2 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.mlp_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.heads, self.head_dim = c.n_heads, c.dim // c.n_heads

    def _attention(self, x, cos, sin):
        B, T, C = x.shape
        qkv = self.attn(x).view(B, T, self.heads, 3, self.head_dim).permute(0, 2, 3, 1, 4)
        q, k, v = (t.reshape(B, -1, T, self.head_dim) for t in qkv.split((1, 1, 1), dim=2))
        # rope on the whole head (rotary_percentage 1.0), then cat with the empty rest: a copy
        q = torch.cat((_lit_rope(q, cos, sin), q[..., self.head_dim:]), dim=-1)
        k = torch.cat((_lit_rope(k, cos, sin), k[..., self.head_dim:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x, cos, sin):
        x = x + self._attention(self.norm_1(x), cos, sin)
        n = self.norm_2(x)
        return x + self.mlp_proj(F.silu(self.fc_1(n)) * self.fc_2(n))


class LitGPT(nn.Module):
    """lit-gpt's GPT with LoRA (lit_gpt/lora.py at commit 8641822, the resource tables' version)
    as finetune/lora.py trains it: bf16-true (parameters in bf16, the rope cache in float16),
    only LoRA's A and B trainable, the lm_head run in chunks of 128 positions
    (`lm_head_chunk_size=128`) and chunked_cross_entropy over the chunks (the last one sliced to
    drop the final position)."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.dim)
        self.h = nn.ModuleList(LitBlock(c) for _ in range(c.n_layers))
        self.ln_f = LitRMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        for name, p in self.named_parameters():
            p.requires_grad_("lora_" in name)
        self.to(torch.bfloat16)
        hd = c.dim // c.n_heads
        theta = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
        angles = torch.outer(torch.arange(c.max_seq_len), theta).repeat(1, 2)
        self.register_buffer("cos", torch.cos(angles).half(), persistent=False)
        self.register_buffer("sin", torch.sin(angles).half(), persistent=False)

    def forward(self, idx, targets):
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin)
        x = self.ln_f(x)
        logits = [self.lm_head(x_i) for x_i in x.split(128, dim=1)]
        logits[-1] = logits[-1][..., :-1, :]
        targets = targets[..., 1:]
        losses = [F.cross_entropy(lg.reshape(-1, lg.size(-1)), tg.reshape(-1), ignore_index=-1,
                                  reduction="none")
                  for lg, tg in zip(logits, targets.split(logits[0].size(1), dim=1))]
        return torch.cat(losses).mean()


def lit_gpt_lora(cfg: LlamaConfig):
    # the rope cache is as long as the longest training example (train() sets max_seq_length)
    return lambda: LitGPT(replace(cfg, max_seq_len=1304))


class TuneRMSNorm(nn.Module):
    """torchtune/modules/rms_norm.py: normalises in float32 (x.float()), casts back, then scales;
    autograd keeps the float32 copy of the input besides the normalised output."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.scale


def _tune_rope(x, cache):
    # torchtune/modules/position_embeddings.py (and Llama3ScaledRoPE): pairs rotated in float32
    # against a float32 (seq, head_dim / 2, 2) cache, stacked, flattened, cast back
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    c = cache[: x.size(1)].view(1, x.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * c[..., 0] - xs[..., 1] * c[..., 1],
                       xs[..., 1] * c[..., 0] + xs[..., 0] * c[..., 1]], -1)
    return out.flatten(3).type_as(x)


class TuneLayer(nn.Module):
    """torchtune TransformerSelfAttentionLayer with its MultiHeadAttention (grouped-query: k and
    v expanded to every query head before attention) and FeedForward."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        hd = self.head_dim = c.dim // c.n_heads
        self.heads, self.kv_heads = c.n_heads, c.n_kv_heads
        self.sa_norm, self.mlp_norm = TuneRMSNorm(c.dim), TuneRMSNorm(c.dim)
        self.q_proj = nn.Linear(c.dim, c.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * hd, bias=False)
        self.output_proj = nn.Linear(c.n_heads * hd, c.dim, bias=False)
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def _attn(self, x, cache):
        b, s, _ = x.shape
        hd, rep = self.head_dim, self.heads // self.kv_heads
        q = _tune_rope(self.q_proj(x).view(b, s, self.heads, hd), cache).transpose(1, 2)
        k = _tune_rope(self.k_proj(x).view(b, s, self.kv_heads, hd), cache).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, hd).transpose(1, 2)
        k = k.unsqueeze(2).expand(b, self.kv_heads, rep, s, hd).flatten(1, 2)
        v = v.unsqueeze(2).expand(b, self.kv_heads, rep, s, hd).flatten(1, 2)
        # packed samples: flex attention with a block-causal mask in the run; a causal fused
        # kernel here (same saved output and log-sum-exp)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(y.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x, cache):
        h = x + self._attn(self.sa_norm(x), cache)
        n = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(n)) * self.w3(n))


class _TuneCrossEntropy(nn.Module):
    """torchtune's loss for the rows before "+ chunked cross-entropy": nn.CrossEntropyLoss
    (mean over the labels that are not -100) on the float32 logits the model returns."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-100)


class _UpcastCrossEntropy(nn.Module):
    """CEWithChunkedOutputLoss.compute_cross_entropy: one chunk upcast to float32 and its summed
    cross-entropy. A module of its own so that it can be compiled alone, as `compile_loss`
    compiles only this method (`loss.compute_cross_entropy = torch.compile(...)`)."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


class _TuneChunkedCrossEntropy(nn.Module):
    """torchtune/modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss (8 chunks): the
    bf16 logits come as a list of chunks along the sequence, each upcast and reduced alone, so
    one chunk's float32 copy exists at a time."""

    def __init__(self, num_output_chunks: int = 8):
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.compute_cross_entropy = _UpcastCrossEntropy()

    def forward(self, logits, labels):
        total_elements = (labels != -100).sum()
        labels = [c.reshape(-1) for c in labels.chunk(self.num_output_chunks, dim=1)]
        logits = [c.reshape(-1, c.size(-1)) for c in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels):
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)
        return total_loss / total_elements


class TuneLlama(nn.Module):
    """torchtune's llama3_2 TransformerDecoder as full_finetune_single_device trains it in bf16,
    with the recipe's loss inside (the step is model(tokens, labels) -> loss): tied output
    projection; without chunking the logits are cast to float32 (`self.output(h).float()`) for
    CrossEntropyLoss, with `set_num_output_chunks(8)` they stay bf16, one projection per sequence
    chunk (`chunked_output`), for CEWithChunkedOutputLoss."""

    def __init__(self, c: LlamaConfig, num_output_chunks: int = 0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TuneLayer(c) for _ in range(c.n_layers))
        self.norm = TuneRMSNorm(c.dim)
        self.num_output_chunks = num_output_chunks
        self.loss = _TuneChunkedCrossEntropy(num_output_chunks) if num_output_chunks \
            else _TuneCrossEntropy()
        self.to(torch.bfloat16)
        hd = c.dim // c.n_heads
        theta = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(c.max_seq_len).float(), theta)
        self.register_buffer("rope_cache", torch.stack([angles.cos(), angles.sin()], -1),
                             persistent=False)

    def output(self, h):
        return F.linear(h, self.tok_embeddings.weight)   # TiedLinear

    def forward(self, tokens, labels):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cache)
        h = self.norm(h)
        if self.num_output_chunks:
            logits = [self.output(c) for c in h.chunk(self.num_output_chunks, dim=1)]
        else:
            logits = self.output(h).float()
        return self.loss(logits, labels)


def tune_llama(compile: bool = False, chunked_ce: bool = False, ac: bool = False):
    """Llama 3.2 as full_finetune_single_device sets it up, in the recipe's order.

    compile (training/_compile.py): `compile_model` calls `.compile()` on every
    TransformerSelfAttentionLayer; `compile_loss` compiles CEWithChunkedOutputLoss's
    `compute_cross_entropy` in place, but for any other loss it returns
    `torch.compile(loss)` and the recipe drops the return value (`training.compile_loss(
    self._loss_fn)`, unassigned, torchtune 0.4 and 0.5), so plain CrossEntropyLoss runs eagerly.
    ac: `set_activation_checkpointing(model, {TransformerSelfAttentionLayer})`, i.e. torch's
    `apply_activation_checkpointing`: every layer, already compiled, inside a non-reentrant
    CheckpointWrapper. tapescope compiles exactly the modules the code compiled (compile=True)."""

    def for_config(cfg: LlamaConfig):
        def build():
            m = TuneLlama(cfg, num_output_chunks=8 if chunked_ce else 0)
            if compile:
                for layer in m.layers:
                    layer.compile()
            if ac:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                    apply_activation_checkpointing)
                from torch.distributed.fsdp.wrap import ModuleWrapPolicy

                apply_activation_checkpointing(m, auto_wrap_policy=ModuleWrapPolicy({TuneLayer}))
            if compile and chunked_ce:
                m.loss.compute_cross_entropy.compile()
            return m
        return build
    return for_config


def tune_optim_in_bwd(model):
    """full_finetune_single_device's `_setup_optimizer(optimizer_in_bwd=True)` (torchtune 0.5.0):
    one optimizer per parameter (`config.instantiate(cfg_optimizer, [p])`), stepped by
    `training.register_optim_in_bwd_hooks`: a post-accumulate-grad hook on every parameter that
    requires grad runs `optim_dict[param].step()` then `.zero_grad()` (set_to_none), so each
    gradient is freed as soon as its parameter is updated. AdamW as the earlier rows run it:
    torch's default for CUDA parameters, foreach (fake parameters would make torch pick the
    single-tensor loop, so it is said explicitly)."""
    optim_dict = {p: torch.optim.AdamW([p], lr=2e-5, foreach=True) for p in model.parameters()}

    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(optim_step)
    return optim_dict


def tune_train_step(model, batch, optimizers):
    """The recipe's `train` loop body with optimizer_in_bwd (no optimizer.step, no clipping: the
    hooks step): the loss times the step's unmasked tokens, then backward."""
    tokens, labels = batch
    current_num_tokens = (labels != -100).sum()
    current_loss = model(tokens, labels) * current_num_tokens
    current_loss.backward()


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


# Korthikanti et al. 2022 ("Reducing Activation Recomputation", arXiv 2205.05198), Table 5: the
# 22B GPT (hidden 6144, 48 layers, 48 heads, seq 2048, vocab 51,200, fp16) on one A100 80 GB node
# with TP 8, PP 1, DP 1, global batch 4 = micro-batch 4: iteration 1.42 s with full recompute,
# 1.10 s with sequence parallelism + selective recompute (as Calculon encodes the config,
# shared/reference/published_runs.md). Expressed with today's TP (DTensor, torchtitan's plan, whose
# norms are sequence-parallel in both rows) on a Llama-shaped equivalent: SwiGLU at 8h/3 = 16384
# (the FLOPs of GPT's 4h GeLU MLP), RMSNorm and rope instead of LayerNorm and learned positions;
# attention unfused (QK^T, masked softmax, x V as separate fp16 kernels, as 2022 Megatron-LM
# ran it, not flash; attention dropout left out); fp16 parameters and activations, as Megatron's fp16 training
# runs its model (autocast over fp32 parameters would keep the residual stream, hence every TP
# collective, in fp32). Full recompute: every block checkpointed; selective: only the
# attention core (QK^T, softmax, x V) is recomputed. tokens/s of the TP group = 8192 / iteration.
# Built, predicted, then corrected twice AFTER seeing the predictions (so these two rows are
# less independent than the others, and the docs say so). First built with fp16 autocast over
# fp32 parameters and SDPA's math backend: tokens/s -19% / -22%. Autocast keeps the residual
# stream, hence every TP collective, in fp32; with fp16 parameters: -32% / -37%, because SDPA's
# math backend upcasts fp16 to fp32 and its bmms ran on CUDA cores. With Megatron's fp16
# attention core written out: +8.0% / +3.2%. Megatron's fp16 training runs neither fp32
# activations nor fp32 attention: both corrections make the program the one it ran.
_KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198) Table 5, A100 80 GB, 22B GPT, TP 8"
_K22B = LlamaConfig(vocab_size=51200, dim=6144, n_layers=48, n_heads=48, n_kv_heads=48,
                    ffn_dim=16384, max_seq_len=2048)


class UnfusedAttentionLlama(Llama):
    """The zoo Llama with attention unfused, as Megatron-LM's core attention of 2022 runs it;
    `selective` checkpoints the attention core alone (Megatron's selective recompute)."""

    def __init__(self, config, selective: bool = False):
        super().__init__(config)
        from torch.utils.checkpoint import checkpoint

        def core(q, k, v):
            # Megatron's core attention: fp16 QK^T (baddbmm with the 1/sqrt(d) scale), its fused
            # scale-mask-softmax (fp16 in and out), fp16 probabilities x V. (SDPA's math backend
            # would upcast fp16 to fp32 and run the bmms on CUDA cores.)
            T = q.size(-2)
            scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
            return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v

        for mod in self.modules():
            if isinstance(mod, Attention):
                def forward(x, _m=mod):
                    from tapescope.zoo.llama import rope

                    B, T, _ = x.shape
                    q, k, v = (w(x).view(B, T, -1, _m.head_dim).transpose(1, 2)
                               for w in (_m.wq, _m.wk, _m.wv))
                    q, k = rope(q, _m.theta), rope(k, _m.theta)
                    y = checkpoint(core, q, k, v, use_reentrant=False) if selective \
                        else core(q, k, v)
                    return _m.wo(y.transpose(1, 2).reshape(B, T, -1))
                mod.forward = forward


def tp_parallelize(full_recompute: bool):
    """torchtitan's Llama TP plan (tapescope's preset) on the mesh's "tp" dimension; with
    `full_recompute` every block's forward in a non-reentrant checkpoint."""

    def parallelize(model, mesh):
        from torch.utils.checkpoint import checkpoint

        from tapescope.distributed.presets import _llama_plan

        _llama_plan(model, mesh["tp"])
        if full_recompute:
            for block in model.layers:
                fwd = block.forward
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(fwd)
        return model
    return parallelize


def _korthikanti_rows():
    return [Row(f"korthikanti-22b-{name}", _KORTHIKANTI, "tokens/s/GPU", round(8192 / seconds, 1),
                "held out", "a100-sxm-80gb", _K22B, 4, 2048, 48,
                build=lambda c, sel=selective: (lambda: UnfusedAttentionLlama(c, sel)),
                mesh={"tp": 8}, parallelize=tp_parallelize(full), dtype=torch.float16,
                note=f"iteration {seconds} s ({label}); tokens/s of the TP group = 8192 / "
                     "iteration; a Llama-shaped equivalent (SwiGLU 16384 = GeLU 4h's FLOPs), "
                     "unfused attention, DTensor TP 8 with sequence-parallel norms, fp16 "
                     "parameters and activations (Megatron's fp16 keeps fp32 master weights in "
                     "the optimizer only: its AdamW moves about 2x the bytes traced here)")
            for name, seconds, full, selective, label in (
                ("full-recompute", 1.42, True, False, "full recompute"),
                ("sp-selective", 1.10, False, True, "sequence parallel + selective recompute"))]


# Megatron-LM's H100 weak-scaling table (Megatron-Core r0.8.0, README images/model_table.png, as
# shared/reference/published_runs.md transcribes it): GPT, vocab 131,072, seq 4096, bf16, DP 48,
# global batch 192 (4 sequences per data-parallel rank), --overlap-grad-reduce
# --overlap-param-gather --tp-comm-overlap; published as model TFLOP/s per GPU by Megatron's own
# formula (training.py num_floating_point_operations: 12 B s L h^2 ((1 + g/a + s/h) + f/h +
# V / (2 L h)), attention counted unmasked), converted here to tokens/s of a TP group with the
# GPT defaults the table does not state otherwise (ffn 4h, no SwiGLU, MHA). The rows without
# pipeline parallelism are built (TP 1, 2, 4, 8); expressed as: a Llama-shaped equivalent
# (SwiGLU at 8h/3 = the FLOPs of 4h GeLU, rounded to a multiple of 64 so TP 8 shards it evenly:
# within 0.4%), bf16 parameters, fp32 gradient reduction, the
# distributed optimizer as FSDP2 without resharding after forward (parameters gathered once per
# step, gradients reduce-scattered once: the same collectives), the 4 sequences of a step as one
# micro-batch (the micro-batch size is not in the table: assumed; it also gives the one gradient
# reduce-scatter per step Megatron's --overlap-grad-reduce does, where FSDP2 under gradient
# accumulation would reduce every micro-batch), tapescope's TP plan. Not expressed:
# --tp-comm-overlap (the TP collectives are exposed here).
# Built, predicted, then changed once AFTER seeing the predictions (said in the docs): first with
# micro-batch 1 x 4 accumulation steps, where FSDP2 reduce-scatters every micro-batch's gradients
# (fp32, across nodes) and Megatron once per step: tokens/s -8.6%, -18.6%, -33.6%, -61.9%; then
# the step's 4 sequences as one micro-batch, which reduces once.
_MEGATRON = "Megatron-LM README (Megatron-Core r0.8.0) H100 weak scaling, model TFLOP/s per GPU"
_MEGATRON_MODELS = (("1.7b", 16, 2048, 24, 1, 408.8), ("7.1b", 32, 4096, 30, 2, 465.9),
                    ("16b", 48, 6144, 32, 4, 489.1), ("32b", 56, 7168, 48, 8, 459.6))


def megatron_flops_per_token(h: int, layers: int, seq: int, vocab: int = 131072) -> float:
    """Megatron's num_floating_point_operations / (batch x seq) for GPT with 4h MLP, MHA."""
    return 12 * layers * h * h * ((1 + 1 + seq / h) + 4 + vocab / (2 * layers * h))


def megatron_parallelize(tp: int):
    def parallelize(model, mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from tapescope.distributed.presets import _llama_plan

        if tp > 1:
            _llama_plan(model, mesh["tp"])
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        return fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    return parallelize


def _megatron_rows():
    rows = []
    for name, heads, h, layers, tp, tflops in _MEGATRON_MODELS:
        cfg = LlamaConfig(vocab_size=131072, dim=h, n_layers=layers, n_heads=heads,
                          n_kv_heads=heads, ffn_dim=round(8 * h / 3 / 64) * 64, max_seq_len=4096)
        group_tokens = tflops * 1e12 / megatron_flops_per_token(h, layers, 4096) * tp
        rows.append(Row(
            f"megatron-{name}-h100", _MEGATRON, "tokens/s/GPU", round(group_tokens, 1),
            "held out", "h100-sxm", cfg, 4, 4096, layers, build=lambda c: (lambda: Llama(c)),
            mesh={"dp": 48, "tp": tp} if tp > 1 else {"dp": 48},
            parallelize=megatron_parallelize(tp), dtype=torch.bfloat16,
            note=f"{tflops} TFLOP/s/GPU (Megatron's formula, 4h GeLU MHA assumed) -> tokens/s "
                 f"of the TP {tp} group; DP 48 as FSDP2 without reshard, TP {tp} (collectives "
                 "exposed: --tp-comm-overlap not expressed), the step's 4 sequences as one "
                 "micro-batch (assumed), Llama-shaped equivalent"))
    return rows


_LITGPT = "litgpt tutorials/resource-tables.md (A100-SXM4-40GB, bf16-true, LoRA, Alpaca)"
# the longest Alpaca example in Llama 2's tokenizer: 1304 tokens (the same page); batches pad to it
_LORA = (("7b", _L2_7B, 1, 21.30), ("7b", _L2_7B, 2, 29.07), ("7b", _L2_7B, 4, "OOM"),
         ("13b", _L2_13B, 1, 38.12), ("13b", _L2_13B, 2, "OOM"))

_TUNE = "torchtune README, optimization flags (PR #2003): "
_TUNE_NOTE = ("torchtune's own modules (float32 RMSNorm and rope internals, k/v expanded to every "
              "head, float32 logits), bf16 parameters and AdamW state")
# the README's cumulative rows: (row suffix, technique, published peak active GiB, builder options)
_TUNE_STEPS = (
    ("packed", "+ packed", 60.0, {}, "no AC, eager"),
    ("packed-compile", "+ compile", 51.0, {"compile": True},
     "every layer compiled (inductor, GPU-less); the loss eager (the recipe drops compile_loss's "
     "return value)"),
    ("packed-compile-chunkedce", "+ chunked cross-entropy", 42.9,
     {"compile": True, "chunked_ce": True},
     "as above, output projection in 8 sequence chunks, CEWithChunkedOutputLoss with its "
     "compute_cross_entropy compiled"),
    ("packed-compile-chunkedce-ac", "+ activation checkpointing", 24.9,
     {"compile": True, "chunked_ce": True, "ac": True},
     "as above, every (compiled) layer in a non-reentrant CheckpointWrapper"),
    ("packed-compile-chunkedce-ac-optinbwd", "+ optimizer in backward", 23.1,
     {"compile": True, "chunked_ce": True, "ac": True},
     "as above, the recipe's own step (step=): one AdamW per parameter stepped in its "
     "post-accumulate-grad hook (optimizer_in_bwd)"),
)


_OPT_IN_BWD = {"step": tune_train_step, "setup": tune_optim_in_bwd}


def _torchtune_rows():
    rows = []
    for suffix, technique, published, opts, note in _TUNE_STEPS:
        rows.append(Row(f"torchtune-3b-{suffix}", _TUNE + technique, "GiB active", published,
                        "held out", "a100-sxm-80gb", _L32_3B, 2, 4096, 28, build=tune_llama(**opts),
                        options={**({"compile": True} if opts.get("compile") else {}),
                                 **(_OPT_IN_BWD if suffix.endswith("optinbwd") else {})},
                        note=f"{_TUNE_NOTE}; {note}"))
        # the same step's tokens/s (a compiled row's time is its generated kernels':
        # analysis/compiled_time.py)
        rows.append(Row(f"torchtune-3b-{suffix}-speed", _TUNE + technique, "tokens/s/GPU",
                        _TUNE_TOKENS[suffix], "held out", "a100-sxm-80gb", _L32_3B, 2, 4096, 28,
                        build=tune_llama(**opts), options=rows[-1].options,
                        note="as the row above"))
    return rows


# the same README table's tokens/s per GPU after each flag
_TUNE_TOKENS = {"packed": 7075, "packed-compile": 8998, "packed-compile-chunkedce": 9174,
                "packed-compile-chunkedce-ac": 7210, "packed-compile-chunkedce-ac-optinbwd": 7309}


ROWS = [
    *_fms_rows(),
    *_korthikanti_rows(),
    *_megatron_rows(),
    *_torchtune_rows(),
    *[Row(f"litgpt-{size}-lora-mb{mb}", _LITGPT, "GB allocated", pub, "held out",
          "a100-sxm-40gb", cfg, mb, 1304, cfg.n_layers, build=lit_gpt_lora,
          note="lit-gpt's own GPT + LoRA (fused qkv, unfused RMSNorm, fp16 rope cache, lm_head "
               "in chunks of 128), micro-batch padded to the longest example (1304)")
      for size, cfg, mb, pub in _LORA],
    Row("litgpt-8b-full-a10g", "litgpt config_hub/finetune/README.md: llama-3.1-8b/full.yaml",
        "fits", "OOM", "held out", "a10g", _L31_8B, 4, 512, 32, build=lambda c: (lambda: Llama(c)),
        dtype=torch.bfloat16, note="bf16-true full finetune, AdamW, micro-batch 4, seq 512"),
]

NOT_EXPRESSIBLE = [
    ("Megatron-LM H100 weak scaling: 70B, 119B, 177B, 314B, 462B", "pipeline parallelism "
     "(PP 2-16) with TP 8 and DP 48 (the TP-only rows 1.7B-32B are built)"),
    ("Megatron-LM A100 (Narayanan et al. 2021, 10 rows)", "pipeline parallelism (MP > 8), "
     "Megatron's fused kernels; micro-batch sizes not in the table"),
    ("Korthikanti et al. 2022, Table 5: 175B, 530B, 1T; Figure 1", "175B and up need "
     "interleaved pipeline parallelism over 8-64 stages with TP 8 (the 22B rows are built); "
     "Figure 1 is computed, not measured"),
    ("torchtune + activation offloading (21.8 GiB)", "OffloadActivations (use_streams) needs "
     "its own CUDA stream, events and pinned host copies in a single-device GPU-less step; not "
     "built yet"),
    ("torchtune + 8-bit AdamW (17.6 GiB)", "bitsandbytes' PagedAdamW8bit: its own CUDA kernels "
     "and paged (unified) memory"),
    ("torchtune tokens/s + activation offloading, + 8-bit AdamW (7301, 6960)", "as their memory "
     "rows: offloading's streams and pinned copies, bitsandbytes' paged optimizer"),
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
        items = collectives(p.ops, p.distributed.groups, p.distributed.collective_groups, gpu,
                            ic) if row.mesh else []
        comm = {c.op: c.seconds for c in items} or None
        t = estimate_step_time(p.ops, p.trace, gpu, comm, {c.op: c.stream for c in items},
                               compiled=p.compiled_schedule)
        out.update(seconds=t.seconds, exposed_comm=t.exposed_comm, comm=t.comm,
                   kind=profile_band(p, step_time=t).kind, mechanisms=t.mechanisms,
                   bound=t.bound)
    else:
        m = p.cuda_memory
        out.update(allocated=m.max_allocated, reserved=m.max_reserved, oom=m.oom)
    return out


def _line(a: dict, b: dict, layers: int, lo: int) -> dict:
    """Each number (and each number of a dict of them: the mechanisms' seconds) on the line
    through its values at `lo` and `lo + 1` blocks, at `layers` blocks."""
    def at(x, y):
        if isinstance(x, dict):
            return {k: at(x.get(k, 0.0), y.get(k, 0.0)) for k in {*x, *y}}
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return x + (layers - lo) * (y - x)
        return y
    return {k: at(a[k], b[k]) for k in a}


def predict(row) -> dict:
    t0 = time.time()
    if row.metric == "tokens/s/GPU":
        a, b = _trace(row, 2), _trace(row, 3)
        full = _line(a, b, row.layers, 2)
    else:
        # the peak is a maximum over the step: at 2 and 3 blocks it can sit in one phase (the
        # loss's backward) and at full depth in another (the optimizer step, whose foreach
        # temporaries grow faster per block), and the max of two lines is not a line
        full = _trace(row, row.layers)
    full["trace_s"] = time.time() - t0
    gpu = _gpu(row)
    if row.metric == "tokens/s/GPU":
        full["value"] = row.batch * row.seq / full["seconds"]
    elif row.metric == "GiB active":
        full["value"] = full["allocated"] / 2**30
    elif row.metric == "GB allocated":
        full["value"] = full["allocated"] / 1e9
    if row.metric in ("GB allocated", "fits", "GiB active"):
        # a full-depth replay that ran out stops at the card's capacity and says so (oom);
        # an extrapolated one is judged by its reserved bytes
        full["oom"] = bool(full.get("oom")) or full["reserved"] > usable_memory_bytes(gpu)
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


def row_band(row, res):
    """The error band the row's step time shows (analysis/time_band.py): its mechanisms'
    weighted uncertainty at full depth, widened by the calibration rows of its kind (a
    calibration row's own error left out of its band); None for a row without a step time."""
    if row.metric != "tokens/s/GPU" or not isinstance(res.get("value"), float):
        return None
    return band_for(res["kind"], res.get("mechanisms"), res["seconds"],
                    res["kind"].startswith("distributed"), leave_out=row.name)


def in_band(row, res, errors: dict | None = None) -> str:
    """Whether a step-time row's published figure lies inside the error band it shows: "yes"
    or "no" with the band (time errors), "-" for a row without a step time."""
    band = row_band(row, res)
    if band is None or band.low is None:
        return "-"
    # the row's own time error, t_pred / t_true - 1 = published rate / predicted rate - 1: the
    # true time lies in the band when that error is one the band allows
    err = row.published / res["value"] - 1
    alone = "" if band.rows else ", mechanisms alone"
    return (f"{'yes' if band.low <= err <= band.high else 'no'} ({err:+.1%} in "
            f"{band.low:+.1%} to {band.high:+.1%}{alone})")


def table(rows, results, errors: dict | None = None) -> str:
    errors = calibration_errors(rows, results) if errors is None else errors
    lines = ["| row | GPU | metric | published | predicted | error | role | true time inside the band it shows | "
             "how it is built |",
             "|---|---|---|---|---|---|---|---|---|"]
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
        depth = f"{r.layers} blocks from 2 and 3" if r.metric == "tokens/s/GPU" else \
            f"{r.layers} blocks traced"
        lines.append(f"| {r.name} | {r.gpu} | {r.metric} | {pub} | {shown} | {errtext} | "
                     f"{r.role} | {in_band(r, res, errors)} | {r.note}; {depth} |")
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
    errors = calibration_errors(rows, results)
    for role in ("calibration", "held out"):
        marks = [in_band(r, results[r.name], errors) for r in rows
                 if r.name in results and r.role == role and r.metric == "tokens/s/GPU"]
        if marks:
            yes = sum(m.startswith("yes") for m in marks)
            alone = sum("mechanisms alone" in m for m in marks)
            out.append(f"- step time, {role} rows inside the error band they show: {yes} of "
                       f"{len(marks)} ({alone} with a band from the mechanisms alone, no "
                       "calibration row of their kind" + (", each row left out of its own band"
                                                          if role == "calibration" else "") + ")")
    # compiled against eager where a source publishes both for one setup: the speed-up
    for eager, compiled in SPEEDUP_PAIRS:
        if eager in results and compiled in results:
            rows_by = {r.name: r for r in rows}
            pub = rows_by[compiled].published / rows_by[eager].published
            pred = results[compiled]["value"] / results[eager]["value"]
            out.append(f"- compiled vs eager ({compiled} over {eager}): published {pub:.3f}x, "
                       f"predicted {pred:.3f}x ({100 * (pred - pub):+.1f} points)")
    verdicts = [(r, results[r.name]) for r in rows if r.name in results
                and (isinstance(r.published, str) or r.metric == "fits" or
                     r.metric in ("GB allocated", "GiB active"))]
    right = sum(1 for r, res in verdicts
                if (r.published == "OOM") == bool(res.get("oom")))
    out.append(f"- fits / OOM verdicts: {right} of {len(verdicts)} right")
    return "\n".join(out)


# (eager row, compiled row) of one setup, both published: torchtune's "+ compile" is "+ packed"
# with every layer compiled
SPEEDUP_PAIRS = (("torchtune-3b-packed-speed", "torchtune-3b-packed-compile-speed"),)


def calibration_errors(rows, results) -> dict:
    """kind -> {row: step-time error} over the calibration rows with a step time: the data of
    the error band (devices/time_bands.py). A tokens/s error e is a time error 1 / (1 + e) - 1."""
    out: dict = {}
    for r in rows:
        res = results.get(r.name)
        if r.role != "calibration" or r.metric != "tokens/s/GPU" or res is None:
            continue
        out.setdefault(res["kind"], {})[r.name] = round(r.published / res["value"] - 1, 4)
    return out


def write_bands(errors: dict) -> None:
    lines = ["CALIBRATION_ERRORS = {"]
    for kind, rows in sorted(errors.items()):
        lines.append(f"    {kind!r}: {{")
        lines += [f"        {name!r}: {err!r}," for name, err in rows.items()]
        lines.append("    },")
    lines.append("}")
    text = open(BANDS).read()
    begin, end = "# BEGIN GENERATED", "# END GENERATED"
    head = text[:text.index(begin)]
    head += text[text.index(begin):].split("\n", 1)[0] + "\n"
    with open(BANDS, "w") as f:
        f.write(head + "\n".join(lines).replace('"', "'").replace("'", '"') + "\n" +
                text[text.index(end):])


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
    if os.path.exists(CACHE):
        with open(CACHE) as f:
            cache = json.load(f)
    for r in rows:
        if args.check_linear:
            print(f"{r.name}: 4 blocks off the 2-3 line by {check_linear(r):+.4%}", flush=True)
            continue
        if args.no_cache or r.name not in cache:
            cache[r.name] = predict(r)
            os.makedirs(os.path.dirname(CACHE), exist_ok=True)
            with open(CACHE, "w") as f:
                json.dump(cache, f, indent=1)
        print(f"{r.name}: published {r.published}, predicted {cache[r.name]['value']}", flush=True)
    if args.check_linear:
        return
    print(table(rows, cache) + "\n\n" + summary(rows, cache))
    if args.write_doc:
        # The doc's table is every row: rows not asked for this time come from the cache, so
        # re-running one row never drops the others from the doc.
        missing = [r.name for r in ROWS if r.name not in cache]
        errors = calibration_errors(ROWS, cache)
        if missing:
            sys.exit(f"--write-doc needs every row predicted; not in the cache: "
                     f"{', '.join(missing)} (run without --rows first)")
        # calibration and held-out rows in tables of their own (the band of each kind comes
        # from the first, every row of the second is a check it was never tuned on)
        text = "\n\n".join(
            f"{title}:\n\n" + table([r for r in ROWS if r.role == role], cache, errors)
            for title, role in (("Calibration rows (chose between mechanisms; their errors "
                                 "widen the error bands of their kind)", "calibration"),
                                ("Held-out rows (never used to choose or set anything)",
                                 "held out"))) + "\n\n" + summary(ROWS, cache)
        doc = open(DOC).read()
        block = f"{BEGIN}\n{text}\n\nRows not expressed yet:\n\n{not_expressible()}\n{END}"
        if BEGIN in doc:
            doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
        else:
            doc = doc.rstrip("\n") + "\n\n" + block + "\n"
        with open(DOC, "w") as f:
            f.write(doc)
        write_bands(calibration_errors(ROWS, cache))


if __name__ == "__main__":
    main()
