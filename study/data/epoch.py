"""The training epoch as seen by Ray Data augmentation tasks, so that an epoch's random draws depend on (seed, epoch).

Train workers set the epoch on a small actor before they start iterating an epoch; Ray Data starts executing the epoch
only once every worker has asked for it, so no task of the epoch can read a stale value. Tasks ask the actor once per
process and dataset execution (Ray Data numbers executions in the task's DataContext), not once per batch.
"""

from __future__ import annotations

import uuid

import ray


@ray.remote(num_cpus=0)
class EpochClock:
    def __init__(self):
        self._epoch = 0

    def set(self, epoch: int) -> int:
        self._epoch = int(epoch)
        return self._epoch

    def get(self) -> int:
        return self._epoch


_SEEN: dict[tuple[str, int], int] = {}


class EpochSource:
    """A picklable handle to the clock: `set` on the workers, `epoch()` inside Ray Data tasks."""

    def __init__(self):
        self.key = uuid.uuid4().hex
        self.clock = EpochClock.remote()

    def set(self, epoch: int) -> None:
        ray.get(self.clock.set.remote(epoch))

    def epoch(self) -> int:
        from ray.data import DataContext

        execution = getattr(DataContext.get_current(), "_execution_idx", None)
        if execution is None:  # a Ray Data without execution numbers: ask every time (slower, still exact)
            return ray.get(self.clock.get.remote())
        key = (self.key, execution)
        if key not in _SEEN:
            if len(_SEEN) > 64:
                _SEEN.clear()
            _SEEN[key] = ray.get(self.clock.get.remote())
        return _SEEN[key]
