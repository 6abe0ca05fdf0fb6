"""A byte-exact digest of what a profile records and reports, to prove a speed change changed no
result: every OpRecord (op, phase, step, arguments with their TensorRefs, outputs, module, seq_nr,
node, source line, recompute), every storage and alloc/free event, segments, the peaks, the
categories at the peak, FLOPs, and the op table (FLOPs, bytes, module, forward op per op).

    python benchmarks/trace_digest.py OUT.txt [--models zoo:gpt2:8,torchvision:vit_b_16:32,zoo:llama:2]
        [--cases views,conv,symbolic,fsdp,cuda]
    cmp BEFORE.txt AFTER.txt          # identical files: identical results

`--cases` adds profiles the models above do not exercise: `views` (a small net of views, slices,
transposes and in-place ops), `conv` (torchvision resnet18, batch 8), `symbolic` (a small GPT-2
with batch and seq symbolic: its trace, and its formulas evaluated at three sizes), `fsdp`
(FSDP2 over 4 fake ranks of a residual MLP with an uneven head: every traced rank's trace) and
`cuda` (a 2-layer GPT-2 and that FSDP2 case traced for CUDA: the foreach optimizer step; needs
torch's CUDA build, no GPU); `tp` (a small Llama as `tapescope search` profiles its candidates,
FSDP 4 x TP 2 and HSDP 2 x FSDP 2 x TP 2 on 8 fake H100s, one after another in one search pool:
the later candidates of a layout reuse the earlier ones' DTensor sharding decisions; every traced
rank's trace).

Each model is profiled twice in the same process (the second profile runs on warm caches, as a
sweep would), and both are written. Autograd's sequence numbers are written relative to the
capture's first node (they count from process start).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re

import torch.nn as nn

import tapescope
from tapescope.capture.model import build_on_meta
from tapescope.zoo import resolve


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
# source lines in tapescope's own files (the zoo's models) name the tree they ran from: two trees
# compared must print the same
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(tapescope.__file__))) + os.sep


def digest(p) -> list[str]:
    return _summary(p) + trace_lines(p)


def _summary(p) -> list[str]:
    return [f"peak {p.peak_bytes} first {p.first_step_peak_bytes} steps {p.steps}",
             f"at_peak {sorted(p.memory.at_peak.items())} peak_op {p.memory.peak_op}",
             f"flops {sorted(p.flops.items())} uncounted {sorted(p.uncounted_ops.items())}",
             f"modules {[(m.module, m.peak_bytes, m.saved_bytes) for m in p.memory.modules]}",
             f"live_groups {[(g.count, g.first.nbytes, g.first.category) for g in p.memory.live_groups]}",
             f"timeline {list(p.memory.timeline)}",
             f"by_category {sorted((k, list(v)) for k, v in p.memory.timeline_by_category.items())}"]


def trace_lines(p) -> list[str]:
    t = p.trace
    base = t.seq_base or 0
    lines = []
    for r in t.ops:
        seq = r.seq_nr if r.seq_nr is None or r.seq_nr >= 2**63 else r.seq_nr - base
        # a process group's ScriptObject prints its address, which differs between runs
        lines.append(_ADDRESS.sub(" at 0x", f"op {r.index} {r.name} {r.phase} {r.step} {r.args!r} "
                                  f"{r.kwargs!r} {r.outputs!r} {r.module} {seq} {r.owns_node} "
                                  f"{r.grad_fn} {r.frame} {r.recompute}").replace(_PACKAGE, "SRC/"))
    for s in t.storages:
        lines.append(f"storage {s!r}")
    lines.append(f"events {t.events!r}")
    lines.append(f"segments {[repr(s) for s in t.segments]!r}")
    lines.append(f"saved {sorted(t.saved_values)!r} owners {sorted(t.storage_owner.items())!r}")
    for op in p.ops:
        lines.append(f"row {op.index} {op.name} {op.phase} {op.module} {op.seq_nr} {op.forward_op} "
                     f"{op.autograd_node} {op.flops} {op.bytes_read} {op.bytes_written} {op.saved} "
                     f"{op.source}".replace(_PACKAGE, "SRC/"))
    return lines


class _Views(nn.Module):
    """Views, slices, transposes, a chunk and in-place ops on activations and views of them."""

    def __init__(self, d=64):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        u, v = h.narrow(-1, 0, 64), h[..., 64:]
        u = u.relu_()  # in place on a view of h
        a, _ = h.detach().chunk(2, dim=-1)  # views of one op returning several
        w = v.transpose(0, 1).contiguous().transpose(0, 1)
        w[:, 0] += 1.0  # in place through a slice
        y = self.b(u * w).view(x.shape[0], -1)
        y = y.unsqueeze(0).squeeze(0).reshape_as(x)
        return ((y * 3).add_(2) + x.t().t() + a.expand_as(x)).sum()


def _extra_cases(names):
    """(label, zero-argument function returning the lines) for each named case."""
    cases = {
        "views": lambda: digest(tapescope.profile(_Views, tapescope.spec((8, 64)),
                                                  loss_fn=lambda out, *_: out)),
        "conv": lambda: _model_lines("torchvision:resnet18", 8),
        "symbolic": _symbolic_lines,
        "fsdp": _fsdp_lines,
        "cuda": _cuda_lines,
        "tp": _tp_lines,
    }
    return [(n, cases[n]) for n in names]


def _model_lines(spec, batch):
    m = resolve(spec, batch=batch, seq=1024 if spec.startswith("zoo:") else None)
    return digest(tapescope.profile(build_on_meta(m.build), *m.inputs,
                                    input_kwargs=m.input_kwargs, loss_fn=m.loss_fn))


def _symbolic_lines():
    m = resolve("zoo:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=128,block_size=64",
                batch=4, seq=16)
    p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          symbolic=("batch", "seq"))
    lines = [f"specialized {p.symbolic.specialized}"]
    for batch, seq in [(4, 16), (3, 17), (9, 40)]:
        e = p.at(batch=batch, seq=seq)
        lines.append(f"at {batch} {seq}: {e.peak_bytes} {e.first_step_peak_bytes} "
                     f"{sorted(e.flops.items())} {sorted(e.at_peak.items())}")
    return lines + trace_lines(p)


def _fsdp_lines(device="cpu", gpu=None):
    from torch.distributed.fsdp import fully_shard

    def build():
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                            nn.Linear(64, 10))
        return net

    def parallelize(model, mesh):
        for m in model[:3]:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    p = tapescope.profile(build, tapescope.spec((4, 16, 64)), mesh={"dp": 4},
                          parallelize=parallelize, device=device, gpu=gpu)
    lines = [f"peak {p.peak_bytes} classes {p.distributed.classes.members}"]
    for i, r in enumerate(p.ranks):
        lines.append(f"rank {i} traced_as {r.traced_as} peak {r.peak_bytes} "
                     f"first {r.first_step_peak_bytes} at_peak {sorted(r.at_peak.items())}")
    for i, traced in sorted(p.distributed.profiles.items()):
        lines.append(f"== traced rank {i}")
        lines.extend(digest(traced))
    return lines


def _cuda_lines():
    """Steps traced for CUDA without a GPU: a foreach AdamW (the optimizer's default there, not
    on CPU), FSDP2 ranks included."""
    m = resolve("zoo:gpt2:n_layer=2", batch=4, seq=128)
    p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          device="cuda", gpu="h100")
    return digest(p) + _fsdp_lines("cuda", "h100")


def _tp_lines():
    """TP and HSDP x TP candidates profiled one after another in one search pool (what a
    search's worker does: distributed/fidelity.py, point 6)."""
    from tapescope.distributed.presets import Layout
    from tapescope.layout_search import profile_candidate
    from tapescope.layout_search.evaluate import Source
    from tapescope.layout_search.runner import InProcess
    from tapescope.layout_search.space import Candidate

    source = Source("zoo:llama:dim=256,n_layers=2,n_heads=8,n_kv_heads=2,ffn_dim=512,"
                    "vocab_size=1024", seq=128, gpu="h100")
    pool = InProcess()
    lines = []
    for layout in (Layout(fsdp=4, tp=2), Layout(dp_replicate=2, fsdp=2, tp=2)):
        for mb, ac in ((1, "full"), (1, "none"), (2, "full"), (1, "selective")):
            c = Candidate(layout, micro_batch=mb, checkpointing=ac)
            p = pool.submit(profile_candidate, source, c).result()
            lines.append(f"== {c.label()}: peak {p.peak_bytes} step {p.time.seconds!r} "
                         f"classes {p.distributed.classes.members}")
            for i, traced in sorted(p.distributed.profiles.items()):
                lines.append(f"== traced rank {i}")
                lines.extend(digest(traced))
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="zoo:gpt2:8,torchvision:vit_b_16:32,zoo:llama:2")
    ap.add_argument("--cases", default="", help="extra cases: views,conv,symbolic,fsdp,cuda,tp")
    args = ap.parse_args()
    out = []
    for name, lines_of in _extra_cases([n for n in args.cases.split(",") if n]):
        for run in (1, 2):
            lines = lines_of()
            out.append(f"== {name} run {run}: {len(lines)} lines")
            out.extend(lines)
            print(name, run, hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16])
    for item in filter(None, args.models.split(",")):
        spec, batch = item.rsplit(":", 1)
        m = resolve(spec, batch=int(batch), seq=1024 if spec.startswith("zoo:") else None)
        meta_model = build_on_meta(m.build)
        for run in (1, 2):
            p = tapescope.profile(meta_model, *m.inputs, input_kwargs=m.input_kwargs,
                                  loss_fn=m.loss_fn)
            lines = digest(p)
            out.append(f"== {spec} batch {batch} run {run}: {len(lines)} lines")
            out.extend(lines)
            print(spec, run, hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16])
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
