"""The GPU catalogue: consistent entries, datasheet anchors, name resolution."""

import dataclasses

import pytest

from tapescope.devices.gpus import (
    ALIASES,
    ARCH_COMPUTE_CAPABILITIES,
    DTYPES,
    GPU,
    GPUS,
    get_gpu,
    normalize_name,
    resolve_gpu_key,
)

ENTRIES = list(GPUS.values())
IDS = [g.key for g in ENTRIES]
T = 1e12


def test_required_gpus_present():
    required = ("h100-sxm", "h100-pcie", "h200-sxm", "a100-sxm-40gb", "a100-sxm-80gb",
                "l4", "l40s", "rtx-4090", "b200-sxm")
    assert set(required) <= set(GPUS)


@pytest.mark.parametrize("gpu", ENTRIES, ids=IDS)
def test_entry_fields_are_consistent(gpu: GPU):
    assert gpu.key == normalize_name(gpu.key), "keys are stored normalized"
    assert gpu.name and gpu.source
    assert gpu.compute_capability in ARCH_COMPUTE_CAPABILITIES[gpu.arch]
    assert isinstance(gpu.memory_bytes, int) and gpu.memory_bytes > 0
    assert gpu.memory_bandwidth > 0
    assert gpu.sms > 0 and gpu.l2_bytes > 0 and gpu.tdp_watts > 0
    assert set(gpu.peak_flops) <= set(DTYPES)
    assert all(v > 0 for v in gpu.peak_flops.values())
    assert "fp32" in gpu.peak_flops


@pytest.mark.parametrize("gpu", ENTRIES, ids=IDS)
def test_reported_memory_is_just_below_the_marketed_capacity(gpu: GPU):
    if gpu.reported_memory_bytes is None:
        pytest.skip("no published report")
    # The marketed "GB" is GiB: what the card reports is a little below it (ECC and driver reserve).
    assert 0.9 * gpu.memory_bytes < gpu.reported_memory_bytes <= gpu.memory_bytes


@pytest.mark.parametrize("gpu", ENTRIES, ids=IDS)
def test_precision_ordering(gpu: GPU):
    p = gpu.peak_flops
    if "tf32" in p:
        assert p["bf16"] >= p["tf32"] >= p["fp32"]
        if "GeForce" not in gpu.name:  # GeForce cards run TF32 at their FP32 CUDA-core rate
            assert p["tf32"] > p["fp32"]
        assert p["bf16"] == p["fp16"], "bf16 and fp16 (FP32 accumulate) run at one rate from Ampere on"
    if "fp8" in p:
        assert p["fp8"] >= p["bf16"]
    if "fp16" in p:
        assert p["fp16"] > p["fp32"]
    if "fp64_tensor" in p:
        assert p["fp64_tensor"] >= p["fp64"]


@pytest.mark.parametrize("gpu", ENTRIES, ids=IDS)
def test_formats_match_architecture(gpu: GPU):
    p = gpu.peak_flops
    has_fp8 = gpu.arch in ("ada", "hopper", "blackwell")
    has_bf16 = gpu.arch in ("ampere", "ada", "hopper", "blackwell")
    assert ("fp8" in p) == has_fp8
    assert ("bf16" in p) == has_bf16
    assert ("tf32" in p) == has_bf16
    assert gpu.peak("fp8") == p.get("fp8")


def test_arch_compute_capability_pairs():
    cc = {g.key: g.compute_capability for g in ENTRIES}
    assert cc["v100-sxm2-16gb"] == (7, 0)
    assert cc["t4"] == (7, 5)
    assert cc["a100-sxm-80gb"] == cc["a100-sxm-40gb"] == cc["a100-pcie-80gb"] == (8, 0)
    assert cc["rtx-3090"] == (8, 6)
    assert cc["l4"] == cc["l40s"] == cc["rtx-4090"] == (8, 9)
    assert cc["h100-sxm"] == cc["h100-pcie"] == cc["h100-nvl"] == cc["h200-sxm"] == (9, 0)
    assert cc["b200-sxm"] == (10, 0)


def test_h100_sxm_anchor():
    g = get_gpu("h100-sxm")
    assert g.compute_capability == (9, 0) and g.arch == "hopper"
    assert g.memory_bytes == 80 * 2**30
    assert g.memory_bandwidth == pytest.approx(3.35e12)
    assert g.sms == 132
    assert g.tdp_watts == 700
    # Dense, not the datasheet's 1,979 "with sparsity".
    assert g.peak("bf16") == pytest.approx(989.4 * T)
    assert g.peak("fp8") == pytest.approx(1978.9 * T)
    assert g.peak("tf32") == pytest.approx(494.7 * T)
    assert g.peak("fp32") == pytest.approx(66.9 * T)
    assert g.peak("fp64_tensor") == pytest.approx(66.9 * T)
    assert 79 * 2**30 < g.reported_memory_bytes < 80 * 2**30


