"""Stand-in engines for the episode schedulers' unit tests (`rl_tpu.episodes.episode.TurnEngine`)."""

from __future__ import annotations

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


class RunStream:
    """A `ToolStream` stand-in over a fake ToolBox's `run(calls, ends)`: a group's results are made when it is
    submitted and come back after `delay(calls)` polls, whatever the poll's timeout (ordering, not timing)."""

    def __init__(self, run: Callable, delay: Callable[[list], int] = lambda calls: 1):
        self.run, self.delay = run, delay
        self.waiting: dict[int, list] = {}  # group -> [polls left, results]
        self.groups = 0
        self.closed = False

    @property
    def calls_in_flight(self) -> int:
        return sum(len(results) for _, results in self.waiting.values())

    def submit(self, calls: list, ends: list = ()) -> int:
        self.groups += 1
        results, _ = self.run(list(calls), list(ends))
        self.waiting[self.groups] = [self.delay(list(calls)), results]
        return self.groups

    def poll(self, timeout: float) -> list:
        ended = []
        for group, entry in list(self.waiting.items()):
            entry[0] -= 1
            if entry[0] <= 0:
                ended.append((group, self.waiting.pop(group)[1], 0.0))
        return ended

    def close(self) -> None:
        self.closed = True
