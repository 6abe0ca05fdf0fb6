"""Context parallelism as torch writes it: the user's step wraps forward and backward in
`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`,
which shards the sequence over the "cp" mesh dimension and runs ring attention in place of SDPA
(`step=` with `mesh=`), GPU-less for an H100 (CP takes CUDA's attention ops only).

Truth: the collectives of torch's ring attention, derived by hand from its code
(torch/distributed/tensor/experimental/_context_parallel/_attention.py): forward, the default
all-gather rotater gathers each rank's `cat(key, value)` once; backward gathers it again, and
passes the key/value gradients (fp32: `_cp_options.convert_to_f32`) around the ring with an
all-to-all (`permute_tensor`) at each of its `cp` steps. No real run checks the memory: CP's
attention ops are CUDA's.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tapescope

HEADS, HEAD_DIM, SEQ, BATCH, CP = 4, 64, 512, 2, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HEADS * HEAD_DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * HEAD_DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


def parallelize(model, mesh):
    model.cp_mesh = mesh  # what the step's context_parallel shards over
    return model


def step(model, batch, optimizer):
    from torch.distributed.tensor.experimental import context_parallel

    (x,) = batch
    with context_parallel(model.cp_mesh, buffers=[x], buffer_seq_dims=[1]):
        loss = model(x).float().square().mean()
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_context_parallel_ring_attention_collectives():
    """The hand count of the module docstring, at the default options (all-gather, causal)."""
    p = tapescope.profile(Attention, tapescope.spec((BATCH, SEQ, HEADS * HEAD_DIM)),
                          mesh={"cp": CP}, parallelize=parallelize, step=step, gpu="h100",
                          dtype=torch.bfloat16)
    local = BATCH * HEADS * (SEQ // CP) * HEAD_DIM  # one rank's keys (or values)
    kv_gathered = CP * 2 * local * 2                # cat(k, v) of every rank, bf16
    dkv = 2 * local * 4                             # cat(dk, dv) of this rank, fp32
    seen = [(c.kind, c.nbytes, c.phase) for c in p.collectives]
    assert [s for s in seen if s[2] == "forward"] == [("all_gather", kv_gathered, "forward")]
    assert sorted(s for s in seen if s[2] == "backward") == sorted(
        [("all_gather", kv_gathered, "backward")] + [("all_to_all", dkv, "backward")] * CP)


def test_torchtitan_llama3_context_parallel_on_cuda_without_a_gpu(monkeypatch):
    """torchtitan 0.3.0's own CP wiring: ParallelDims with context_parallel_degree 2 and FSDP 2
    (world 4; FSDP shards over fsdp x cp, as torchtitan does), its parallelize_llama wrapping each
    SDPA with `apply_cp_to_forward` (DTensor inputs sharded on the sequence, torch's CP
    dispatcher), spmd_backend "partial_dtensor" (under "spmd_types" torchtitan itself refuses SDPA
    + CP, in one line). The inputs are one rank's: 64 of the 128 tokens (torchtitan's trainer
    shards the batch with prepare_context_parallel_input; the rope positions it passes change no
    size). By hand per layer (16 heads of 16, batch 2): forward one all-gather of cat(k, v) of both
    ranks, 2 x 2 x (2 x 16 x 64 x 16) bf16 = 262,144 B; backward that again and 2 all-to-alls of
    the fp32 k/v gradients, 2 x (2 x 16 x 64 x 16) x 4 = 262,144 B."""
    import contextlib

    import pytest

    pytest.importorskip("torchtitan")
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    from .test_torchtitan import _config, _loss, _parallelize_llama

    backend, fsdp, cp = "partial_dtensor", 2, 2
    monkeypatch.setattr(dist_utils, "_spmd_backend", backend)
    cfg = _config()
    train_context = contextlib.ExitStack()

    def parallelize(model, mesh):
        parallelism = ParallelismConfig(data_parallel_shard_degree=fsdp,
                                        context_parallel_degree=cp, spmd_backend=backend)
        dims = ParallelDims.from_config(parallelism, world_size=fsdp * cp)
        dims.build_mesh()
        model = _parallelize_llama(model, parallelism, dims)
        train_context.close()
        train_context.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
        return model

    with train_context:
        p = tapescope.profile(cfg.build, tapescope.spec((2, 128 // cp), dtype=torch.long),
                              loss_fn=_loss, mesh={"fsdp": fsdp, "cp": cp},
                              parallelize=parallelize, gpu="h100")
    layers, kv = len(cfg.layers), 2 * 16 * 64 * 16
    seen = [(c.kind, c.nbytes, c.phase) for c in p.collectives if c.group == "cp"]
    assert sorted(seen) == sorted([("all_gather", cp * 2 * kv * 2, "forward")] * layers
                                  + [("all_gather", cp * 2 * kv * 2, "backward")] * layers
                                  + [("all_to_all", 2 * kv * 4, "backward")] * cp * layers)


# -- torch's own ring expansion as the truth ----------------------------------------------------

RING_SEQ, RING_HEAD_DIM = 64, 16  # small: the collectives follow the shapes, not the sizes


class RingAttention(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(HEADS * RING_HEAD_DIM, 3 * HEADS * RING_HEAD_DIM, bias=False)
        self.out = nn.Linear(HEADS * RING_HEAD_DIM, HEADS * RING_HEAD_DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, RING_HEAD_DIM).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, s, HEADS * RING_HEAD_DIM))


def _ring_step(rotate, load_balance):
    """The user's step with torch's two CP settings: the rotater and the load balancer."""
    def ring_step(model, batch, optimizer):
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import (_cp_options,
                                                                      set_rotate_method)

        set_rotate_method(rotate)
        _cp_options.enable_load_balance = load_balance
        step(model, batch, optimizer)
    return ring_step


@pytest.fixture
def torch_cp_options():
    """torch keeps the rotate method and the load-balance flag in a module global: restore them."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    saved = (_cp_options.rotate_method, _cp_options.enable_load_balance)
    yield
    _cp_options.rotate_method, _cp_options.enable_load_balance = saved


