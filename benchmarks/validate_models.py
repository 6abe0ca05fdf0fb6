"""Predicted vs measured over a set of models, on the device this machine has.

    python benchmarks/validate_models.py                 # CPU: peaks against the allocator
    python benchmarks/validate_models.py --device cuda   # a GPU: torch.cuda's counters and step time

Prints a Markdown table (the committed ones are in docs/validation.md) with the machine, the torch
version and the date.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch

from tapescope.devices.cpu import cpu_target
from tapescope.validate.harness import validate
from tapescope.zoo import resolve

CPU_MODELS = [  # (spec, batch, seq, dtype, amp)
    ("zoo:gpt2", 2, 256, None, None),
    ("zoo:llama", 2, 256, None, None),
    ("zoo:llama", 2, 256, None, "bf16"),
    ("torchvision:resnet18", 8, 112, None, None),
    ("torchvision:mobilenet_v2", 8, 112, None, None),
    ("torchvision:convnext_tiny", 4, 112, None, None),
    ("torchvision:vit_b_16", 2, 224, None, None),
    ("timm:resnet18", 8, 112, None, None),
    ("hf:BertConfig:num_hidden_layers=4", 4, 128, None, None),
    ("hf:GPT2Config:n_layer=4", 4, 128, None, None),
]
CUDA_MODELS = [
    ("zoo:gpt2", 8, 1024, None, "bf16"), ("zoo:gpt2", 8, 1024, None, None),
    ("zoo:llama", 8, 2048, None, "bf16"), ("zoo:llama", 4, 2048, "bf16", None),
    ("torchvision:resnet50", 64, None, None, "bf16"), ("torchvision:vit_b_16", 64, None, None, "bf16"),
    ("torchvision:convnext_tiny", 64, None, None, None),
    ("timm:vit_small_patch16_224", 64, None, None, "bf16"),
    ("hf:BertConfig", 32, 512, None, "bf16"), ("hf:LlamaConfig:num_hidden_layers=8", 4, 2048, None, "bf16"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    models = CUDA_MODELS if args.device == "cuda" else CPU_MODELS
    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {cpu_target().describe()})"
    print(f"{where}, torch {torch.__version__}, {datetime.date.today()}\n")
    print("| model | batch x seq | precision | quantity | predicted | measured | error | ops |")
    print("|---|---|---|---|---|---|---|---|")
    for spec, batch, seq, dtype, amp in models:
        m = resolve(spec, batch=batch, seq=seq)
        v = validate(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                     device=args.device, dtype=dtype, amp=amp, name=m.name, steps=3, warmup=1)
        precision = dtype or ("autocast " + amp if amp else "fp32")
        shape = f"{batch} x {seq}" if seq else str(batch)
        for q, pred, meas in v.rows:
            if pred is None:
                continue
            unit = (lambda x: f"{x * 1e3:.1f} ms") if q.endswith(" s") else (lambda x: f"{x:,}")
            err = f"{(pred - meas) / meas:+.3%}" if meas else "-"
            ops = "identical" if v.ops_match else f"differs ({len(v.ops_diff)} lines)"
            print(f"| {spec} | {shape} | {precision} | {q} | {unit(pred)} | {unit(meas)} | {err} | {ops} |",
                  flush=True)


if __name__ == "__main__":
    main()
