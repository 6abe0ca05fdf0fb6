"""Activation checkpointing, every form, against the real step.

Truth: the real CPU step under torch.profiler - the allocator's peak (first and steady step) and
the outermost aten ops in order - as in test_memory_truth.py and test_engine.py. Each form runs
torch's own code (torch.utils.checkpoint, checkpoint_sequential, selective checkpointing,
torch.distributed's checkpoint_wrapper, transformers' gradient_checkpointing_enable).

One difference between the two op sequences is expected and checked exactly: the profiler lists
an op when the dispatcher enters it, so it also lists ops that run no kernel - an op whose cached
result selective checkpointing returns while recomputing, and the op during which non-reentrant
checkpoint stops recomputing early (its autograd kernel packs the last saved tensor and raises
before the kernel). tapescope records ops that ran. `_aligned` allows exactly such ops: in the
backward, allocating nothing, and the test says how many and which, derived from the model.
"""

import functools

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

import tapescope
from tapescope.validate.real import run_real_steps

from .conftest import TINY_GPT2, tiny
from .test_engine import _normalise_fake

D, H, BATCH = 32, 64, 8


class Block(nn.Module):
    """x + b(sin(gelu(a(x)))): saved tensors of every kind (matmul inputs, pointwise inputs)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.b(torch.sin(nn.functional.gelu(self.a(x))))


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective policy: keep matmul outputs, recompute the rest."""
    if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Blocks(nn.Module):
    """An input layer, then three checkpointed blocks, checkpointed as `form` says."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.inp = nn.Linear(D, D)
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))

    def forward(self, x):
        x = self.inp(x)
        form = self.form
        if form == "sequential":  # two segments; checkpoint_sequential leaves the last one plain
            return checkpoint_sequential(self.blocks, 2, x, use_reentrant=False).sum()
        for block in self.blocks:
            if form == "reentrant":
                x = checkpoint(block, x, use_reentrant=True)
            elif form == "non_reentrant":
                x = checkpoint(block, x, use_reentrant=False)
            elif form == "no_early_stop":
                x = checkpoint(block, x, use_reentrant=False, early_stop=False)
            elif form == "no_rng_state":
                x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
            elif form == "selective":
                x = checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, _save_matmuls))
            else:
                raise ValueError(form)
        return x.sum()


# form -> ops the profiler lists that run no kernel, per checkpointed block: early stop happens
# in the second addmm (it saves its inputs last); selective checkpointing also returns the first
# addmm's cached output.
NO_KERNEL = {
    "reentrant": [],
    "non_reentrant": ["aten.addmm"],
    "no_early_stop": [],
    "no_rng_state": ["aten.addmm"],
    "selective": ["aten.addmm", "aten.addmm"],
    "sequential": ["aten.addmm"],  # per block of the checkpointed segment (one block)
}


def _real_ops(real, step):
    """(phase, name, allocated) of the step's outermost ops, as test_engine names them."""
    allocating = {e.top_op for e in real.events if e.nbytes > 0 and e.top_op is not None}
    return [(p, n.replace("::", ".").replace("aten._reshape_alias", "aten.view"), k in allocating)
            for k, (s, p, n) in enumerate(real.ops)
            if s == step and p in ("forward", "backward", "optimizer")]


def _aligned(fake, real) -> list:
    """The real ops left over when the fake sequence is matched in order; each must be a backward
    op that allocated nothing (see the module docstring). Returns their names."""
    extra, i = [], 0
    for phase, name, allocated in real:
        if i < len(fake) and fake[i] == (phase, name):
            i += 1
            continue
        assert phase == "backward" and not allocated, f"real op {phase} {name} is not in the trace"
        extra.append(name)
    assert i == len(fake), f"traced ops missing from the real step from {fake[i:i + 5]}"
    return extra


def _check(build, inputs, *, input_kwargs=None, loss_fn=None, no_kernel=(), optimizer="adamw"):
    p = tapescope.profile(build, *inputs, input_kwargs=input_kwargs, loss_fn=loss_fn,
                          optimizer=optimizer)
    real = run_real_steps(build, inputs, input_kwargs, loss_fn=loss_fn, optimizer=optimizer)
    # Peaks: exact up to the 8-12 byte scalars a CPU kernel makes for a Python number (README)
    assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
    assert abs(p.peak_bytes - real.peaks[2]) <= 12
    assert sorted(_aligned(_normalise_fake(p.ops), _real_ops(real, 2))) == sorted(no_kernel)
    assert any(op.recompute for op in p.ops)
    return p


