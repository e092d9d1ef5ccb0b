"""Episodes that advance on their own (`episode.scheduling=async`): an episode goes back to the engine
as soon as its own tool calls returned, and its calls go to the tools as soon as its turn ended, so the engine
batches whatever turns are ready and a slow call holds only its own episode.

One loop drives both sides: it queues the ready episodes' turns on the engine (vLLM's request-level API: each
engine step batches every turn under way), steps the engine, hands each finished turn's calls to the tool workers
(`ToolStream`: the workers run calls of all episodes at once, up to `max_calls_in_flight` in all), and takes the
results that came back between engine steps. An episode whose calls came back joins the turns under way at once
(continuous batching: nobody waits for anybody), except on vLLM's CPU engine while its tools compute (`_ToolLoad`,
their CPU time while calls are out; a remote environment, a sandbox or a search waits): then it joins the next
round. Between rounds the loop waits for the episodes at the tools (`_gather`), since a round competes with the
tools for the cores and an engine step costs about as much for a few turns as for many; a straggler joins a later
round instead of holding every episode, as it does in lockstep.

What a turn does to an episode is the same code as in lockstep (`EpisodeRunner`): ids, masks, logprobs, seeds per
turn (`turn_seed`: fixed by the episode, not by when its turn ran), truncation, instance routing, releases, failure
counting; the batch's rollouts come back in prompt and sample order whatever order the episodes ended in.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

from rl_tpu.episodes.episode import Episode, TurnEngine

if TYPE_CHECKING:
    from rl_tpu.episodes.loop import EpisodeRunner
    from rl_tpu.episodes.tools import ToolStream

COMPUTING_CORES = 0.5  # a tool worker with calls out that takes this much of a core (or more) computes
LOAD_WINDOW_S = 0.25  # how much recent time with calls out that is read over (psutil counts 10 ms clock ticks)
SAMPLE_S = 0.02  # the shortest span between two readings of the workers' CPU time
WAIT_S = 1.0  # the longest wait for tool results while the engine has nothing to run (a wait ends at an answer)
POLL_S = 0.1  # the longest poll of a wait between rounds: the tools' load is read again after it


class AsyncScheduler:
    """`engine_on_cpu`: the engine's steps compute on the host's cores (vLLM's CPU engine), so they compete with
    tools that compute; an accelerator's engine takes every turn as soon as it is ready, whatever the tools do."""

    def __init__(self, max_calls_in_flight: int, engine_on_cpu: bool = True):
        self.max_calls_in_flight, self.engine_on_cpu = max_calls_in_flight, engine_on_cpu

    def play(self, runner: EpisodeRunner, episodes: list[Episode], engine: TurnEngine) -> None:
        stream = runner.tools.stream()
        try:
            _Play(runner, stream, engine, self.max_calls_in_flight, self.engine_on_cpu).run(episodes)
        finally:
            stream.close()


class _ToolLoad:
    """Whether the tool workers wait for their calls (a remote environment, a sandbox, a search) rather than
    compute: the CPU time a worker with calls out took over the last `LOAD_WINDOW_S` in which calls were out, under
    half a core. Until that much time was seen they count as computing (rounds: the careful choice on a CPU host)."""

    def __init__(self, stream: ToolStream):
        self.stream = stream
        self.last = (time.perf_counter(), stream.cpu_seconds(), 0)  # when, CPU seconds, busy workers then
        self.spans: deque[tuple[float, float, float]] = deque()  # (wall, wall x busy workers, CPU) seconds
        self.waiting = False

    def tools_wait(self) -> bool:
        now = time.perf_counter()
        then, cpu_then, busy = self.last
        if now - then < SAMPLE_S:
            return self.waiting
        cpu, busy_now = self.stream.cpu_seconds(), self.stream.busy_workers()
        if busy and busy_now:  # calls were out at both readings: most likely all along
            self.spans.append((now - then, (now - then) * min(busy, busy_now), cpu - cpu_then))
        self.last = (now, cpu, busy_now)
        wall = sum(span[0] for span in self.spans)
        while self.spans and wall - self.spans[0][0] >= LOAD_WINDOW_S:
            wall -= self.spans.popleft()[0]
        if wall >= LOAD_WINDOW_S:
            per_worker = sum(span[2] for span in self.spans) / sum(span[1] for span in self.spans)
            self.waiting = per_worker < COMPUTING_CORES
        return self.waiting


class _Play:
    """One play of a batch's episodes: which are at the engine, waiting for a slot for their calls, or at the
    tools."""

    def __init__(
        self, runner: EpisodeRunner, stream: ToolStream, engine: TurnEngine, max_calls_in_flight: int, on_cpu: bool
    ):
        self.runner, self.stream, self.engine, self.bound = runner, stream, engine, max_calls_in_flight
        self.load, self.engine_on_cpu = _ToolLoad(stream), on_cpu
        self.at_engine: dict[str, Episode] = {}  # request id -> episode
        self.ready: list[Episode] = []  # its calls returned: it joins the engine at once or with the next round
        self.calling: deque[Episode] = deque()  # its turn called tools: waiting for room under the bound
        self.at_tools: dict[int, Episode | None] = {}  # stream group -> its episode (None: releases)
        self.releasing: dict[int, list] = {}  # stream group -> the owners of its releases
        self.call_s: list[float] = []  # how long this batch's tool turns took
        self.round_s = 0.0  # the engine's last round: from its turns' start until the last of them ended
        self.round_start = 0.0
        self.answered_at = 0.0  # when an episode's tool calls last came back

    def run(self, episodes: list[Episode]) -> None:
        self.ready = list(episodes)
        while self.at_engine or self.ready or self.calling or self.at_tools:
            self._send_calls()
            if self.engine.busy():
                for request, turn in self.engine.step():
                    episode = self.at_engine.pop(request)
                    if self.runner.take_turn(episode, turn):
                        self.calling.append(episode)
                    else:
                        self._release(episode)
                joins = self._joins_at_once()  # read before the results: until now calls were out
                self._take_results(0.0)
                if joins and self.ready:  # the engine takes ready turns as they come
                    self._start_ready()
                if not self.engine.busy():
                    self.round_s = time.perf_counter() - self.round_start
                continue
            self._gather()
            self.round_start = time.perf_counter()
            self._start_ready()

    def _joins_at_once(self) -> bool:
        """Whether a returned episode's turn starts at once, beside the turns under way (continuous batching):
        unless the engine computes on the CPU that the tools compute on too (then it waits for the next round)."""
        return not self.engine_on_cpu or self.load.tools_wait()

    def _start_ready(self) -> None:
        for episode in self.ready:
            self._to_engine(episode)
        self.ready = []

    def _playing_at_tools(self) -> int:
        return sum(episode is not None for episode in self.at_tools.values())

    def _gather(self) -> None:
        """Between rounds, while the tools compute beside a CPU engine, waits for the episodes at the tools: until
        all are back, or, after the first is back, for the longer of a typical tool turn of this batch (the median
        so far) and the engine's last round, and past that for answers that keep coming within a round's time of
        each other, as lockstep would: a round started sooner competes with the tools for the CPU, and an engine
        step on CPU costs about as much for a few turns as for many. A straggler (a call slower than that) joins a
        later round instead of holding every episode, as it does in lockstep. Otherwise the round starts with the
        first answer, and later ones join it as they come."""
        if not self.ready and self.at_tools:  # nothing to run: the first answer (or release) that comes back
            self._take_results(WAIT_S)
        if self.calling:
            return  # calls wait for room under the bound: the round starts without them
        typical = statistics.median(self.call_s) if self.call_s else WAIT_S
        deadline = time.perf_counter() + max(typical, self.round_s)
        while self._playing_at_tools() and not self._joins_at_once():
            until = max(deadline, self.answered_at + self.round_s)
            if time.perf_counter() >= until:
                return
            self._take_results(min(until - time.perf_counter(), POLL_S))

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
            self.call_s.append(seconds)
            self.answered_at = time.perf_counter()
            self.runner.take_results(episode, results, seconds)
            if episode.done:
                self._release(episode)
            else:
                self.ready.append(episode)
