"""A byte-exact digest of what a profile records and reports, to prove a speed change changed no
result: every OpRecord (op, phase, step, arguments with their TensorRefs, outputs, module, seq_nr,
node, source line, recompute), every storage and alloc/free event, segments, the peaks, the
categories at the peak, FLOPs, and the op table (FLOPs, bytes, module, forward op per op).

    python benchmarks/trace_digest.py OUT.txt [--models zoo:gpt2:8,torchvision:vit_b_16:32,zoo:llama:2]
    cmp BEFORE.txt AFTER.txt          # identical files: identical results

Each model is profiled twice in the same process (the second profile runs on warm caches, as a
sweep would), and both are written. Autograd's sequence numbers are written relative to the
capture's first node (they count from process start).
"""

from __future__ import annotations

import argparse
import hashlib

import tapescope
from tapescope.capture.model import build_on_meta
from tapescope.zoo import resolve


def digest(p) -> list[str]:
    t = p.trace
    base = t.seq_base or 0
    lines = [f"peak {p.peak_bytes} first {p.first_step_peak_bytes} steps {p.steps}",
             f"at_peak {sorted(p.memory.at_peak.items())} peak_op {p.memory.peak_op}",
             f"flops {sorted(p.flops.items())} uncounted {sorted(p.uncounted_ops.items())}",
             f"modules {[(m.module, m.peak_bytes, m.saved_bytes) for m in p.memory.modules]}",
             f"live_groups {[(g.count, g.first.nbytes, g.first.category) for g in p.memory.live_groups]}",
             f"timeline {list(p.memory.timeline)}",
             f"by_category {sorted((k, list(v)) for k, v in p.memory.timeline_by_category.items())}"]
    for r in t.ops:
        seq = r.seq_nr if r.seq_nr is None or r.seq_nr >= 2**63 else r.seq_nr - base
        lines.append(f"op {r.index} {r.name} {r.phase} {r.step} {r.args!r} {r.kwargs!r} "
                     f"{r.outputs!r} {r.module} {seq} {r.owns_node} {r.grad_fn} {r.frame} "
                     f"{r.recompute}")
    for s in t.storages:
        lines.append(f"storage {s!r}")
    lines.append(f"events {t.events!r}")
    lines.append(f"segments {[repr(s) for s in t.segments]!r}")
    lines.append(f"saved {sorted(t.saved_values)!r} owners {sorted(t.storage_owner.items())!r}")
    for op in p.ops:
        lines.append(f"row {op.index} {op.name} {op.phase} {op.module} {op.seq_nr} {op.forward_op} "
                     f"{op.autograd_node} {op.flops} {op.bytes_read} {op.bytes_written} {op.saved} "
                     f"{op.source}")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="zoo:gpt2:8,torchvision:vit_b_16:32,zoo:llama:2")
    args = ap.parse_args()
    out = []
    for item in args.models.split(","):
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
