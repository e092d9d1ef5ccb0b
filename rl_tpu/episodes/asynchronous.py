"""Episodes that advance on their own (`episode.scheduling=async`, the default): an episode goes back to the engine
as soon as its own tool calls returned, and its calls go to the tools as soon as its turn ended, so the engine
batches whatever turns are ready and a slow call holds only its own episode.

One loop drives both sides: it queues the ready episodes' turns on the engine (vLLM's request-level API: each
engine step batches every turn under way), steps the engine, hands each finished turn's calls to the tool workers
(`ToolStream`: the workers run calls of all episodes at once, up to `max_calls_in_flight` in all), and between
engine steps takes the results that came back (before a step of few turns, for up to one step's time: `_gather`).
What a turn does to an episode is the same code as in lockstep (`EpisodeRunner`): ids, masks, logprobs, seeds per
turn (`turn_seed`: fixed by the episode, not by when its turn ran), truncation, instance routing, releases, failure
counting; the batch's rollouts come back in prompt and sample order whatever order the episodes ended in.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from rl_tpu.episodes.episode import Episode, TurnEngine

if TYPE_CHECKING:
    from rl_tpu.episodes.loop import EpisodeRunner
    from rl_tpu.episodes.tools import ToolStream

WAIT_S = 1.0  # the longest wait for tool results while the engine has nothing to run (a wait ends at an answer)


class AsyncScheduler:
    def __init__(self, max_calls_in_flight: int):
        self.max_calls_in_flight = max_calls_in_flight

    def play(self, runner: EpisodeRunner, episodes: list[Episode], engine: TurnEngine) -> None:
        stream = runner.tools.stream()
        try:
            _Play(runner, stream, engine, self.max_calls_in_flight).run(episodes)
        finally:
            stream.close()


class _Play:
    """One play of a batch's episodes: which are at the engine, waiting for a slot for their calls, or at the
    tools."""

    def __init__(self, runner: EpisodeRunner, stream: ToolStream, engine: TurnEngine, max_calls_in_flight: int):
        self.runner, self.stream, self.engine, self.bound = runner, stream, engine, max_calls_in_flight
        self.at_engine: dict[str, Episode] = {}  # request id -> episode
        self.calling: deque[Episode] = deque()  # its turn called tools: waiting for room under the bound
        self.at_tools: dict[int, Episode | None] = {}  # stream group -> its episode (None: releases)
        self.releasing: dict[int, list] = {}  # stream group -> the owners of its releases
        self.step_s = 0.0  # the engine's last step

    def run(self, episodes: list[Episode]) -> None:
        for episode in episodes:
            self._to_engine(episode)
        while self.at_engine or self.calling or self.at_tools:
            self._send_calls()
            if self.engine.busy():
                self._gather()
                start = time.perf_counter()
                finished = self.engine.step()
                self.step_s = time.perf_counter() - start
                for request, turn in finished:
                    episode = self.at_engine.pop(request)
                    if self.runner.take_turn(episode, turn):
                        self.calling.append(episode)
                    else:
                        self._release(episode)
            if self.at_tools:
                self._take_results(0.0 if self.engine.busy() else WAIT_S)

    def _gather(self) -> None:
        """Before a step of fewer turns than there are episodes at the tools, waits up to one step's time for
        results to come back and join it: an engine step costs about as much with few turns as with many (on CPU
        above all), so a step of a few turns while the rest are about to return wastes most of it."""
        deadline = time.perf_counter() + self.step_s
        while self.at_tools and len(self.at_engine) < len(self.at_tools) and time.perf_counter() < deadline:
            self._take_results(deadline - time.perf_counter())

    def _to_engine(self, episode: Episode) -> None:
        request = self.runner.request(episode)
        if request is None:  # no room left: ended
            self._release(episode)
        else:
            self.at_engine[self.engine.add(request)] = episode

    def _send_calls(self) -> None:
        """The waiting episodes' calls, in the order their turns ended, while they fit under the bound (one
        episode's calls at least, whatever their number)."""
        while self.calling:
            calls = self.runner.calls(self.calling[0])
            if self.stream.calls_in_flight and self.stream.calls_in_flight + len(calls) > self.bound:
                return
            self.at_tools[self.stream.submit(calls)] = self.calling.popleft()

    def _release(self, episode: Episode) -> None:
        """An ended episode's instances are released at once: its calls have all returned."""
        owners, ends = self.runner.releases([episode])
        if ends:
            group = self.stream.submit([], ends)
            self.at_tools[group], self.releasing[group] = None, owners

    def _take_results(self, timeout: float) -> None:
        for group, results, seconds in self.stream.poll(timeout):
            episode = self.at_tools.pop(group)
            if episode is None:
                self.runner.released(self.releasing.pop(group), results)
                continue
            self.runner.take_results(episode, results, seconds)
            if episode.done:
                self._release(episode)
            else:
                self._to_engine(episode)
