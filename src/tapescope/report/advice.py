"""What to do when a step does not fit: the reason and the next commands, from its categories.

`why(shortfall)` names the categories that are over the budget on their own; `next_steps`
writes the commands that act on those categories, with the user's model and sizes
(`Invocation`), each with the figure that makes it worth trying. Nothing here is a fixed list:
a step whose model state is over the budget gets sharding and a leaner optimizer or dtype, one
whose activations are gets checkpointing, autocast and a smaller batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..analysis.shortfall import Shortfall
from ..capture.records import GRADIENT, OPTIMIZER_STATE, PARAMETER, SAVED
from .text import fmt_bytes

__all__ = ["Invocation", "why", "next_steps"]


@dataclass(frozen=True)
class Invocation:
    """How the user asked, to write the next commands with the same model and sizes."""

    command: str                 # "profile", "plan", ...
    spec: str
    flags: tuple = ()            # the workload's own flags: ("--batch", "4", "--amp", "bf16")
    gpu: str | None = None       # the GPU named, if any
    budget: str | None = None    # --budget as given
    amp: bool = False            # autocast already on
    dtype_fp32: bool = True      # parameters in fp32 (a narrower dtype would halve the state)
    optimizer: str | None = None

    def cmd(self, command: str, *extra: str, drop: tuple = ()) -> str:
        flags, skip = [], False
        for f in self.flags:  # the workload's flags, less those `drop` names (with their value)
            if skip:
                skip = False
                continue
            if f in drop:
                skip = True
                continue
            flags.append(f)
        return " ".join(("tapescope", command, self.spec, *flags, *extra))

    def batch(self) -> int | None:
        """--batch as given, if it was."""
        flags = list(self.flags)
        return int(flags[flags.index("--batch") + 1]) if "--batch" in flags else None

    def where(self) -> tuple:
        """--gpu G and --budget B as given, to keep the same memory target."""
        return (("--gpu", self.gpu) if self.gpu else ()) + \
            (("--budget", self.budget) if self.budget else ())


def _sum(parts) -> str:
    text = " + ".join(f"{c} {fmt_bytes(b)}" for c, b in parts)
    return text if len(parts) == 1 else f"{text} = {fmt_bytes(sum(b for _, b in parts))}"


def why(s: Shortfall, what: str = "the budget") -> str:
    """The categories over the budget on their own, with their bytes at the peak."""
    if s.state_exceeds:
        return (f"the model's state alone is over {what} of {fmt_bytes(s.budget)}: "
                f"{_sum(s.state)} at the peak, which no batch size or checkpointing changes")
    over = s.exceeding()
    return (f"{_sum(over)} at the peak exceed {what} of {fmt_bytes(s.budget)} (the model's state "
            f"is {fmt_bytes(s.state_bytes)} of the peak; the rest grows with the batch)")


def next_steps(s: Shortfall, inv: Invocation, *, checkpointed: bool = False,
               what: str = "the budget") -> list[tuple[str, str]]:
    """(command, why) pairs, most effective first. `checkpointed`: the peak is already the
    lowest activation checkpointing reaches (a plan that cannot meet its budget); `what` names
    the budget ("the GPU's memory")."""
    out = []
    if s.state_exceeds:
        n = s.shards_needed()
        if n is not None:
            per = s.state_bytes // n
            out.append((inv.cmd("fit", "--gpus", str(n), "--gpu", inv.gpu or "h100"),
                        f"shard the model state over {n} GPUs ({fmt_bytes(per)} of it per GPU, "
                        f"an estimate from this peak): every (FSDP, TP) layout of {n} GPUs, "
                        "profiled per rank, says which fits"))
            gpu = ("--gpu", inv.gpu) if inv.gpu else ()
            out.append((inv.cmd("profile", "--fsdp", str(n), *gpu),
                        f"FSDP2 over {n} GPUs, each rank's peak"))
        opt = s.at_peak.get(OPTIMIZER_STATE, 0)
        if opt and inv.optimizer != "sgd":
            left = s.state_bytes - opt
            verdict = "within" if left <= s.budget else "still over"
            out.append(("this command with --optimizer sgd",
                        f"plain SGD keeps no optimizer state: the model state becomes "
                        f"{fmt_bytes(left)}, {verdict} {what}"))
        if inv.dtype_fp32:
            half = s.state_bytes // 2
            verdict = "within" if half <= s.budget else "still over"
            out.append(("this command with --dtype bf16",
                        f"bf16 parameters, gradients and optimizer state: about {fmt_bytes(half)}, "
                        f"{verdict} {what}"))
        return out + _outside_tapescope(s, inv, what)
    saved = s.at_peak.get(SAVED, 0)
    if not checkpointed and saved:
        out.append((inv.cmd("plan", *inv.where()),
                    f"activation checkpointing: what to recompute so that the saved activations "
                    f"({fmt_bytes(saved)} at the peak) shrink enough"))
    if not inv.amp and inv.dtype_fp32:  # autocast on bf16 weights adds fp32 copies, saves nothing
        act = sum(b for _, b in s.activations)
        out.append(("this command with --amp bf16",
                    f"autocast runs matmuls in bf16: their activations take half the bytes "
                    f"({fmt_bytes(act)} of activations and temporaries at the peak now)"))
    plain = " (without checkpointing)" if checkpointed else ""
    if inv.batch() == 1:  # no smaller batch: search the sequence length at batch 1 instead
        out.append((inv.cmd("fit", *inv.where(), drop=("--seq",)),
                    "the longest sequence that fits at batch 1" + plain))
    else:
        out.append((inv.cmd("fit", *inv.where(), drop=("--batch",)),
                    "the largest batch that fits" + plain))
    return out


def _outside_tapescope(s: Shortfall, inv: Invocation, what: str) -> list[tuple[str, str]]:
    """What a user on one small GPU really changes and tapescope cannot trace yet (the libraries
    are not among its dependencies), with the bytes it would free, read off this peak's own
    categories: CPU offload of the optimizer state frees all of it; LoRA leaves the frozen
    weights without gradients or optimizer state (the adapters' own, typically under 1% of the
    parameters, are not counted; the optimizer's temporaries shrink too, not counted either) and
    needs no fp32 copy of them; an 8-bit optimizer keeps one byte per value where a 32-bit
    Adam keeps four (its per-block scales, 4 B per 256 values in torchao, are added back)."""
    opt = s.at_peak.get(OPTIMIZER_STATE, 0)
    grads = s.at_peak.get(GRADIENT, 0)
    rows = []

    def verdict(freed: int) -> str:
        left = s.peak - freed
        return f"the peak becomes about {fmt_bytes(left)}, " + (
            "within " if left <= s.budget else "still over ") + what

    if opt:
        rows.append(("CPU offload of the optimizer state (torchao CPUOffloadOptimizer, "
                     "DeepSpeed ZeRO-Offload; not traced by tapescope)",
                     f"frees the {fmt_bytes(opt)} of optimizer state at the peak: "
                     + verdict(opt)))
    if opt and inv.dtype_fp32 and inv.optimizer in (None, "adam", "adamw"):
        freed = opt * 3 // 4 - opt // 4 // 256 * 4
        rows.append(("an 8-bit AdamW (bitsandbytes AdamW8bit, torchao AdamW8bit; not traced by "
                     "tapescope)", f"1 byte per moment instead of 4 frees about {fmt_bytes(freed)}: "
                     + verdict(freed)))
    if opt or grads:
        params = s.at_peak.get(PARAMETER, 0)
        state = s.state_bytes - opt - grads
        text = (f"frozen weights keep no gradients and no optimizer state: at least "
                f"{fmt_bytes(opt + grads)} freed, the model state becomes about {fmt_bytes(state)}")
        if inv.dtype_fp32 and params:  # frozen weights need no fp32 master copy
            half = state - params // 2
            text += (f", {fmt_bytes(half)} with bf16 frozen weights (--dtype bf16), "
                     + ("within " if half <= s.budget else "still over ") + what)
        rows.append(("LoRA adapters on frozen weights (peft; examples/lora.py writes them out and "
                     "tapescope traces it)", text))
    return rows