# Load balancing is causal-only in torch ("Load balancing requires `is_causal=True`"). Every
# (causal, load balance) pair with both rotaters, each rotater at both degrees (pairwise: the
# suite's time budget)
RING_CASES = [(True, "allgather", True, 2), (True, "alltoall", True, 4),
              (True, "allgather", False, 4), (True, "alltoall", False, 2),
              (False, "allgather", False, 2), (False, "alltoall", False, 4)]


@pytest.mark.parametrize("causal,rotate,load_balance,cp", RING_CASES)
def test_ring_collectives_equal_torchs_own_ring_run(torch_cp_options, causal, rotate,
                                                    load_balance, cp):
    """The profile's collectives (kind, bytes, group size, phase, in order) equal those every
    rank of torch's own ring attention issues running the same step with real CPU tensors on
    torch's fake process group (tapescope.validate.ring_attention: torch's CUDA flash handler
    and ring code as written, the CPU flash kernel for the per-block CUDA kernel)."""
    from tapescope.validate.ring_attention import torch_ring_collectives

    ring_step = _ring_step(rotate, load_balance)
    shape = (BATCH, RING_SEQ, HEADS * RING_HEAD_DIM)
    p = tapescope.profile(lambda: RingAttention(causal), tapescope.spec(shape), mesh={"cp": cp},
                          parallelize=parallelize, step=ring_step, gpu="h100",
                          dtype=torch.bfloat16)
    traced = [(c.kind, c.nbytes, c.group_size, c.phase)
              for c in sorted(p.collectives, key=lambda c: c.op)]
    for rank in range(cp):
        real = torch_ring_collectives(lambda: RingAttention(causal).to(torch.bfloat16),
                                      (torch.randn(shape, dtype=torch.bfloat16),),
                                      parallelize, ring_step, {"cp": cp}, rank)
        assert traced == [(c.kind, c.nbytes, c.group_size, c.phase) for c in real], rank
    rotations = 1 if rotate == "allgather" else cp - 1   # kv exchanges per pass
    assert len(traced) == 2 * rotations + cp             # + the fp32 dk/dv ring of backward


# -- CP among the presets: profile --cp, fit --gpus --cp, the search's space --------------------

def _tiny_llama():
    from tapescope.zoo.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=256))


