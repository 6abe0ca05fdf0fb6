"""PyTorch's CUDA caching allocator settings (`PYTORCH_CUDA_ALLOC_CONF`), as an option holds them.

`AllocatorConfig` is the value; `AllocatorConfig.from_env` parses the string as
c10/core/AllocatorConfig.cpp (`AcceleratorAllocatorConfig::parseArgs`) and
c10/cuda/CUDAAllocatorConfig.cpp (`CUDAAllocatorConfig::parseArgs`) do, one small parser per key.
analysis/allocator.py replays the allocator under these settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["AllocatorConfig", "config_syntax_error", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC",
           "INTERVALS"]

_MB = 1 << 20
K_MIN_LARGE_ALLOC = 10 * _MB    # allocations between 1 and 10 MiB may use a large segment
K_LARGE_BUFFER = 20 * _MB       # default large_segment_size
INTERVALS = 16                  # roundup_power2_divisions intervals: [1, 2) MiB ... [32 GiB, inf)
_INTERVALS = INTERVALS


@dataclass(frozen=True)
class AllocatorConfig:
    """The `PYTORCH_CUDA_ALLOC_CONF` knobs that change device-memory accounting.

    Sizes are bytes. `roundup_power2_divisions` takes one int for every size, or 16 ints, one per
    power-of-two interval starting at 1 MiB (sizes below 1 MiB use the first, sizes from 32 GiB the
    last), as `AcceleratorAllocatorConfig::roundup_power2_divisions(size)` looks them up; 0 or 1
    means plain 512-byte rounding.
    """

    max_split_size: int | None = None
    expandable_segments: bool = False
    garbage_collection_threshold: float | None = None
    roundup_power2_divisions: int | tuple[int, ...] = 0
    max_non_split_rounding_size: int | None = None   # None: large_segment_size
    large_segment_size: int = K_LARGE_BUFFER
    # torch.cuda.set_per_process_memory_fraction; below 1 it caps the allocator and turns GC on
    per_process_memory_fraction: float = 1.0

    def __post_init__(self):
        divs = self.roundup_power2_divisions
        if isinstance(divs, int):
            divs = (divs,) * _INTERVALS
        divs = tuple(int(d) for d in divs)
        if len(divs) != _INTERVALS:
            raise ValueError(f"roundup_power2_divisions needs 1 or {_INTERVALS} values")
        object.__setattr__(self, "roundup_power2_divisions", divs)

    def describe(self) -> str:
        """The settings that differ from torch's defaults, as PYTORCH_ALLOC_CONF writes them
        ("" for the defaults)."""
        parts = []
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // _MB}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        divs = self.roundup_power2_divisions
        if any(divs):
            parts.append(f"roundup_power2_divisions:{divs[0]}" if len(set(divs)) == 1 else
                         "roundup_power2_divisions:[" + ",".join(
                             f"{1 << i}:{d}" for i, d in enumerate(divs)) + "]")
        if self.max_non_split_rounding_size is not None:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // _MB}")
        if self.large_segment_size != K_LARGE_BUFFER:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // _MB}")
        if self.per_process_memory_fraction != 1.0:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        return ",".join(parts)

    @classmethod
    def from_env(cls, value: str) -> "AllocatorConfig":
        """Parse a `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` string, as
        `AcceleratorAllocatorConfig::parseArgs` and `CUDAAllocatorConfig::parseArgs` do."""
        fields: dict = {}
        try:
            items = list(_config_items(value))
        except IndexError:
            raise ValueError(f"malformed allocator config {value!r}") from None
        for key, val in items:
            if key in _IGNORED_KEYS:
                continue
            if key not in _CONFIG_PARSERS:
                raise ValueError(f"Unrecognized key {key!r} in allocator config")
            fields.update(_CONFIG_PARSERS[key](val))
        # parseMaxSplitSize / parseMaxNonSplitRoundingSize: both must be >= large_segment_size
        floor = fields.get("large_segment_size", K_LARGE_BUFFER)
        for name in ("max_split_size", "max_non_split_rounding_size"):
            if name in fields and fields[name] < floor:
                raise ValueError(f"{name} must be >= {floor // _MB} MB")
        return cls(**fields)


# -- PYTORCH_CUDA_ALLOC_CONF parsing: one small parser per key ------------------------------------

def config_syntax_error(value: str) -> str | None:
    """What is malformed in an allocator config's syntax (None: nothing). torch's ConfigTokenizer
    parses PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF when torch is imported and aborts the
    process on these; unknown keys and values are checked later, by from_env."""
    try:
        list(_config_items(value))
    except IndexError:
        return f"malformed allocator config {value!r}"
    except ValueError as e:
        return str(e)
    return None


def _config_items(value: str):
    """(key, value) pairs; value is a str, or a list of (str, str) for a bracketed list."""
    # ConfigTokenizer: ',', ':', '[' and ']' are tokens of their own; spaces are dropped
    toks = re.findall(r"[,:\[\]]|[^,:\[\]]+", value.replace(" ", ""))
    i = 0
    while i < len(toks):
        key = toks[i]
        if i + 2 >= len(toks) or toks[i + 1] != ":":
            raise ValueError(f"expected '{key}:<value>' in allocator config")
        i += 2
        if toks[i] == "[":
            pairs = []
            i += 1
            while toks[i] != "]":
                if toks[i + 1] != ":":
                    raise ValueError("expected '<interval>:<divisions>' in a [...] list")
                pairs.append((toks[i], toks[i + 2]))
                i += 3
                if toks[i] == ",":
                    i += 1
            yield key, pairs
        else:
            yield key, toks[i]
        i += 1
        if i < len(toks):
            if toks[i] != ",":
                raise ValueError("expected ',' between allocator config entries")
            i += 1


def _bool(v):
    if v not in ("True", "False"):
        raise ValueError(f"expected True or False, got {v!r}")
    return v == "True"


def _pow2(n):
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(v):
    """parseRoundUpPower2Divisions: a single power of two for every interval, or a list of
    `<interval start in MB>:<divisions>` whose first entry also covers the intervals below it
    and whose `>` entry covers all intervals above the last one named."""
    if not isinstance(v, list):
        n = int(v)
        if not _pow2(n):
            raise ValueError("roundup_power2_divisions must be a power of 2")
        return {"roundup_power2_divisions": n}
    divs, first, last = [0] * _INTERVALS, True, 0
    for boundary, value in v:
        n = int(value)
        if n != 0 and not _pow2(n):
            raise ValueError("roundup_power2_divisions must be a power of 2 or 0")
        if boundary == ">":
            divs[last + 1:] = [n] * (_INTERVALS - last - 1)
            continue
        mb = int(boundary)
        if not _pow2(mb):
            raise ValueError("roundup_power2_divisions intervals must be powers of 2")
        index = min(mb.bit_length() - 1, _INTERVALS - 1)
        if first:
            divs[:index] = [n] * index
            first = False
        divs[index], last = n, index
    return {"roundup_power2_divisions": tuple(divs)}


def _parse_gc_threshold(v):
    t = float(v)
    if not 0.0 < t < 1.0:
        raise ValueError("garbage_collection_threshold must be in (0, 1)")
    return {"garbage_collection_threshold": t}


def _parse_large_segment(v):
    mb = int(v)
    if mb <= K_MIN_LARGE_ALLOC // _MB:       # parseLargeSegmentSize
        raise ValueError(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // _MB}")
    return {"large_segment_size": mb * _MB}


def _parse_fraction(v):
    f = float(v)
    if not 0.0 <= f <= 1.0:
        raise ValueError("per_process_memory_fraction must be in [0, 1]")
    return {"per_process_memory_fraction": f}


def _parse_backend(v):
    if v != "native":
        raise ValueError(f"backend {v!r} is not modelled; only the native caching allocator is")
    return {}


_CONFIG_PARSERS = {
    "max_split_size_mb": lambda v: {"max_split_size": int(v) * _MB},
    "max_non_split_rounding_mb": lambda v: {"max_non_split_rounding_size": int(v) * _MB},
    "large_segment_size_mb": _parse_large_segment,
    "garbage_collection_threshold": _parse_gc_threshold,
    "roundup_power2_divisions": _parse_divisions,
    "expandable_segments": lambda v: {"expandable_segments": _bool(v)},
    "per_process_memory_fraction": _parse_fraction,
    "backend": _parse_backend,
}
# Valid keys that do not change device-memory accounting (pinned host memory, locking, IPC).
_IGNORED_KEYS = frozenset({
    "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register", "pinned_num_register_threads", "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
    "graph_capture_record_stream_reuse", "expandable_segments_handle_type"})

