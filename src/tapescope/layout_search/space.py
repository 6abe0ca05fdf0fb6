"""The candidates a search tries: layouts of N GPUs, each with a micro-batch split and an
activation-checkpointing mode, as plain frozen records.

A `Candidate` is one training configuration of the whole job. Its `layout` holds the mesh degrees
(distributed/presets.py's Layout: PP, HSDP replicas, FSDP, TP); the rest says how one
data-parallel rank's share of the global batch is run:

- pp = 1: `micro_batch` samples per forward/backward, `steps` of them accumulated per optimizer
  step (gradient accumulation);
- pp > 1: the rank's batch split into `steps` pipeline micro-batches of `micro_batch` samples,
  run by `schedule`.

`checkpointing` is a mode applied to every repeated block (CHECKPOINTING below), as torchtitan's
`--activation_checkpoint.mode` does. Context parallel, expert parallel and float8 are further
fields of the layout / the candidate when they exist; every field has the value that means "not
used", so a candidate written before them keeps its key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import product

from ..distributed.presets import Layout
from ..errors import TapescopeError

__all__ = ["Candidate", "SearchSpace", "CHECKPOINTING", "candidate_grid", "layouts_of"]

# What each checkpointing mode keeps: None keeps everything; "full" recomputes each block whole;
# "selective" keeps the outputs of the matmuls and attention (torchtitan's op-level
# selective checkpointing saves these) and recomputes the cheap pointwise ops between them.
SELECTIVE_SAVE = ("aten.mm.default", "aten._scaled_dot_product_flash_attention.default",
                  "aten._scaled_dot_product_efficient_attention.default",
                  "aten._scaled_dot_product_cudnn_attention.default")
CHECKPOINTING = {"none": None, "selective": ("selective", SELECTIVE_SAVE), "full": ("full", ())}
# least recompute first: at one micro-batch size a later mode does the same work plus more
RECOMPUTE_ORDER = ("none", "selective", "full")


_ADDED_LATER = {"cp": 1, "float8": None}   # field -> its "not used" value


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch: int = 1          # samples per micro-batch on each data-parallel rank
    steps: int = 1                # accumulation steps (pp = 1) or pipeline micro-batches (pp > 1)
    checkpointing: str = "none"   # a CHECKPOINTING mode, on every repeated block
    schedule: str | None = None   # the pipeline schedule (pp > 1)
    compile: bool = False
    float8: str | None = None     # a float8 recipe (capture/float8.py), None: not used

    @property
    def rank_batch(self) -> int:
        """Samples one data-parallel rank takes per optimizer step."""
        return self.micro_batch * self.steps

    @property
    def chain(self) -> tuple:
        """What the candidates of one micro-batch series share: memory grows with the micro-batch
        along it (layout_search/runner.py prunes on that)."""
        return (self.layout, self.checkpointing, self.schedule, self.compile, self.float8)

    def label(self) -> str:
        parts = [str(self.layout), f"mb {self.micro_batch}"]
        if self.layout.pp > 1:
            parts.append(f"{self.steps} micro-batches {self.schedule}")
        elif self.steps > 1:
            parts.append(f"accumulate {self.steps}")
        if self.checkpointing != "none":
            parts.append(f"AC {self.checkpointing}")
        if self.compile:
            parts.append("compiled")
        if self.float8:
            parts.append(f"float8 {self.float8}")
        return ", ".join(parts)

    def key(self) -> str:
        """A stable text key (the cache's); a field added later is left out at its "not used"
        value, so a candidate written before it keeps its key."""
        d = {k: v for k, v in self.to_dict().items() if _ADDED_LATER.get(k, object()) != v}
        return ",".join(f"{k}={d[k]}" for k in sorted(d))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("layout"))
        return d


@dataclass(frozen=True)
class SearchSpace:
    """What to vary. Defaults: every pipeline degree that is a power of two up to 8 dividing the
    GPUs and the blocks, TP powers of two within a node, FSDP over the rest or HSDP with shard
    groups of one or two nodes, every checkpointing mode, 1F1B."""

    gpus: int
    global_batch: int
    gpus_per_node: int = 8
    pp: tuple | None = None
    tp: tuple | None = None
    hsdp: bool = True
    checkpointing: tuple = RECOMPUTE_ORDER
    schedules: tuple = ("1f1b",)
    compile: tuple = (False,)
    max_steps: int = 16           # micro-batches per optimizer step traced at most
    n_blocks: int | None = None   # the model's repeated blocks (a stage holds at least one)
    heads: tuple = ()             # (heads, kv heads): TP must divide them
    seq: int | None = None        # tokens of one sample: context parallelism splits them
    cp: tuple | None = None       # context-parallel degrees (default: cp_degrees(seq))
    float8: tuple = (None,)       # float8 recipes to try, None: without (search --float8)

    def __post_init__(self):
        if self.gpus < 1 or self.global_batch < 1:
            raise TapescopeError("--gpus and --global-batch must be at least 1")
        bad = [c for c in self.checkpointing if c not in CHECKPOINTING]
        if bad:
            raise TapescopeError(f"unknown checkpointing mode {bad[0]!r}; use "
                                 f"{', '.join(CHECKPOINTING)}")


def _powers(limit: int) -> list:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


# Context parallelism pays for its ring only on long sequences: a degree is tried when each of
# its ranks keeps at least this many tokens (torchtitan's CP examples start at 8k per GPU of a
# 32k-128k sequence), and when 2 x cp divides the sequence (torch's head-tail load balancing
# splits it into 2 x cp chunks).
CP_MIN_TOKENS_PER_RANK = 8192


def cp_degrees(seq: int | None) -> tuple:
    """The context-parallel degrees worth trying for `seq` tokens (see CP_MIN_TOKENS_PER_RANK)."""
    if not seq:
        return (1,)
    return tuple(c for c in _powers(8) if c == 1 or seq // c >= CP_MIN_TOKENS_PER_RANK
                 and seq % (2 * c) == 0)


def layouts_of(space: SearchSpace) -> list[Layout]:
    """The layouts of the space whose data-parallel degree divides the global batch (CP degrees
    without a pipeline: distributed/presets.py)."""
    out = []
    for pp in space.pp or _powers(8):
        if space.gpus % pp or space.n_blocks is not None and pp > space.n_blocks:
            continue
        for cp in (space.cp or cp_degrees(space.seq)) if pp == 1 else (1,):
            for tp in space.tp or _powers(space.gpus_per_node):
                rest = space.gpus // pp
                if rest % (tp * cp) or any(h and h % tp for h in space.heads):
                    continue
                dp = rest // (tp * cp)
                if space.global_batch % dp:
                    continue
                out.append(Layout(fsdp=dp, tp=tp, pp=pp, cp=cp))
                if not space.hsdp:
                    continue
                for nodes in (1, 2):  # shard over one or two nodes' GPUs, replicate across
                    shard = space.gpus_per_node * nodes // (tp * cp)
                    if 1 < shard < dp and dp % shard == 0:
                        out.append(Layout(fsdp=shard, tp=tp, pp=pp, cp=cp,
                                          dp_replicate=dp // shard))
    return list(dict.fromkeys(out))


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Grid:
    """Every candidate of the space, by chain (micro-batch ascending), and those left out
    before any trace with the reason."""

    chains: dict = field(default_factory=dict)      # chain key -> [Candidate], micro-batch up
    skipped: list = field(default_factory=list)     # (Candidate, reason)

    @property
    def candidates(self) -> list:
        return [c for chain in self.chains.values() for c in chain]


def candidate_grid(space: SearchSpace) -> Grid:
    grid = Grid()
    for layout in layouts_of(space):
        dp = layout.fsdp * layout.dp_replicate
        rank_batch = space.global_batch // dp
        for schedule in (space.schedules if layout.pp > 1 else (None,)):
            for compiled in space.compile:
                for ac, float8 in product(space.checkpointing, space.float8):
                    chain = []
                    for mb in _divisors(rank_batch):
                        c = Candidate(layout, mb, rank_batch // mb, ac, schedule, compiled,
                                      float8)
                        if layout.pp > 1 and c.steps < layout.pp:
                            grid.skipped.append((c, f"{c.steps} micro-batches cannot fill "
                                                    f"{layout.pp} pipeline stages"))
                        elif c.steps > space.max_steps:
                            grid.skipped.append((c, f"{c.steps} micro-batches per step, more "
                                                    f"than --max-steps {space.max_steps} traces"))
                        else:
                            chain.append(c)
                    if chain:
                        grid.chains[chain[0].chain] = chain
    return grid
