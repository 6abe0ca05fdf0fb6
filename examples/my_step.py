"""Your own training step, as your training script writes it: clipping, a scheduler, an EMA.

    tapescope profile examples/my_model.py:build --input 8,3,224,224 --input 8:int64 \
        --step examples/my_step.py:train_step --setup examples/my_step.py:setup

`setup(model)` runs once, before the first step, and returns what the step keeps from step to
step (here an optimizer, its scheduler and an exponential moving average of the weights);
`train_step(model, batch, state)` is one step, run as written: every op it issues is traced
(API: `tapescope.profile(build, images, labels, step=train_step, setup=setup)`).
"""

import torch
import torch.nn.functional as F


def setup(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    ema = [p.detach().clone() for p in model.parameters()]
    return {"optimizer": optimizer, "scheduler": scheduler, "ema": ema}


def train_step(model, batch, state):
    images, labels = batch
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["scheduler"].step()
    with torch.no_grad():
        torch._foreach_lerp_(state["ema"], list(model.parameters()), 0.001)
    return loss.detach()
