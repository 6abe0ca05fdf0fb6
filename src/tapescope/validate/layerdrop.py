"""A real step in which LayerDrop dropped no layer: the truth for tapescope's random-draw
assumption (capture/data_values.py takes a branch on a small random draw at its likelier side:
with a drop probability below 1/2, every layer runs).

The real step is not changed: the seed that run_real_steps gives torch is chosen so that its draws
keep every layer. Each candidate seed runs the real steps with forward pre-hooks counting the calls
of the layers (hooks that allocate nothing); the first run in which every layer ran in every step
is the truth, returned with its seed.
"""

from __future__ import annotations

from .real import RealStep, run_real_steps

__all__ = ["steps_keeping_every_layer"]


def steps_keeping_every_layer(build, inputs, input_kwargs=None, *, layers, seeds=range(32),
                              steps: int = 2, accumulate: int = 1,
                              **options) -> tuple[int, RealStep]:
    """(seed, RealStep) of the first seed whose real steps call every module of
    `layers(model)` once per forward. `options` go to run_real_steps."""
    calls: list = []
    count: list = []   # how many layers the model has

    def counted():
        model = build()
        count[:] = [len(layers(model))]
        for layer in layers(model):
            layer.register_forward_pre_hook(lambda mod, args: calls.append(1))
        return model

    for seed in seeds:
        calls.clear()
        real = run_real_steps(counted, inputs, input_kwargs, seed=seed, steps=steps,
                              accumulate=accumulate, **options)
        if len(calls) == count[0] * steps * accumulate:
            return seed, real
    raise RuntimeError(f"every seed of {seeds} dropped a layer in some step")
