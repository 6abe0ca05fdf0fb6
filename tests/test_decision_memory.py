"""DTensor's sharding decisions kept from one profile to the next (distributed/fidelity.py, point
6): what a search's worker does between candidates. The truth is the same profile made with no
memory, where each rank's DTensor makes its own decisions, as each process of a real job does."""

import torch

import tapescope
from tapescope.distributed import fidelity
from tapescope.distributed.presets import Layout, preset_parallelize
from tapescope.zoo import resolve

SPEC = "zoo:llama:dim=64,n_layers=1,n_heads=4,n_kv_heads=4,ffn_dim=128,vocab_size=1004"


def _traced(batch, layout):
    m = resolve(SPEC, batch=batch, seq=16)
    p = tapescope.profile(m.build, *m.inputs, input_kwargs=m.input_kwargs, loss_fn=m.loss_fn,
                          device="cuda", gpu="h100", mesh=layout.mesh,
                          parallelize=preset_parallelize(layout, torch.bfloat16))
    ops = {r: [(str(o.func), tuple(None if t is None else tuple(t.shape) for t in o.outputs))
               for o in q.trace.ops] for r, q in p.distributed.profiles.items()}
    return (p.distributed.classes.members, ops,
            [(r.peak_bytes, r.first_step_peak_bytes, r.step_seconds) for r in p.ranks])


def _meshes(x, seen=None):
    """Every object in `x` (a kept template: schemas, specs, decisions) that is a DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    seen = set() if seen is None else seen
    if id(x) in seen or isinstance(x, (int, float, str, bytes, type(None), torch.dtype)):
        return []
    seen.add(id(x))
    if isinstance(x, DeviceMesh):
        return [x]
    if isinstance(x, dict):
        items = list(x.keys()) + list(x.values())
    elif isinstance(x, (list, tuple, set, frozenset)):
        items = list(x)
    else:
        items = list(getattr(x, "__dict__", {}).values())
    return [m for v in items for m in _meshes(v, seen)]


def test_a_later_profile_takes_an_earlier_profiles_decisions(monkeypatch):
    """HSDP 2 x FSDP 2 x TP 2 (a 3-D mesh), its vocabulary split unevenly (two rank classes): a
    profile at batch 1, then one at batch 2 in the same memory. The second takes the first's decisions for the ops whose schemas repeat (the
    optimizer's, FSDP2's setup) and is op for op, shape for shape, and byte for byte in its
    peaks and step times what it is made alone; the memory keeps no mesh of the first."""
    layout = Layout(dp_replicate=2, fsdp=2, tp=2)
    alone = _traced(2, layout)
    recalled, taken = fidelity.SharedDecisions._recalled, []

    def spy(self, op_schema):
        found = recalled(self, op_schema)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(fidelity.SharedDecisions, "_recalled", spy)
    memory = fidelity.DecisionMemory()
    with fidelity.decisions_remembered(memory):
        _traced(1, layout)
        kept = len(memory)
        assert kept and not any(taken)
        assert _meshes(memory._kept) == []  # only _MeshValues: no earlier mesh stays alive
        after = _traced(2, layout)
    assert sum(taken) >= 10  # 48 of 178 misses of DTensor's caches here
    assert len(memory) > kept  # batch 2's own forward and backward decisions, kept as well
    assert after == alone