@pytest.mark.parametrize("form", list(NO_KERNEL))
def test_checkpoint_forms_match_the_real_step(form):
    blocks = 1 if form == "sequential" else 3
    p = _check(lambda: Blocks(form), (tapescope.spec((BATCH, D)),),
               no_kernel=NO_KERNEL[form] * blocks)
    # every parameter gets its gradient (reentrant checkpoint used to starve the input layer)
    owners = {p.trace.storage_owner[s.id] for s in p.trace.storages if "gradients" in s.roles}
    assert owners == {name for name, _ in Blocks(form).named_parameters()}


def test_recomputed_flops_by_hand():
    """Reentrant checkpoint recomputes each block whole; non-reentrant stops after the last
    saved tensor (before the second matmul); selective recomputes no matmul."""
    matmul = {"aten.addmm.default", "aten.mm.default"}

    def recomputed_matmul_flops(form):
        p = tapescope.profile(lambda: Blocks(form), tapescope.spec((BATCH, D)), optimizer=None,
                              steps=1)
        ops = [op for op in p.ops if op.recompute]
        assert all(op.phase == "backward" and op.module.startswith("blocks.") for op in ops)
        return sum(op.flops for op in ops if op.name in matmul)

    per_matmul = 2 * BATCH * D * H  # a multiply-add is 2
    assert recomputed_matmul_flops("reentrant") == 3 * 2 * per_matmul
    assert recomputed_matmul_flops("non_reentrant") == 3 * per_matmul
    assert recomputed_matmul_flops("selective") == 0


def test_recomputation_in_the_graph_and_the_json():
    p = tapescope.profile(lambda: Blocks("non_reentrant"), tapescope.spec((BATCH, D)),
                          optimizer=None, steps=1)
    nodes = [n for n in p.graph.graph.nodes if n.op == "call_function"]
    assert [n.meta["recompute"] for n in nodes] == [op.recompute for op in p.ops]
    d = p.to_dict()
    assert sum(o["recompute"] for o in d["ops"]) == sum(op.recompute for op in p.ops) == 15
    assert d["recompute_flops"] == p.recompute_flops > 0
    # a recomputed op's node links to the forward op that made it: the backward ops of the
    # original nodes still map to the original forward ops
    bwd = [op for op in p.ops if op.phase == "backward" and not op.recompute and op.forward_op]
    assert all(p.ops[op.forward_op].phase == "forward" for op in bwd)


def _gpt2_checkpointed(impl):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)

    from tapescope.zoo.gpt2 import Block as GPT2Block

    m = tiny(TINY_GPT2)

    def build():
        model = m.build()
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
            check_fn=lambda mod: isinstance(mod, GPT2Block))
        return model

    return m, build


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_checkpoint_wrapper_on_gpt2(impl):
    """torch.distributed's checkpoint_wrapper, as torchtitan and FSDP users apply it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    m, build = _gpt2_checkpointed(CheckpointImpl[impl])
    # non-reentrant stops early inside each block's MLP output projection
    _check(build, m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
           no_kernel=["aten.addmm"] * 2 if impl == "NO_REENTRANT" else [])


def test_transformers_gradient_checkpointing_enable():
    """Hugging Face's gradient_checkpointing_enable() (non-reentrant checkpoint per layer)."""
    import warnings

    m = tiny("hf:BertConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=2,"
             "intermediate_size=128,vocab_size=100", batch=2, seq=16)

    def build():
        model = m.build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable()
        return model

    _check(build, m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)


@pytest.mark.parametrize("device", ["cuda", "meta"])
@pytest.mark.parametrize("form", ["reentrant", "non_reentrant", "selective", "sequential"])
def test_checkpoint_traces_on_cuda_and_meta(device, form):
    """No GPU needed: the same ops are recomputed as on CPU."""
    if device == "cuda" and not torch.backends.cuda.is_built():
        pytest.skip("needs a CUDA build of torch")
    kw = dict(optimizer=None, steps=1)
    p = tapescope.profile(lambda: Blocks(form), tapescope.spec((BATCH, D)), device=device, **kw)
    cpu = tapescope.profile(lambda: Blocks(form), tapescope.spec((BATCH, D)), **kw)
    assert [op.name for op in p.ops if op.recompute] == [op.name for op in cpu.ops if op.recompute]
    assert p.recompute_flops == cpu.recompute_flops > 0


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return h, self.b(h).tanh()


