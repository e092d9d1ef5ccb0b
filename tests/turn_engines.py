"""Stand-in engines for the episode schedulers' unit tests (`rl_tpu.episodes.episode.TurnEngine`)."""

from __future__ import annotations

import time
from typing import Callable

from rl_tpu.episodes.episode import TurnOutput, TurnRequest


class BatchEngine:
    """A `TurnEngine` over `answer(requests) -> outputs`: each step answers every turn queued since the last one at
    once (a lockstep turn, or one engine step of episodes that advance on their own). Records each step's requests
    (`requests`) and the order turns were asked for (`asked`)."""

    def __init__(self, answer: Callable[[list[TurnRequest]], list[TurnOutput]]):
        self.answer = answer
        self.queued: list[tuple[str, TurnRequest]] = []
        self.requests: list[list[TurnRequest]] = []
        self.asked: list[TurnRequest] = []

    def add(self, request: TurnRequest) -> str:
        self.asked.append(request)
        self.queued.append((str(len(self.asked)), request))
        return self.queued[-1][0]

    def step(self) -> list[tuple[str, TurnOutput]]:
        batch, self.queued = self.queued, []
        self.requests.append([request for _, request in batch])
        outputs = self.answer([request for _, request in batch])
        return [(request_id, output) for (request_id, _), output in zip(batch, outputs, strict=True)]

    def busy(self) -> bool:
        return bool(self.queued)


class StepEngine:
    """A `TurnEngine` whose turns take several steps, as vLLM's: a turn queued while others are under way joins them
    (continuous batching). `answer(request) -> (output, steps)`; each step sleeps `step_s` seconds. Records the
    requests under way at each step (`steps`)."""

    def __init__(self, answer: Callable[[TurnRequest], tuple[TurnOutput, int]], step_s: float):
        self.answer, self.step_s = answer, step_s
        self.under_way: dict[str, list] = {}  # request id -> [request, its output, steps left]
        self.steps: list[list[TurnRequest]] = []
        self.added = 0

    def add(self, request: TurnRequest) -> str:
        self.added += 1
        self.under_way[str(self.added)] = [request, *self.answer(request)]
        return str(self.added)

    def step(self) -> list[tuple[str, TurnOutput]]:
        time.sleep(self.step_s)
        self.steps.append([request for request, _, _ in self.under_way.values()])
        for turn in self.under_way.values():
            turn[2] -= 1
        ended = [(request_id, turn[1]) for request_id, turn in self.under_way.items() if turn[2] == 0]
        for request_id, _ in ended:
            del self.under_way[request_id]
        return ended

    def busy(self) -> bool:
        return bool(self.under_way)


class RunStream:
    """A `ToolStream` stand-in over a fake ToolBox's `run(calls, ends)`: a group's results are made when it is
    submitted and come back `delay(calls)` seconds later (a poll waits up to its timeout for the next of them). One
    worker, busy while any group is out, uses `cores` of CPU all along (0: its calls wait)."""

    def __init__(self, run: Callable, delay: Callable[[list], float] = lambda calls: 0.0, cores: float = 0.0):
        self.run, self.delay, self.cores = run, delay, cores
        self.opened = time.perf_counter()
        self.waiting: dict[int, tuple[float, float, list]] = {}  # group -> (submitted, due, results)
        self.groups = 0
        self.closed = False

    @property
    def calls_in_flight(self) -> int:
        return sum(len(results) for _, _, results in self.waiting.values())

    def submit(self, calls: list, ends: list = ()) -> int:
        self.groups += 1
        results, _ = self.run(list(calls), list(ends))
        now = time.perf_counter()
        self.waiting[self.groups] = (now, now + self.delay(list(calls)), results)
        return self.groups

    def poll(self, timeout: float) -> list:
        if self.waiting:
            next_due = min(due for _, due, _ in self.waiting.values())
            time.sleep(max(0.0, min(timeout, next_due - time.perf_counter())))
        now, ended = time.perf_counter(), []
        for group, (submitted, due, results) in list(self.waiting.items()):
            if due <= now:
                del self.waiting[group]
                ended.append((group, results, now - submitted))
        return ended

    def cpu_seconds(self) -> float:
        return self.cores * (time.perf_counter() - self.opened)

    def busy_workers(self) -> int:
        return 1 if self.waiting else 0

    def close(self) -> None:
        self.closed = True
