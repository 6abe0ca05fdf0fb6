"""`tapescope search`: which layout, micro-batch split and checkpointing train a model fastest
on N GPUs of one kind, every candidate it lists traced on every rank class.

    r = tapescope.search("zoo:llama3-8b", gpus=64, gpu="h100", global_batch=256, seq=4096)
    print(r.winner.candidate.label(), r.winner.tokens_per_second)

`time_limit=` (seconds) stops the search and returns what it knows: `r.complete` is then False
and `r.not_searched` lists the candidates neither traced nor ruled out, each with the lower
bound the traces give its step. Ctrl-C raises SearchInterrupted (a KeyboardInterrupt), SIGTERM
SearchTerminated (a SystemExit, status 143); each carries that result as `.result`.

space.py says what is searched, evaluate.py profiles one candidate, runner.py prunes and runs
them (in this process, local processes or Ray), config.py writes the winner as commands.
"""

from __future__ import annotations

from ..errors import TapescopeError
from .evaluate import Outcome, RankMemory, Source, candidate_options, evaluate
from .runner import (InProcess, LocalPool, Progress, SearchInterrupted, SearchResult,
                     SearchTerminated, Untraced, run_search)
from .space import CHECKPOINTING, Candidate, SearchSpace, candidate_grid, layouts_of

__all__ = ["search", "profile_candidate", "SearchResult", "SearchSpace", "Candidate", "Outcome",
           "RankMemory", "Source", "Progress", "CHECKPOINTING", "candidate_grid", "layouts_of",
           "result_dict", "winner_commands", "Untraced", "SearchInterrupted",
           "SearchTerminated"]


def search(spec: str, *, gpus: int, gpu: str = "h100", global_batch: int, seq: int | None = None,
           amp: str | None = "bf16", dtype: str | None = None, optimizer: str = "adamw",
           pp=None, tp=None, cp=None, hsdp: bool = True,
           checkpointing=("none", "selective", "full"),
           schedules=("1f1b",), compile=(False,), max_steps: int = 16, float8=(None,),
           gpus_per_node: int | None = None, workers: int = 1,
           ray: str | None = None, cache: str | None = None, brute_force: bool = False,
           top: int | None = 10, progress=None, time_limit: float | None = None) -> SearchResult:
    """Search the layouts of `gpus` GPUs of `gpu` for model `spec` (a zoo / hf / file spec, as
    the CLI takes it: workers rebuild the model from it) at `global_batch` samples of `seq`
    tokens per optimizer step. pp, tp, cp: the degrees to try (default: powers of two, TP within
    a node, CP where each rank keeps 8k tokens or more: space.cp_degrees); hsdp: also HSDP with shard groups of one and two nodes (gpus_per_node: default the
    GPU's node, devices/gpus.py); checkpointing: the modes
    tried on every block; max_steps: the most micro-batches per step a candidate may trace;
    float8: the float8 recipes tried, None for without (capture/float8.py).
    workers: local processes (1: this process); ray: a Ray cluster address ("local" starts
    one); cache: a file of finished candidates that a later search resumes from; top: the rows
    of the ranking kept exact (a candidate whose step provably takes longer than the top-th best
    so far is not traced: layout_search/bounds.py; None traces every candidate that may fit);
    time_limit: seconds after which the search stops, ends the candidates being traced and
    returns what it knows (`complete` False, `not_searched` with their bounds)."""
    from ..devices.gpus import interconnect
    from ..options import Options

    if time_limit is not None and not time_limit > 0:
        raise TapescopeError(f"cannot search for time_limit={time_limit!r} seconds: give a "
                             "time above 0 (or None for no limit)")
    gpu_entry = Options.create(gpu=gpu).gpu
    for recipe in float8:  # refused before any trace: a GPU without float8, an unknown recipe
        Options.create(gpu=gpu, float8=recipe)
    source = Source(spec, seq, gpu_entry.key, amp, dtype, optimizer)
    shape = _model_shape(source)
    space = SearchSpace(gpus, global_batch, gpus_per_node or interconnect(gpu_entry).gpus_per_node,
                        tuple(pp) if pp else None, tuple(tp) if tp else None, hsdp,
                        tuple(checkpointing), tuple(schedules), tuple(compile), max_steps,
                        shape["blocks"], shape["heads"], shape["seq"],
                        tuple(cp) if cp else None, tuple(float8))
    if ray is not None:
        from .ray_pool import RayPool

        pool = RayPool(ray, workers if workers > 1 else None)
    elif workers > 1:
        pool = LocalPool(workers)
    else:
        pool = InProcess()
    return run_search(source, space, pool=pool, cache=cache, brute_force=brute_force,
                      progress=progress, seq_tokens=shape["seq"], top=top,
                      time_limit=time_limit)


