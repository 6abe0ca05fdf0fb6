"""What code running inside a backward asks the C++ autograd engine, answered by tapescope's engine.

Hooks that run during backward talk to the engine's current GraphTask through three entry points:
- `Variable._execution_engine.queue_callback(fn)`: run `fn` once every node has run (FSDP2's
  root post-backward, DDP's reducer finalisation, ModuleTracker);
- `_current_graph_task_id()` (torch_compat.graph_task_queries): -1 outside a backward (FSDP2's `is_bw()`, which decides
  whether a forward is a recomputation under activation checkpointing; torch.utils.checkpoint
  keys its recomputation by it);
- `_will_engine_execute_node(node)`: whether the running backward reaches a node
  (multi-grad hooks).
With `PythonEngine` running the graph, the C++ engine has no GraphTask: queue_callback raises
"Final callbacks can only be installed during backward pass" and the id is -1. So while our
engine runs a backward, these three answer for it. They are patched for the duration of that
backward only (`standing_in`) and restored after; nothing else changes.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager

from torch.autograd.variable import Variable

from ..torch_compat import graph_task_queries, patched

__all__ = ["GraphTask", "standing_in"]

_ids = itertools.count(1 << 40)  # far from the C++ engine's own ids, which count from 0


class GraphTask:
    """One backward run by the Python engine: its id, the nodes it executes, its final callbacks.

    dependencies(roots) -> {node: count} gives the nodes reachable from `roots` (they all run);
    it is walked only if a hook asks whether a node will run."""

    def __init__(self, roots: list, dependencies):
        self.id = next(_ids)
        self.roots, self._dependencies = list(roots), dependencies
        self._nodes = None
        self.final_callbacks: list = []

    @property
    def nodes(self) -> set:
        if self._nodes is None:
            self._nodes = set(self._dependencies(self.roots)) | set(self.roots)
        return self._nodes

    def run_final_callbacks(self) -> None:
        """GraphTask::exec_post_processing: callbacks run in order; one may queue more."""
        i = 0
        while i < len(self.final_callbacks):
            self.final_callbacks[i]()
            i += 1
        self.final_callbacks.clear()


class _EngineProxy:
    """`Variable._execution_engine` while a Python-engine backward runs: queue_callback goes to
    our GraphTask; everything else to the real engine."""

    def __init__(self, real, task: GraphTask):
        self._real, self._task = real, task

    def queue_callback(self, callback) -> None:
        self._task.final_callbacks.append(callback)

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextmanager
def standing_in(task: GraphTask):
    """Answer the C++ engine's GraphTask queries for `task` while the block runs."""
    real_engine = Variable.__dict__["_execution_engine"]
    engine, (id_name, will_name) = graph_task_queries()

    def will_execute(node):
        return node is not None and node in task.nodes

    with patched(Variable, _execution_engine=_EngineProxy(real_engine, task)), \
            patched(engine, **{id_name: lambda: task.id, will_name: will_execute}):
        yield task