@pytest.mark.parametrize(
    "key, bf16_tflops, fp32_tflops, bandwidth, mem_gib",
    [
        ("h100-pcie", 756, 51, 2.0e12, 80),
        ("h100-nvl", 835.5, 60, 3.9e12, 94),
        ("h800-sxm", 989.4, 66.9, 3.35e12, 80),  # H100 SXM's tensor rates, Megatron's H800 runs
        ("h200-sxm", 989.5, 67, 4.8e12, 141),
        ("b200-sxm", 2250, 75, 7.7e12, 180),
        ("a100-sxm-80gb", 312, 19.5, 2.039e12, 80),
        ("a100-sxm-40gb", 312, 19.5, 1.555e12, 40),
        ("a100-pcie-80gb", 312, 19.5, 1.935e12, 80),
        ("l4", 121, 30.3, 300e9, 24),
        ("l40s", 362.05, 91.6, 864e9, 48),
        ("rtx-4090", 165.2, 82.6, 1008e9, 24),
        ("rtx-3090", 71, 35.6, 936e9, 24),
    ],
)
def test_datasheet_anchors(key, bf16_tflops, fp32_tflops, bandwidth, mem_gib):
    g = get_gpu(key)
    assert g.peak("bf16") == pytest.approx(bf16_tflops * T)
    assert g.peak("fp32") == pytest.approx(fp32_tflops * T)
    assert g.memory_bandwidth == pytest.approx(bandwidth)
    assert g.memory_bytes == mem_gib * 2**30


def test_pre_ampere_entries():
    t4, v100 = get_gpu("t4"), get_gpu("v100")
    assert t4.peak("fp16") == pytest.approx(65 * T) and t4.peak("bf16") is None
    assert v100.peak("fp16") == pytest.approx(125 * T) and v100.peak("tf32") is None


def test_no_sparse_figures_slipped_in():
    # The sparse headline numbers NVIDIA prints must not appear as dense rates.
    assert get_gpu("h100").peak("bf16") < 1500 * T
    assert get_gpu("h200").peak("bf16") < 1500 * T
    assert get_gpu("b200").peak("bf16") < 3000 * T
    assert get_gpu("l40s").peak("bf16") < 500 * T
    assert get_gpu("l4").peak("bf16") < 200 * T


@pytest.mark.parametrize(
    "name, key",
    [
        ("h100", "h100-sxm"),
        ("H100", "h100-sxm"),
        (" H100-SXM ", "h100-sxm"),
        ("a100", "a100-sxm-80gb"),
        ("A100_40GB", "a100-sxm-40gb"),
        ("h200", "h200-sxm"),
        ("b200", "b200-sxm"),
        ("h800", "h800-sxm"),
        ("NVIDIA H800", "h800-sxm"),
        ("4090", "rtx-4090"),
        ("RTX 4090", "rtx-4090"),
        ("l40s", "l40s"),
        ("L4", "l4"),
        ("v100", "v100-sxm2-16gb"),
        # torch.cuda.get_device_name() strings
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("Tesla T4", "t4"),
    ],
)
def test_names_resolve(name, key):
    assert resolve_gpu_key(name) == key
    assert get_gpu(name) is GPUS[key]


def test_aliases_point_at_keys_and_do_not_shadow_them():
    for alias, key in ALIASES.items():
        assert key in GPUS, alias
        assert alias not in GPUS, alias
        assert alias == normalize_name(alias), alias


def test_unknown_name_raises_with_suggestion_and_key_list():
    with pytest.raises(ValueError) as err:
        get_gpu("h10")
    msg = str(err.value)
    assert "Did you mean 'h100'" in msg
    for key in GPUS:
        assert key in msg
    with pytest.raises(ValueError, match="Known GPUs"):
        get_gpu("not-a-gpu-at-all")


def test_entries_are_read_only():
    g = get_gpu("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.sms = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        g.peak_flops["bf16"] = 1.0  # type: ignore[index]
    assert hash(g) == hash(get_gpu("h100-sxm"))


def test_peak_rejects_unknown_dtype():
    with pytest.raises(ValueError):
        get_gpu("h100").peak("fp4")


def test_unknown_peak_key_rejected_at_construction():
    with pytest.raises(ValueError, match="unknown peak_flops keys"):
        dataclasses.replace(get_gpu("h100"), peak_flops={"fp32": 1.0, "bfloat16": 2.0})


def test_h800_is_an_h100_with_fp64_and_nvlink_cut():
    """The export part of published runs (8 x H800): H100 SXM tensor rates and memory, FP64 1
    TFLOPS, NVLink 400 GB/s both directions (200 GB/s a direction, vs 450 for H100 SXM)."""
    from tapescope.devices.gpus import interconnect

    h800, h100 = get_gpu("h800"), get_gpu("h100")
    for dtype in ("tf32", "bf16", "fp16", "fp8", "int8", "fp32"):
        assert h800.peak(dtype) == h100.peak(dtype)
    assert h800.peak("fp64") == h800.peak("fp64_tensor") == 1 * T
    assert interconnect(h800).intra_node == 200e9 and interconnect(h100).intra_node == 450e9
