"""layout_search/bounds.py's figure functions on steps the search's own candidates do not run
(tests/test_search.py checks every rule against brute force over the search's candidates)."""

from __future__ import annotations

from dataclasses import replace

import torch

from tapescope.api import profile_workload
from tapescope.capture.model import model_of
from tapescope.distributed.presets import Layout
from tapescope.layout_search.bounds import optimizer_floors
from tapescope.layout_search.evaluate import Source, _block_fqns, _edge_fqns, candidate_options
from tapescope.layout_search.space import Candidate

SPEC = "zoo:llama:n_layers=2,dim=64,n_heads=4,n_kv_heads=2,ffn_dim=128"


def test_single_tensor_optimizer_has_no_table():
    """A single-tensor optimizer (foreach=False) launches its kernels over one tensor each, so
    optimizer_floors finds no table of parameter shards and counts none of them (a floor of 0,
    which twin_pipeline_ends may add); before, the first such kernel raised IndexError."""
    workload, options = candidate_options(Source(SPEC, 128, "h100"), Candidate(Layout()))
    options = replace(options, optimizer=lambda ps: torch.optim.AdamW(ps, foreach=False))
    q = profile_workload(workload, options)
    launched = [op for op, k in zip(q.ops, q.kernels) if op.phase == "optimizer" and k]
    assert launched and not any(isinstance(a, (list, tuple)) for op in launched
                                for a in op.record.args)
    model = model_of(workload.model)
    blocks = _block_fqns(model)
    assert optimizer_floors(q, blocks, *_edge_fqns(model, blocks)) == (0.0, ())
