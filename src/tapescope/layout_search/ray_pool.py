"""Candidates on a Ray cluster: `tapescope search ... --ray ADDRESS` (`pip install
'tapescope[cluster]'`). Each candidate is one Ray task running layout_search.evaluate.evaluate;
an ObjectRef's `.future()` is a concurrent.futures.Future, so the search loop waits on Ray tasks and
local processes alike."""

from __future__ import annotations

from ..errors import TapescopeError

__all__ = ["RayPool"]


class RayPool:
    def __init__(self, address: str, slots: int | None = None):
        try:
            import ray
        except ImportError:
            raise TapescopeError("--ray needs Ray: pip install 'tapescope[cluster]' (or pip "
                                 "install ray)") from None
        self.ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            try:
                # "local" starts a Ray instance in this process's machine; else a cluster address
                ray.init(address=None if address == "local" else address,
                         include_dashboard=False, log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise TapescopeError(f"cannot reach the Ray cluster at {address!r} ({e}); start "
                                     "one with `ray start --head` or give its address") from None
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = slots or max(1, cpus)
        self.name = f"Ray at {address} ({self.slots} workers)"
        self._task = None

    def submit(self, fn, *args):
        if self._task is None:
            self._task = self.ray.remote(num_cpus=1)(fn)
        return self._task.remote(*args).future()

    def close(self, abort: bool = False) -> None:
        if self._started:   # shutting down the instance it started ends its tasks too
            self.ray.shutdown()
