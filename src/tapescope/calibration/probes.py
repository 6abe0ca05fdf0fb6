"""What `tapescope calibrate` runs: one Probe per measurement, each a kernel of a known shape.

A Probe is data (its kind and the shape it records into the calibration file) plus `build(device)`,
which allocates its tensors and returns the function that runs the work once. The runner
(calibration/measure.py) times that function; nothing here times anything, so the same probes run
on a GPU and, in tests, on the CPU with the timer injected.

The shapes come from a traced step (`probes_for_kernels`: every distinct GEMM and fused-attention
shape the step launches, the costliest first) or from DEFAULT_* below (transformer-sized GEMMs,
attention at 1k-8k tokens, bandwidth from 64 KiB to 1 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..analysis.calibrated_cost import DTYPE_NAMES
from ..analysis.flops import attention_pairs

__all__ = ["Probe", "gemm_probe", "attention_probe", "bandwidth_probe", "launch_probes",
           "default_probes", "probes_for_kernels"]

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items() if name != "fp8"}


@dataclass(frozen=True)
class Probe:
    kind: str                        # "gemm", "attention", "bandwidth", "kernel_overhead", "host_op"
    shape: dict                      # the calibration point's fields, all but `seconds`
    build: Callable = field(repr=False, compare=False)   # build(device) -> fn() that runs it once
    # time its calls as eager code issues them, one after another: the host's time per op (the
    # host_op probe), or a probe a CUDA graph cannot capture (an autograd backward: the engine
    # runs it on the forward's stream, not the capturing one); else the GPU's time alone
    # (calibration/measure.py replays the calls from a CUDA graph)
    eager: bool = False

    @property
    def label(self) -> str:
        return f"{self.kind} " + " ".join(f"{k}={v}" for k, v in self.shape.items())


def gemm_probe(dtype: str, batch: int, m: int, n: int, k: int) -> Probe:
    """(batch x) m x k @ k x n in `dtype`, as torch.matmul runs it (cuBLAS on a GPU)."""
    def build(device):
        t = _DTYPES[dtype]
        lead = (batch,) if batch > 1 else ()
        a = torch.randn(*lead, m, k, device=device, dtype=t)
        b = torch.randn(*lead, k, n, device=device, dtype=t)
        c = torch.empty(*lead, m, n, device=device, dtype=t)
        return lambda: torch.matmul(a, b, out=c)
    return Probe("gemm", dict(dtype=dtype, batch=batch, m=m, n=n, k=k), build)


_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION"}


def attention_flops(direction: str, batch_heads: int, seq_q: int, seq_k: int, head_dim: int,
                    causal: bool) -> int:
    """FLOPs as analysis/flops.py counts a fused attention kernel's: the unmasked pairs times
    (d + d) multiply-adds forward, (3d + 2d) backward."""
    pairs = attention_pairs(seq_q, seq_k, "top_left" if causal else None)
    macs = 5 * head_dim if direction == "backward" else 2 * head_dim
    return 2 * batch_heads * pairs * macs


def attention_probe(backend: str, direction: str, dtype: str, batch_heads: int, seq_q: int,
                    seq_k: int, head_dim: int, causal: bool) -> Probe:
    """One fused attention kernel of `backend`, forward or backward (the backward alone: the
    forward's output is kept and torch.autograd.grad runs only its backward node), as
    F.scaled_dot_product_attention runs it under sdpa_kernel(backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def build(device):
        t = _DTYPES[dtype]
        q = torch.randn(1, batch_heads, seq_q, head_dim, device=device, dtype=t, requires_grad=True)
        k, v = (torch.randn(1, batch_heads, seq_k, head_dim, device=device, dtype=t,
                            requires_grad=True) for _ in range(2))
        chosen = getattr(SDPBackend, _BACKENDS[backend])

        def forward():
            with sdpa_kernel([chosen]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if direction == "forward":
            return forward
        out = forward()
        grad = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    shape = dict(backend=backend, direction=direction, dtype=dtype, batch_heads=batch_heads,
                 seq_q=seq_q, seq_k=seq_k, head_dim=head_dim, causal=causal,
                 flops=attention_flops(direction, batch_heads, seq_q, seq_k, head_dim, causal))
    return Probe("attention", shape, build, eager=direction == "backward")


def bandwidth_probe(kind: str, nbytes: int) -> Probe:
    """A copy (dst.copy_(src): half the bytes read, half written) or an elementwise add (out = a
    + b: two thirds read, one third written) moving about `nbytes` of float32."""
    parts = 2 if kind == "copy" else 3
    numel = max(1, nbytes // (4 * parts))

    def build(device):
        ts = [torch.ones(numel, device=device) for _ in range(parts)]
        if kind == "copy":
            return lambda: ts[1].copy_(ts[0])
        return lambda: torch.add(ts[0], ts[1], out=ts[2])
    return Probe("bandwidth", dict(kind=kind, bytes=numel * 4 * parts), build)


def launch_probes() -> list[Probe]:
    """The GPU's time per tiny kernel (a one-element add, its calls replayed back to back from a
    CUDA graph: no host between them) and the host's time per tiny eager op (the same add issued
    from Python one by one: the GPU finishes each before the next is launched, so the timer sees
    the host)."""
    def tiny(device):
        x = torch.zeros(1, device=device)
        return lambda: x.add_(1)
    return [Probe("kernel_overhead", {}, tiny), Probe("host_op", {}, tiny, eager=True)]


# transformer-sized GEMMs: tokens x hidden by hidden x {hidden, 3 hidden, MLP}, and squares
DEFAULT_GEMMS = tuple(("bf16", 1, m, n, k) for m, n, k in (
    (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
    (8192, 4096, 4096), (8192, 12288, 4096), (8192, 14336, 4096), (8192, 4096, 14336),
    (4096, 4096, 8192), (4096, 14336, 8192))) + tuple(
    ("fp32", 1, s, s, s) for s in (1024, 2048, 4096))
DEFAULT_ATTENTION = tuple((seq, head_dim) for seq in (1024, 2048, 4096, 8192)
                          for head_dim in (64, 128))
DEFAULT_BYTES = tuple(1 << p for p in range(16, 31, 2))    # 64 KiB .. 1 GiB


def default_probes(backends=("flash", "efficient", "cudnn")) -> list[Probe]:
    """Launch, bandwidth, the DEFAULT_GEMMS and causal bf16 attention at DEFAULT_ATTENTION, with
    about 32k tokens x heads of work per kernel (batch x heads = 32 x 4096 / seq)."""
    probes = launch_probes()
    probes += [bandwidth_probe(kind, b) for kind in ("copy", "elementwise") for b in DEFAULT_BYTES]
    probes += [gemm_probe(*g) for g in DEFAULT_GEMMS]
    probes += [attention_probe(backend, direction, "bf16", max(1, 32 * 4096 // seq), seq, seq,
                               head_dim, True)
               for backend in backends for direction in ("forward", "backward")
               for seq, head_dim in DEFAULT_ATTENTION]
    return probes


def probes_for_kernels(kernels, limit: int = 96) -> list[Probe]:
    """Launch and bandwidth probes, then one probe per distinct GEMM and fused-attention shape
    among `kernels` (analysis.kernel_cost.Kernel of a traced step), the ones with the most FLOPs
    in the step first, at most `limit` of them (the rest are priced by their nearest)."""
    work: dict = {}
    for k in kernels:
        dtype = DTYPE_NAMES.get(k.dtype)
        if dtype is None or dtype == "fp8" or not k.flops:   # fp8 GEMMs need scales: not timed
            continue
        if k.op_class == "matmul" and k.gemm is not None:
            batch, m, n = k.gemm
            key = ("gemm", dtype, batch, m, n, max(1, k.flops // (2 * batch * m * n)))
        elif k.op_class == "attention" and k.attention is not None:
            backend = ("cudnn" if "cudnn" in k.name else "efficient" if "efficient" in k.name
                       else "flash" if "flash" in k.name else None)
            if backend is None:
                continue
            key = ("attention", backend, "backward" if "backward" in k.name else "forward",
                   dtype, *k.attention)
        else:
            continue
        work[key] = work.get(key, 0) + k.flops
    probes = launch_probes()
    probes += [bandwidth_probe(kind, b) for kind in ("copy", "elementwise") for b in DEFAULT_BYTES]
    for key in sorted(work, key=work.get, reverse=True)[:limit]:
        probes.append(gemm_probe(*key[1:]) if key[0] == "gemm" else attention_probe(*key[1:]))
    return probes
