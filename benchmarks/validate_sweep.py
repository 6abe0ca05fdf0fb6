"""More models, small shapes, on CPU: tapescope's peaks and op sequence against the real step.

Each model's step runs for real under torch.profiler (the allocator's running total, the
outermost dispatched ops) and is profiled by tapescope; prints a Markdown table
(docs/validation.md keeps the last one).

    python benchmarks/validate_sweep.py [NAME-SUBSTRING ...]
"""

from __future__ import annotations

import sys

from tapescope.validate.harness import validate
from tapescope.zoo import resolve

SMALL_LM = "num_hidden_layers=2,hidden_size=128,intermediate_size=256,num_attention_heads=4"
MODELS = [  # spec, batch, seq (image size for vision models)
    ("torchvision:swin_t", 2, 64), ("torchvision:efficientnet_b0", 2, 64),
    ("torchvision:maxvit_t", 1, 224), ("torchvision:densenet121", 2, 64),
    ("torchvision:inception_v3", 2, 96), ("torchvision:regnet_y_400mf", 2, 64),
    ("timm:deit_tiny_patch16_224", 2, None), ("timm:coat_tiny", 1, None),
    ("timm:levit_128", 2, None),
    ("hf:T5Config:num_layers=2,num_decoder_layers=2,d_model=128,d_kv=32,d_ff=256,num_heads=4,"
     "vocab_size=1000", 2, 32),
    ("hf:ViTConfig:num_hidden_layers=2,hidden_size=128,num_attention_heads=4,"
     "intermediate_size=256,image_size=64,patch_size=8", 2, None),
    (f"hf:LlamaConfig:{SMALL_LM},num_key_value_heads=2,vocab_size=1000", 2, 32),
    (f"hf:MistralConfig:{SMALL_LM},num_key_value_heads=2,vocab_size=1000", 2, 32),
    (f"hf:Qwen2Config:{SMALL_LM},num_key_value_heads=2,vocab_size=1000", 2, 32),
    (f"hf:GPTNeoXConfig:{SMALL_LM},vocab_size=1000", 2, 32),
    ("hf:DistilBertConfig:n_layers=2,dim=128,hidden_dim=256,n_heads=4,vocab_size=1000", 2, 32),
]


def main():
    only = sys.argv[1:]
    print("| model | batch x seq | first-step peak error | steady peak error | ops |")
    print("|---|---|---|---|---|")
    for spec, batch, seq in MODELS:
        if only and not any(o in spec for o in only):
            continue
        m = resolve(spec, batch=batch, seq=seq)
        v = validate(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                     device="cpu", name=m.name, steps=1, warmup=0)
        err = {q: (p - r) / r for q, p, r in v.rows if p is not None}
        name = spec.split(":")[0] + ":" + spec.split(":")[1]
        print(f"| {name} | {batch} x {seq or '-'} | {err['first-step peak bytes']:+.3%} | "
              f"{err['steady peak bytes']:+.3%} | "
              f"{'identical' if v.ops_match else 'differs: ' + ' '.join(v.ops_diff[:3])} |",
              flush=True)


if __name__ == "__main__":
    main()
