"""One run of a `WorkerPool` (`PoolRun`): its items in shares, sent as workers free up (or at once, to workers that
run items concurrently), their answers read, a worker that times out or dies replaced and its items failed.

`WorkerPool.run` drives one to its end; `WorkerPool.stream` hands one to a caller that adds items while it runs and
advances it between other work (the episodes' scheduler: tool calls of episodes that advance on their own).
"""

from __future__ import annotations

import math
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable


def _shares(places: int, items: list, batched: bool, shares_per_worker: int, route, offset: int = 0):
    """The items' positions (from `offset`) in shares: a queue any worker takes from, and one of its own per place."""
    shares = places * (1 if batched else shares_per_worker)
    size = max(1, math.ceil(len(items) / shares))
    anyone: list[int] = []
    pinned: list[list[int]] = [[] for _ in range(places)]
    for position, item in enumerate(items, start=offset):
        worker = route(item) if route else None
        (anyone if worker is None else pinned[worker % places]).append(position)

    def cut(positions: list[int]) -> deque:
        return deque(positions[start : start + size] for start in range(0, len(positions), size))

    return cut(anyone), [cut(positions) for positions in pinned]


class PoolRun:
    """Items and their outcomes (None until answered); see `WorkerPool.run` for the arguments."""

    def __init__(
        self,
        pool: Any,  # the `WorkerPool` (which imports this module)
        batched: bool,
        failed: Callable[[str, str], Any],
        shares_per_worker: int,
        give_up: Callable[[list], bool] | None,
        route: Callable[[Any], int | None] | None,
        concurrent: bool,
        stream: bool = False,
    ):
        self.pool, self.batched, self.failed, self.shares_per_worker = pool, batched, failed, shares_per_worker
        self.give_up, self.route, self.concurrent, self.stream = give_up, route, concurrent, stream
        self.items: list = []
        self.outcomes: list = []
        self.queue: deque = deque()
        self.own: list[deque] = [deque() for _ in range(pool.size)]
        self.done = 0
        self.given_up = False
        self.answered: list[int] = []  # positions answered since the caller last took them (`take_answered`)
        pool.running = True  # until `close`: a `WorkerPool.close` meanwhile kills the workers and leaves them to it

    @property
    def finished(self) -> bool:
        return self.done >= len(self.items)

    def add(self, items: list) -> list[int]:
        """Queues `items`; returns their positions."""
        start = len(self.items)
        self.items += items
        self.outcomes += [None] * len(items)
        queue, own = _shares(len(self.own), items, self.batched, self.shares_per_worker, self.route, start)
        self.queue.extend(queue)
        for mine, new in zip(self.own, own):
            mine.extend(new)
        return list(range(start, len(self.items)))

    def take_answered(self) -> list[int]:
        answered, self.answered = self.answered, []
        return answered

    def _set(self, positions, outcome: Any) -> None:
        for position in positions:
            self.outcomes[position] = outcome
            self.answered.append(position)
            self.done += 1

    def _fail_all(self, source: deque, outcome: Any) -> None:
        while source:
            self._set(source.popleft(), outcome)

    def _dispatch(self) -> None:
        """Sends queued shares to the workers that take them; a place that is down fails its own at once."""
        pool = self.pool
        for place, own in enumerate(self.own):
            down = pool.down_at(place)
            if down is not None and (own or self.queue) and down.due():
                pool._replace(place)
                down = pool.down_at(place)
            if down is not None:  # its pinned items cannot wait for it
                self._fail_all(own, self.failed("unavailable", down.message(pool.what)))
                continue
            worker = pool.workers[place]
            if self.stream:  # its own at once; the shared queue below, spread over the workers
                while own:
                    pool._send(worker, own, self.items, self.batched)
            elif (own or self.queue) and not worker.in_flight:
                pool._send(worker, own or self.queue, self.items, self.batched)
        while self.stream and self.queue and pool.live:
            # to the least loaded worker: a worker that took the whole queue would run CPU-bound calls one by one
            # while the others idle
            pool._send(min(pool.live, key=lambda w: len(w.in_flight)), self.queue, self.items, self.batched)

    def step(self, timeout: float) -> None:
        """Sends what is queued, then waits up to `timeout` seconds (less when a worker's deadline comes first) for
        answers and reads them; fails and replaces a worker past its deadline or dead."""
        pool = self.pool
        self._dispatch()
        busy = [w for w in pool.live if w.in_flight]
        if not busy:
            if self.queue:  # the rest is in the shared queue and every place is down
                down = next(pool.down_at(p) for p in range(pool.size) if pool.down_at(p) is not None)
                self._fail_all(self.queue, self.failed("unavailable", down.message(pool.what)))
            return
        remaining = min(min(w.deadline for w in busy) - time.monotonic(), timeout)
        for inbox in wait([w.inbox for w in busy], timeout=max(0.0, remaining)):
            worker = next(w for w in busy if w.inbox is inbox)
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                if pool.closed:  # killed by close(): nothing to replace
                    break
                code = worker.process.wait()
                lost = pool._lose(worker, self.batched or self.concurrent)
                self._set(lost, self.failed("crash", f"the worker died (exit code {code})"))
                continue
            for position, outcome in message:
                worker.in_flight.remove(position)
                self._set([position], outcome)
            worker.deadline = time.monotonic() + pool.timeout_s
        for worker in [w for w in busy if w.in_flight and time.monotonic() > w.deadline and not pool.closed]:
            if worker.inbox.poll():  # it answered while another worker's replacement started: read that first
                continue
            lost = pool._lose(worker, self.batched or self.concurrent)
            self._set(lost, self.failed("timeout", f"no answer within {pool.timeout_s:g} s"))
        if self.give_up is not None and not self.finished and self.give_up(self.outcomes):
            self.cancel("not run: the batch was given up")

    def cancel(self, why: str) -> None:
        """Every item without an answer fails as "cancelled"; the busy workers are stopped and replaced."""
        self.given_up = True
        self.pool._cancel()
        self.queue.clear()
        for own in self.own:
            own.clear()
        self._set([p for p, o in enumerate(self.outcomes) if o is None], self.failed("cancelled", why))

    def close(self) -> None:
        """Ends the run: what is still out is cancelled; the workers of a pool closed meanwhile are reaped."""
        if not self.finished and not self.pool.closed:
            self.cancel("not run: the run ended")
        self.pool.running = False
        if self.pool.closed:  # closed meanwhile: its workers were killed; reap them here
            self.pool._stop_all()

    def ending(self) -> list:
        """The outcomes, those a closed pool never answered cancelled."""
        if self.pool.closed:
            cancelled = self.failed("cancelled", "not run: the pool was closed")
            return [cancelled if o is None else o for o in self.outcomes]
        return self.outcomes
