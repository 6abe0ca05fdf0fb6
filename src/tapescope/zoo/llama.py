"""Llama (Touvron et al. 2023): RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention.

Written for tracing: RoPE tables are computed in forward from shapes (no buffers to initialise),
attention is one SDPA call with `enable_gqa`, and `forward(tokens, targets)` returns the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "PRESETS"]


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 1536
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


PRESETS = {
    "llama": LlamaConfig(),
    "llama-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                            max_seq_len=4096),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0),
    "llama-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                             max_seq_len=4096),
    # Llama 3 70B's shape (Dubey et al. 2024, Table 3): 80 layers, model dim 8,192, FFN 28,672,
    # 64 heads, 8 key/value heads, vocabulary 128,256, RoPE base 500,000; trained at 8,192 tokens
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0),
    # Llama 3.1 405B's shape (Dubey et al. 2024, Table 3): 126 layers, model dim 16,384, FFN
    # 53,248, 128 heads, 8 key/value heads, vocabulary 128,256
    "llama3-405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128,
                               n_kv_heads=8, ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0),
}


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels of x (B, H, T, D) by position-dependent angles."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)
        self.theta = c.rope_theta

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp of them
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, self.theta), rope(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig | None = None):
        super().__init__()
        c = self.config = config or LlamaConfig()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens, targets=None):
        """The loss given targets, else the logits. A pipeline stage holds some of the modules
        (the others are None, as torchtitan splits a model): it skips those it does not hold,
        so stage 0 takes tokens and a later stage the hidden states."""
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.config.max_seq_len:
                raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len "
                                 f"{self.config.max_seq_len}")
            x = self.tok_embeddings(tokens)
        else:
            x = tokens
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is None:
            return x
        logits = self.output(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