def _model_shape(source: Source) -> dict:
    """What the space needs of the model: its blocks (a pipeline stage holds one at least), its
    attention heads (TP divides them) and the tokens of one sample."""
    from ..capture.model import model_of, transformer_blocks

    workload, _ = source.workload(1)
    model = model_of(workload.model)
    config = getattr(model, "config", None)
    heads = tuple(getattr(config, n, None) for n in ("n_heads", "n_kv_heads",
                                                     "num_attention_heads",
                                                     "num_key_value_heads"))
    first = workload.args[0] if workload.args else None
    seq = int(first.shape[1]) if first is not None and len(first.shape) > 1 else 1
    return {"blocks": len(transformer_blocks(model)) or None,
            "heads": tuple(h for h in heads if isinstance(h, int)), "seq": seq}


def profile_candidate(source: Source, candidate: Candidate):
    """The Profile of one candidate, as the search traced it (its flags: config.py)."""
    from ..api import profile_workload

    workload, options = candidate_options(source, candidate)
    return profile_workload(workload, options)


def winner_commands(r: SearchResult) -> dict | None:
    """The winner as commands: tapescope's profile line, a torchtitan TOML and its launch line."""
    from .config import tapescope_command, torchtitan_command, torchtitan_toml

    w = r.winner
    if w is None:
        return None
    return {"tapescope": tapescope_command(r.source, w.candidate),
            "torchtitan_toml": torchtitan_toml(r.source, w.candidate, r.space.global_batch),
            "torchtitan_command": torchtitan_command(r.source, w.candidate, r.space.global_batch,
                                                     r.space.gpus_per_node)}


def result_dict(r: SearchResult) -> dict:
    """Everything the search found, as JSON data."""
    from ..report.json import to_jsonable
    from ..report.search import stop_summary

    w = r.winner
    winner = None
    if w is not None:
        winner = {"label": w.candidate.label(), "candidate": w.candidate.to_dict(),
                  **winner_commands(r)}
    return to_jsonable({
        "model": r.source.spec, "gpus": r.space.gpus, "gpu": r.source.gpu,
        "global_batch": r.space.global_batch, "seq": r.source.seq, "amp": r.source.amp,
        "workers": r.workers, "seconds": r.seconds, "top_exact": r.exact_rows,
        "ranked": [o.to_dict() for o in r.ranked],
        "rejected": [o.to_dict() for o in r.rejected],
        "dominated": [o.to_dict() for o in r.dominated],
        "fits_untimed": [o.to_dict() for o in r.outcomes
                         if o.fits and not o.tokens_per_second],
        "pruned": [{"label": c.label(), "candidate": c.to_dict(), "reason": why,
                    **({"bound_seconds": r.bounds[c]} if c in r.bounds else {})}
                   for c, why in r.pruned],
        "skipped": [{"label": c.label(), "candidate": c.to_dict(), "reason": why}
                    for c, why in r.skipped],
        "winner": winner,
        # a stopped search (time limit, Ctrl-C, SIGTERM): its rows are the best traced
        "complete": r.complete,
        "stopped": None if r.complete else {"by": r.stopped, "after_seconds": r.seconds,
                                            "summary": stop_summary(r)},
        "not_searched": [{"label": u.candidate.label(), "candidate": u.candidate.to_dict(),
                          "being_traced": u.being_traced,
                          **({"bound_seconds": u.bound.seconds, "bound_reason": u.bound.reason}
                             if u.bound is not None else {}),
                          "could_enter_top": r.could_enter_top(u),
                          "could_beat_best": r.could_beat_best(u)}
                         for u in r.not_searched]})
