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
    assert shortfall(at_peak, 4).shards_needed() is None  # the 5 unsharded bytes alone are over


def test_activations_over_the_budget():
    at_peak = {"parameters": 4, "optimizer state": 8, "saved activations": 30, "temporaries": 20}
    s = shortfall(at_peak, 40)
    assert not s.state_exceeds
    assert s.exceeding() == [("saved activations", 30), ("temporaries", 20)]  # 50 > 40, 30 is not
    assert s.activations == [("saved activations", 30), ("temporaries", 20)]


def test_autocast_is_suggested_only_for_fp32_weights():
    """Autocast on bf16 weights saves nothing (the matmuls already run in bf16) and adds fp32
    copies where autocast upcasts: following it raised a bf16 model's peak 42.47 -> 47.50 GiB."""
    from tapescope.report.advice import Invocation, next_steps

    s = shortfall({"parameters": 4, "saved activations": 30, "temporaries": 20}, 40)
    fp32 = Invocation("profile", "zoo:gpt2", dtype_fp32=True)
    bf16 = Invocation("profile", "zoo:gpt2", ("--dtype", "bf16"), dtype_fp32=False)
    assert any("--amp bf16" in c for c, _ in next_steps(s, fp32))
    assert not any("--amp bf16" in c for c, _ in next_steps(s, bf16))


def test_the_small_gpu_options_name_the_bytes_they_free():
    """Over the budget by its model state: CPU offload of the optimizer state frees all of it,
    LoRA frees the gradients and the optimizer state, an 8-bit AdamW 3/4 of the fp32 moments
    less its per-256-value fp32 scales; each figure read off the categories, by hand."""
    from tapescope.report.advice import Invocation, next_steps

    at_peak = {"parameters": 4096, "gradients": 4096, "optimizer state": 8192,
               "saved activations": 1000}
    s = shortfall(at_peak, 10_000)
    text = " ".join(f"{c} {w}" for c, w in next_steps(s, Invocation("fit", "m")))
    # 17384 B at the peak, 10000 B of budget
    assert "frees the 8.00 KiB of optimizer state at the peak: the peak becomes about 8.98 KiB, " \
           "within the budget" in text  # 17384 - 8192 = 9192
    # two fp32 moments of 1024 values: 8192 B -> 2048 B of int8 + 8 blocks x 4 B of scales
    assert "frees about 5.97 KiB: the peak becomes about 11.01 KiB, still over" in text
    # LoRA: 12 KiB of gradients and moments go; the 4 KiB of fp32 weights halve in bf16
    assert "at least 12.00 KiB freed, the model state becomes about 4.00 KiB, 2.00 KiB with " \
           "bf16 frozen weights (--dtype bf16), within the budget" in text


def test_at_batch_1_the_next_fit_searches_the_sequence():
    """A step over the budget at batch 1 has no smaller batch to find: `fit` would answer
    "nothing fits" again; the sequence length is what is left to search."""
    from tapescope.report.advice import Invocation, next_steps

    s = shortfall({"parameters": 4, "saved activations": 30, "temporaries": 20}, 40)
    one = Invocation("profile", "m", ("--batch", "1", "--seq", "2048"))
    four = Invocation("profile", "m", ("--batch", "4", "--seq", "2048"))
    assert ("tapescope fit m --batch 1", "the longest sequence that fits at batch 1") in \
        next_steps(s, one)
    assert ("tapescope fit m --seq 2048", "the largest batch that fits") in next_steps(s, four)