def test_cp_preset_ring_and_fsdp_over_dp_shard_x_cp():
    """`--fsdp 2 --cp 2` (world 4): the preset shards parameters over dp_shard x cp as
    torchtitan does (every FSDP2 collective on the 4 ranks of "dp_shard+cp"), and its built-in
    step runs in torch's context_parallel over the inputs: the ring's collectives equal those of
    torch's own ring run of the same preset and inputs (tokens and targets, 2 x 128), real CPU
    tensors on the fake process group, on the last rank (the trace is the first's)."""
    from tapescope.distributed.presets import parallelization
    from tapescope.validate.ring_attention import torch_ring_collectives

    mesh, preset, amp = parallelization(fsdp=2, cp=2, amp="bf16")
    assert mesh == {"dp_shard": 2, "cp": 2} and amp is None  # FSDP2's bf16 mixed precision
    tokens = tapescope.spec((2, 128), dtype=torch.long)
    p = tapescope.profile(_tiny_llama, tokens, tokens, mesh=mesh, parallelize=preset,
                          gpu="h100")
    ring = [(c.kind, c.nbytes, c.group_size, c.phase)
            for c in sorted(p.collectives, key=lambda c: c.op) if c.group == "cp"]
    assert {(c.group, c.group_size) for c in p.collectives if c.group != "cp"} == \
        {("dp_shard+cp", 4)}
    # per layer: cat(k, v) of 2 key/value heads of 16, 64 of the 128 tokens, both ranks, bf16
    assert ring[0] == ("all_gather", 2 * 2 * (2 * 2 * 64 * 16) * 2, 2, "forward")

    def built_in_step(model, batch, optimizer):  # the built-in step inside the preset's context
        with preset.train_context(batch, {}):
            model(*batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    x = torch.randint(0, 256, (2, 128))
    real = torch_ring_collectives(_tiny_llama, (x, x.clone()), preset, built_in_step, mesh, 3)
    assert ring == [(c.kind, c.nbytes, c.group_size, c.phase) for c in real]


def test_cp_degrees_in_layouts_search_space_and_torchtitan_config():
    """Pure: fit --gpus --cp and the search's layouts gain CP degrees (without a pipeline;
    FSDP over what is left); the search tries a degree only when each rank keeps 8k tokens and
    2 x cp divides the sequence; the torchtitan config and the profile command carry it; a
    candidate without CP keeps its cache key."""
    from tapescope.distributed.presets import Layout, parallelization
    from tapescope.errors import TapescopeError
    from tapescope.layout_search.config import tapescope_command, torchtitan_toml
    from tapescope.layout_search.evaluate import Source
    from tapescope.layout_search.space import Candidate, SearchSpace, cp_degrees, layouts_of
    from tapescope.layouts import candidate_layouts

    assert Layout(fsdp=2, cp=2, tp=2).mesh == {"dp_shard": 2, "cp": 2, "tp": 2}
    assert str(Layout(fsdp=4, cp=2)) == "FSDP 4 x CP 2"
    assert candidate_layouts(8, 8, pp_degrees=(1, 2), cp_degrees=(1, 2)) == [
        Layout(fsdp=8), Layout(fsdp=4, tp=2), Layout(fsdp=2, tp=4), Layout(tp=8),
        Layout(fsdp=4, cp=2), Layout(fsdp=2, tp=2, cp=2), Layout(tp=4, cp=2),
        Layout(fsdp=4, pp=2), Layout(fsdp=2, tp=2, pp=2), Layout(tp=4, pp=2)]
    assert cp_degrees(4096) == (1,) and cp_degrees(32768) == (1, 2, 4)
    space = SearchSpace(8, 8, 8, pp=(1,), tp=(1,), hsdp=False, seq=32768)
    assert layouts_of(space) == [Layout(fsdp=8), Layout(fsdp=4, cp=2), Layout(fsdp=2, cp=4)]
    c = Candidate(Layout(fsdp=4, cp=2))
    assert 'context_parallel_degree = 2' in torchtitan_toml(Source("zoo:llama3-8b", 32768), c, 4)
    assert "--fsdp 4 --cp 2" in tapescope_command(Source("zoo:llama3-8b", 32768), c)
    assert "cp=" not in Candidate(Layout(fsdp=8)).key() and "cp=2" in c.key()
    with pytest.raises(TapescopeError, match="--pp 2 with --cp 2 is not supported"):
        parallelization(fsdp=2, cp=2, pp=2)
