"""analysis/shortfall.py: which categories are over a budget on their own, by hand."""

from tapescope.analysis.shortfall import shortfall


def test_model_state_over_the_budget_and_the_shards_it_needs():
    at_peak = {"parameters": 10, "gradients": 10, "optimizer state": 20, "temporaries": 5,
               "saved activations": 0}
    assert shortfall(at_peak, 45) is None  # 45 bytes at the peak fit 45
    s = shortfall(at_peak, 30)
    assert s.state_exceeds and s.state_bytes == 40 and s.peak == 45
    assert s.state == [("optimizer state", 20), ("parameters", 10), ("gradients", 10)]
    assert s.exceeding() == [("optimizer state", 20), ("parameters", 10), ("gradients", 10)]
    assert s.shards_needed() == 2          # 40 / 2 + 5 = 25 <= 30; 40 + 5 > 30
    assert s.without("optimizer state") == 25
    assert shortfall(at_peak, 4).shards_needed() is None  # the 5 unsharded bytes alone are over


def test_activations_over_the_budget():
    at_peak = {"parameters": 4, "optimizer state": 8, "saved activations": 30, "temporaries": 20}
    s = shortfall(at_peak, 40)
    assert not s.state_exceeds
    assert s.exceeding() == [("saved activations", 30), ("temporaries", 20)]  # 50 > 40, 30 is not
    assert s.activations == [("saved activations", 30), ("temporaries", 20)]