class _Nested(nn.Module):
    """A checkpoint inside a checkpointed function (torch's nested checkpoint rules)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def inner(self, x):
        return torch.relu(self.b(x))

    def forward(self, x):
        return checkpoint(self.inner, torch.sin(self.a(x)), use_reentrant=False).cos()


class _Structured(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form, self.inp, self.two, self.nested = form, nn.Linear(D, D), _TwoOutputs(), _Nested()

    def forward(self, x):
        x = self.inp(x)
        if self.form == "nested":
            return checkpoint(self.nested, x, use_reentrant=False).sum()
        h, y = checkpoint(self.two, x, use_reentrant=self.form == "two_outputs_reentrant")
        return (h * y).sum()


@pytest.mark.parametrize("form,no_kernel", [
    ("nested", ["aten.cos"]),            # the outer recomputation stops inside cos
    ("two_outputs_reentrant", []),       # torch.autograd.backward from two roots: a GraphRoot
    ("two_outputs", []),                 # the last saved tensor is tanh's output: no stop inside
])
def test_nested_and_multi_output_checkpoints(form, no_kernel):
    _check(lambda: _Structured(form), (tapescope.spec((BATCH, D)),), no_kernel=no_kernel)


TINY_LLAMA = ("hf:LlamaConfig:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
              "num_key_value_heads=2,intermediate_size=128,vocab_size=256,use_cache=false")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_transformers_decoder_takes_the_eager_mask_path(checkpointing):
    """With use_cache=False (what gradient checkpointing forces) transformers asks whether
    position_ids pack several sequences, unless the tensor is a FakeTensor; the eager step asks,
    finds one sequence and gives SDPA no mask. The capture's tensors answer as the eager step's
    (fidelity/libraries.py): op sequence and peaks equal the real step's (both were 1.4-2.4%
    high before)."""
    import warnings

    import transformers.masking_utils as mu
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = tiny(TINY_LLAMA, batch=2, seq=32)

    def build():
        model = m.build()
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.gradient_checkpointing_enable()
        return model

    original = mu.is_tracing
    if checkpointing:  # non-reentrant stops early inside each layer's last projection (above)
        _check(build, m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
               no_kernel=["aten.mm"] * 2)
    else:
        p = tapescope.profile(build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn)
        real = run_real_steps(build, m.inputs, m.input_kwargs, loss_fn=m.loss_fn)
        assert abs(p.first_step_peak_bytes - real.peaks[1]) <= 12
        assert abs(p.peak_bytes - real.peaks[2]) <= 12
        assert _aligned(_normalise_fake(p.ops), _real_ops(real, 2)) == []
    # the library's own answer is back, and it never changed for other fake tensors
    assert mu.is_tracing is original
    with FakeTensorMode() as mode:
        assert mu.is_tracing(mode.from_tensor(torch.ones(2)))


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant", "selective", "sequential"])
def test_checkpoint_recomputes_under_cuda_autocast(form):
    """--amp bf16 on CUDA without a GPU: torch.utils.checkpoint recomputes under the forward's
    autocast state (it opens `torch.amp.autocast("cuda", **saved_state)`), which torch switches
    off where it finds no GPU. Truth: torch's own rule - a recomputation reruns forward ops with
    the forward's metadata (non-reentrant checkpoint raises CheckpointError otherwise) - and
    autocast's op list by hand: under autocast("cuda", bf16) `linear` runs as a bf16 addmm."""
    if not torch.backends.cuda.is_built():
        pytest.skip("needs a CUDA build of torch")
    p = tapescope.profile(lambda: Blocks(form), tapescope.spec((BATCH, D)), device="cuda",
                          gpu="h100", amp="bf16", optimizer=None, steps=1)

    def sig(op):
        return op.module, op.name, tuple(t.dtype for t in op.outputs)

    recomputed = [sig(op) for op in p.ops if op.recompute]
    forward = [sig(op) for op in p.ops if op.phase == "forward"]
    assert recomputed
    # each recomputed op is a forward op of the same module with the same output dtypes
    from collections import Counter

    assert not Counter(recomputed) - Counter(forward)
    addmms = [dt for _, name, dt in recomputed if name == "aten.addmm.default"]
    if form == "selective":  # the matmuls are saved, their bf16 neighbours recomputed
        assert not addmms
        gelus = [dt for _, name, dt in recomputed if name == "aten.gelu.default"]
        assert gelus and set(gelus) == {(torch.bfloat16,)}
    else:
        assert addmms and set(addmms) == {(torch.bfloat16,)}
