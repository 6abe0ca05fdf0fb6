"""A user's own training step and the loss it computes, module-level so that spawned gloo workers
can import the loss (tests/test_user_step_distributed.py)."""


def square_mean(output, *inputs):
    return output.square().mean()


def step(model, batch, optimizer):
    """What a training script writes: forward, its loss, backward, step, zero_grad."""
    (x,) = batch
    loss = square_mean(model(x))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
