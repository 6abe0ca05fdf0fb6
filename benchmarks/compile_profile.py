"""The compiled step: tapescope's compiled profile against torch.compile itself, on this CPU.

For each model, each in a fresh subprocess (torch.compile keeps process-wide state) with an empty
inductor cache (a cold compile, as a user's first run):
  tapescope   tapescope.profile(..., compile=True): torch.compile's pipeline on fake tensors,
              kernels generated but not built; the eager profile beside it is timed apart
  torch       torch.compile(model) + two real training steps (compile, C++ kernels built with the
              system compiler, run), under torch.profiler for the allocator's peak
Peaks: eager and compiled, predicted and real (steady state, AdamW). Prints a Markdown table
(docs/compile.md keeps the last one).

    python benchmarks/compile_profile.py [zoo:gpt2:n_layer=2,... ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = [
    ("mlp4x256", None),  # 4 residual MLP blocks, d=256, batch 8x64 (the reference's example)
    ("zoo:gpt2:n_layer=2,n_embd=128,n_head=4,vocab_size=512,block_size=128", (4, 64)),
    ("zoo:llama:dim=128,n_layers=2,n_heads=4,n_kv_heads=2,ffn_dim=320,vocab_size=512", (4, 64)),
    ("torchvision:resnet18", (4, 64)),
]


def _mlp():
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d=256):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    return nn.Sequential(*[Block() for _ in range(4)])


def one(spec: str, batch_seq) -> dict:
    import tapescope
    from tapescope.validate.real import run_real_steps
    from tapescope.zoo import resolve

    if spec == "mlp4x256":
        build, inputs, kwargs, loss_fn = _mlp, (tapescope.spec((8, 64, 256)),), {}, None
    else:
        m = resolve(spec, batch=batch_seq[0], seq=batch_seq[1])
        build, inputs, kwargs, loss_fn = m.build, m.inputs, m.input_kwargs, m.loss_fn
    t = time.perf_counter()
    eager = tapescope.profile(build, *inputs, input_kwargs=kwargs, loss_fn=loss_fn)
    t_eager = time.perf_counter() - t
    t = time.perf_counter()
    p = tapescope.profile(build, *inputs, input_kwargs=kwargs, loss_fn=loss_fn, compile=True)
    t_compiled = time.perf_counter() - t - t_eager  # profile(compile=True) also runs the eager one
    t = time.perf_counter()
    real = run_real_steps(build, inputs, kwargs, loss_fn=loss_fn, compile=True)
    t_real = time.perf_counter() - t
    real_eager = run_real_steps(build, inputs, kwargs, loss_fn=loss_fn)
    return {"model": spec.split(":n_")[0].split(":dim")[0], "t_tapescope": t_compiled,
            "t_torch": t_real, "t_eager_profile": t_eager,
            "eager_pred": eager.peak_bytes, "eager_real": real_eager.peaks[2],
            "compiled_pred": p.peak_bytes, "compiled_real": real.peaks[2],
            "saved": p.compiled.saved_bytes, "recomputed": len(p.compiled.recomputed)}


def main(argv):
    if argv and argv[0] == "--one":
        spec, bs = argv[1], json.loads(argv[2])
        print(json.dumps(one(spec, bs)))
        return
    models = [(a, (4, 64)) for a in argv] or MODELS
    rows = []
    for spec, bs in models:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            out = subprocess.run([sys.executable, __file__, "--one", spec, json.dumps(bs)],
                                 env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        if not line:
            print(f"{spec}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(line[-1]))
        print(rows[-1], file=sys.stderr)
    mib = 2 ** 20
    print("| model | tapescope compiled profile | torch.compile + 2 steps (cold) | ratio "
          "| eager peak pred / real | compiled peak pred / real | compiled vs eager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['t_tapescope']:.1f} s | {r['t_torch']:.1f} s "
              f"| {r['t_tapescope'] / r['t_torch']:.2f}x "
              f"| {r['eager_pred'] / mib:.2f} / {r['eager_real'] / mib:.2f} MiB "
              f"| {r['compiled_pred'] / mib:.2f} / {r['compiled_real'] / mib:.2f} MiB "
              f"| {(r['compiled_real'] - r['eager_real']) / r['eager_real']:+.1%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
