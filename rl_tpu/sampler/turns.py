"""Who uses an engine next (`EngineTurns`): one call at a time, an install that is waiting before any generation
not yet started, so that which weights a batch gets follows from the order of the calls alone."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

import ray


class EngineTurns:
    """Who uses the engine next: one call at a time, an install that is waiting before any generation not yet started.

    Weight installs run in a concurrency group of their own, so a bundle is fetched and verified while
    the engine generates. An install takes its turn once the generations sent before it have ended
    (the earlier argument of Sampler.install), and the generations sent after it wait for it (the pool's after
    argument): which weights a batch gets follows from the order of the calls, never from timing, so an async
    run repeats.
    The waits have no deadline of their own: the controller's call deadline, which names this engine, bounds them.
    """

    def __init__(self):
        self._changed = threading.Condition()
        self._busy = False
        self._installs_waiting = 0

    @contextmanager
    def generation(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._busy and not self._installs_waiting)
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def install(self, earlier: list | None = None) -> Iterator[None]:
        """The engine's turn for an install, once the generations sent before it (earlier: ObjectRefs) ended:
        the wait is bounded by the controller's deadline on the install, which names the engine."""
        if earlier:
            ray.wait(earlier, num_returns=len(earlier))
        with self._changed:
            self._installs_waiting += 1
            self._changed.wait_for(lambda: not self._busy)
            self._installs_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._changed:
            self._busy = False
            self._changed.notify_all()
