"""Stopping a search stops its worker processes: SIGTERM (a job scheduler, `kill`), Ctrl-C
(SIGINT) and `--time-limit` end the search and the candidates its local workers are tracing,
instead of leaving them tracing for minutes after the search has gone, and the search still
prints its table and writes its --json, marked partial (issue 35).

The workers here run a stand-in for the trace that sleeps for two minutes (the search submits
layout_search.runner.evaluate; the child script replaces it before the search starts), so a
worker left behind is still there when the test looks. What a stopped search reports, checked
against the complete search and brute force: tests/test_search.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

TINY = "zoo:llama:n_layers=1,dim=64,n_heads=4,max_seq_len=64"

# the CLI, on two local worker processes, with the stand-in trace; argv: the --json file, then
# more flags
CHILD = textwrap.dedent(f"""
    import sys, time
    import tapescope.layout_search.runner as runner

    def slow_trace(*args):
        time.sleep(120)

    if __name__ == "__main__":
        # Ctrl-C as a terminal's user presses it: a test run started in the background by a
        # non-interactive shell (`.ci/run &`) hands its children SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        runner.evaluate = slow_trace
        from tapescope.cli import main

        sys.argv = ["tapescope", "search", "{TINY}", "--gpus", "2", "--gpu", "t4",
                    "--global-batch", "4", "--seq", "64", "--pp", "1", "--tp", "1",
                    "--checkpointing", "none", "--workers", "2", "--json", *sys.argv[1:]]
        main()
        sys.exit(3)   # the command returned without an exit status: it should not have
""")


def _descendants(pid: int) -> set:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = {int(x) for x in f.read().split()}
            except OSError:
                continue
            todo += kids - found
            found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads /proc")
def test_sigterm_and_ctrl_c_stop_the_workers_and_write_the_json(tmp_path):
    """Two searches at once (each waits on its imports, so together they cost one's time): one
    gets SIGTERM, the other SIGINT (Ctrl-C). Each ends its workers, prints its table and writes
    its --json marked partial (nothing traced, both candidates not searched, the first ones
    being traced), then exits 143 or 130 as docs/search.md says."""
    script = tmp_path / "search_child.py"
    script.write_text(CHILD)
    stops = {"SIGTERM": 143, "SIGINT": 130}
    jsons = {how: tmp_path / f"{how}.json" for how in stops}
    children = {how: subprocess.Popen([sys.executable, str(script), str(jsons[how])],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for how in stops}
    try:
        everyone = {how: set() for how in stops}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                any(_is_worker(p) for p in pids) for pids in everyone.values()):
            time.sleep(0.3)   # the workers are spawned on the first submit
            for how, child in children.items():
                everyone[how] |= _descendants(child.pid)
                assert child.poll() is None, child.stdout.read().decode()
        assert all(any(_is_worker(p) for p in pids) for pids in everyone.values()), everyone
        time.sleep(1.0)   # the workers past their imports, in the stand-in trace
        for how in stops:
            everyone[how] |= _descendants(children[how].pid)
            children[how].send_signal(getattr(signal, how))
        output = {}
        for how, child in children.items():
            output[how] = child.communicate(timeout=60)[0].decode()
            assert child.returncode == stops[how], (how, output[how])
        deadline = time.monotonic() + 15
        left = lambda: {how: [p for p in pids if _alive(p)] for how, pids in everyone.items()}
        while time.monotonic() < deadline and any(left().values()):
            time.sleep(0.2)
        assert not any(left().values()), f"workers left behind: {left()}"
        for how in stops:
            d = json.loads(jsons[how].read_text())
            assert d["stopped"]["by"] == {"SIGTERM": "SIGTERM", "SIGINT": "Ctrl-C"}[how]
            _nothing_traced(d, output[how])
    finally:
        for child in children.values():
            for p in _descendants(child.pid) | {child.pid}:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            child.wait()


def _nothing_traced(d: dict, output: str) -> None:
    """A search stopped while its first candidates were in the stand-in trace: its JSON and
    table say so."""
    assert d["complete"] is False and d["ranked"] == [] and d["winner"] is None
    assert {u["label"] for u in d["not_searched"]} == {"FSDP 2, mb 2", "FSDP 2, mb 1, accumulate 2"}
    assert any(u["being_traced"] for u in d["not_searched"])
    # no trace, no bound: each could be the fastest
    assert all(u["could_enter_top"] and "bound_seconds" not in u for u in d["not_searched"])
    assert "Partial: stopped after" in output and \
        "0 traced, 0 ruled out, 2 not searched" in output
    assert "Traceback" not in output, output


def test_time_limit_ends_a_trace_in_this_process(tmp_path, monkeypatch):
    """--time-limit with the search in this process (--workers 1): the stand-in trace sleeps for
    two minutes, the limit (1.2 s) ends it in the middle, and the search prints and writes what
    it knows; no traced candidate fits, so it exits 1."""
    from typer.testing import CliRunner

    import tapescope.layout_search.runner as runner
    from tapescope.cli import app

    monkeypatch.setattr(runner, "evaluate", lambda *args: time.sleep(120))
    out = tmp_path / "s.json"
    began = time.monotonic()
    r = CliRunner().invoke(app, ["search", TINY, "--gpus", "2", "--gpu", "t4", "--global-batch",
                                 "4", "--seq", "64", "--pp", "1", "--tp", "1", "--checkpointing",
                                 "none", "--workers", "1", "--time-limit", "0.02", "--json",
                                 str(out), "-q"])
    assert time.monotonic() - began < 60, "the limit did not end the trace"
    assert r.exit_code == 1, r.output
    d = json.loads(out.read_text())
    assert d["stopped"]["by"] == "the time limit (1.2 s)"
    _nothing_traced(d, r.output)
    assert "No traced candidate fits yet" in r.output
    refused = CliRunner().invoke(app, ["search", TINY, "--gpus", "2", "--global-batch", "4",
                                       "--time-limit", "0"])
    assert refused.exit_code == 1 and refused.output.startswith("error: cannot read "
                                                                "--time-limit 0"), refused.output


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return "spawn_main" in f.read()
    except OSError:
        return False


def _worker_dies(*args):
    """A stand-in trace whose worker process dies (as one killed with the search's process group
    by a SIGTERM, or by the host running out of memory)."""
    os._exit(9)


def test_a_dead_worker_is_not_cached(tmp_path, monkeypatch):
    """A candidate whose worker died is an error of this run, not of the candidate: the search
    reports it, but its cache keeps no line for it, so a resumed search traces it again."""
    import tapescope
    import tapescope.layout_search.runner as runner
    from tapescope.errors import TapescopeError

    monkeypatch.setattr(runner, "evaluate", _worker_dies)   # pickled by name for the workers
    cache = tmp_path / "c.jsonl"
    try:
        result = tapescope.search(TINY, gpus=2, gpu="t4", global_batch=4, seq=64, pp=(1,),
                                  tp=(1,), checkpointing=("none",), workers=2, cache=str(cache))
    except TapescopeError as e:   # every candidate failed the same way
        assert "BrokenProcessPool" in str(e), e
    else:
        assert result.evaluated and all("BrokenProcessPool" in o.reason
                                        for o in result.evaluated)
    assert not cache.exists() or cache.read_text() == ""
