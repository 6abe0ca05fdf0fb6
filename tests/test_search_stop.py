"""Stopping a search stops its worker processes: SIGTERM (a job scheduler, `kill`) and Ctrl-C
(SIGINT) end the search and the candidates its local workers are tracing, instead of leaving
them tracing for minutes after the search has gone (issue 35).

The workers here run a stand-in for the trace that sleeps for two minutes (the search submits
layout_search.runner.evaluate; the child script replaces it before the search starts), so a
worker left behind is still there when the test looks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent("""
    import sys, time
    import tapescope
    import tapescope.layout_search.runner as runner

    def slow_trace(*args):
        time.sleep(120)

    if __name__ == "__main__":
        runner.evaluate = slow_trace
        tapescope.search("zoo:llama:n_layers=1,dim=64,n_heads=4,max_seq_len=64", gpus=2,
                         gpu="t4", global_batch=4, seq=64, pp=(1,), tp=(1,),
                         checkpointing=("none",), workers=2)
        sys.exit(3)   # the search returned: it should not have
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
def test_sigterm_and_ctrl_c_stop_the_workers(tmp_path):
    """Two searches at once (each waits on its imports, so together they cost one's time): one
    gets SIGTERM, the other SIGINT (Ctrl-C)."""
    script = tmp_path / "search_child.py"
    script.write_text(CHILD)
    children = {sig: subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        everyone = {}
        for sig, child in children.items():
            deadline = time.monotonic() + 60
            workers: set = set()
            while time.monotonic() < deadline and not workers:  # spawned on the first submit
                time.sleep(0.3)
                workers = {p for p in _descendants(child.pid) if _is_worker(p)}
                assert child.poll() is None, child.stdout.read().decode()
            assert workers, "the search started no worker"
        time.sleep(1.0)   # the workers past their imports, in the stand-in trace
        for sig, child in children.items():
            everyone[sig] = _descendants(child.pid)
            child.send_signal(sig)
        for sig, child in children.items():
            assert child.wait(timeout=30) != 3, sig
        deadline = time.monotonic() + 15
        left = lambda: {sig: [p for p in pids if _alive(p)] for sig, pids in everyone.items()}
        while time.monotonic() < deadline and any(left().values()):
            time.sleep(0.2)
        assert not any(left().values()), f"workers left behind: {left()}"
    finally:
        for child in children.values():
            for p in _descendants(child.pid) | {child.pid}:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            child.wait()


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return "spawn_main" in f.read()
    except OSError:
        return False
