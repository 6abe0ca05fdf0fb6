"""The published-run benchmark (benchmarks/published_runs.py) runs end to end on two small rows."""

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch")

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "published_runs.py")


def _bench():
    spec = importlib.util.spec_from_file_location("published_runs", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_throughput_row_and_an_oom_row():
    bench = _bench()
    rows = {r.name: r for r in bench.ROWS}
    speed = bench.predict(rows["fms-7b-a100"])
    assert speed["value"] > 0 and speed["comm"] > 0            # HSDP's collectives are timed
    oom = bench.predict(rows["litgpt-13b-lora-mb2"])            # published: OOM on 40 GB
    assert oom["value"] == "OOM"
    text = bench.table([rows["fms-7b-a100"], rows["litgpt-13b-lora-mb2"]],
                       {"fms-7b-a100": speed, "litgpt-13b-lora-mb2": oom})
    assert "calibration" in text and "| right |" in text
