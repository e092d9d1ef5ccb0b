"""The tools' side of an episode: verl tools in worker processes, each call with a deadline; results as text.

A call that fails (the tool raised, timed out, killed its worker, returned something that is not a
`ToolResponse` with string text, found its worker down because it could not be started again, or was asked for an
unknown tool or with bad JSON) answers the model with a short error text, as verl's agent loop does, and is
counted; the episode goes on. The calls of a tool with an instance per episode (`lifetime: episode`) all go to the
worker that holds it, and so does its release. Each worker runs up to `calls_per_worker` calls at once
(`rl_tpu.episodes.tool_worker`).

Only when more than `episode.max_tool_failure_rate` of a batch's tool calls fail, or its first calls all do, does
the run stop, with `ToolError` naming the tool that failed most and its first failure: the reward workers' rule
(`reward.max_failure_rate`). The model's own mistakes (an unknown tool, arguments that are not JSON, not an object,
miss a parameter the schema requires, or that the tool refuses as such) are not the tool's failures, and neither is
a call that found its episode's instance lost (the failure that lost it was counted).

A failed call also types its episode's outcome (`failure_outcome`): a tool's failure on arguments the model wrote
well is the environment's fault, not the model's (`tool_failure`, or `timeout` past its deadline, or `lost`); the
model's mistakes leave it scored, as the model reads why and the reward judges what it did next.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rl_tpu.cluster.call_deadlines import POOL_GRACE_S
from rl_tpu.cluster.worker_pool import WorkerLimits, WorkerPool, worker_environment
from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease, ToolSetup, ToolSources, ToolsReady
from rl_tpu.records import Outcome

log = logging.getLogger(__name__)


MODEL_ERRORS = ("unknown_tool", "bad_arguments")  # failed calls that are the model's fault, not the tool's
NOT_COUNTED = (*MODEL_ERRORS, "lost", "cancelled")  # failures the failure-rate stop leaves out


class ToolError(RuntimeError):
    """The tools could not be loaded, or too many of one tool's calls failed."""


@dataclass(frozen=True)
class ToolSettings:
    config_file: str | None
    function_tool_path: str | None
    num_workers: int
    timeout_s: float  # per call
    memory_mb: int | None
    max_response_chars: int  # verl's `max_tool_response_length`
    truncate_side: str = "middle"
    pass_env: tuple[str, ...] = ()
    max_failure_rate: float = EpisodeConfig.max_tool_failure_rate
    calls_per_worker: int = EpisodeConfig.tool_calls_per_worker


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    reward: float  # the step reward of `execute` plus `calc_reward` (0 for a failed call)
    failure: str | None = None  # the failure's kind, None when the call succeeded


def failure_outcome(kind: str | None) -> Outcome | None:
    """What a call's failure makes of its episode's outcome; None for a success or the model's own mistake."""
    if kind is None or kind in MODEL_ERRORS:
        return None
    return {"lost": Outcome.lost, "timeout": Outcome.timeout}.get(kind, Outcome.tool_failure)


def failure_text(call: ToolCall, kind: str, message: str) -> str:
    """What the model reads for a failed call: one line, not a traceback."""
    last = message.strip().splitlines()[-1] if message.strip() else kind
    if kind in MODEL_ERRORS:
        return last
    return f"Error executing tool {call.name!r}: {last}"


def tool_environment(settings: ToolSettings) -> dict[str, str]:
    """The reward workers' environment, with the folders of the tools YAML and the function-tool file first on the
    import path: a tool module beside them is found by its name, as verl finds one on the trainer's path."""
    env = worker_environment(list(settings.pass_env))
    folders = [str(Path(f).parent) for f in (settings.config_file, settings.function_tool_path) if f]
    env["PYTHONPATH"] = os.pathsep.join([*dict.fromkeys(folders), env["PYTHONPATH"]])
    return env


def failure_of(outcome: tuple | None) -> tuple[str, str] | None:
    """A worker outcome's failure as (kind, message) when the failure-rate stop counts it, else None."""
    if outcome is None or outcome[0] != "fail" or outcome[1] in NOT_COUNTED:
        return None
    return outcome[1], outcome[2]


@dataclass
class FailureTally:
    """One batch's tool calls and their failures (an instance's release counts as a call), for the failure-rate stop:
    judged over all of the batch's calls, as `reward.max_failure_rate` is over its samples."""

    max_rate: float
    calls: int = 0
    failures: Counter = field(default_factory=Counter)  # per tool
    first: dict[str, tuple[str, str]] = field(default_factory=dict)  # per tool: its first failure's kind, message
    stopped: bool = False  # the stop was raised: what still runs (the releases) is not judged again

    def add(self, name: str, outcome: tuple) -> None:
        if outcome[0] == "fail" and outcome[1] in NOT_COUNTED:
            return
        self.calls += 1
        if failure := failure_of(outcome):
            self.failures[name] += 1
            self.first.setdefault(name, failure)

    def first_all_failed(self, names: list[str], outcomes: list, at_least: int) -> bool:
        """The batch's first `at_least` calls (with these answers) all failed: a tool that fails every call stops the
        run after a few timeouts, not after the batch (64 calls: half an hour at 10 s each). Judged as answers
        arrive, unless the rate is 1."""
        so_far = FailureTally(self.max_rate, self.calls, Counter(self.failures), dict(self.first))
        for name, outcome in zip(names, outcomes):
            if outcome is not None:
                so_far.add(name, outcome)
        return self.max_rate < 1.0 and so_far.calls >= at_least and so_far.failed == so_far.calls

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def too_many(self) -> bool:
        return self.failed > self.max_rate * self.calls

    def error(self, where: str, why: str) -> ToolError:
        """The stop, naming the tool that failed most and its first failure."""
        self.stopped = True
        name, count = self.failures.most_common(1)[0]
        kind, message = self.first[name]
        return ToolError(
            f"{self.failed} of the {self.calls} tool calls of this batch failed, {why} (episode.max_tool_failure_rate"
            f"={self.max_rate:g}); {count} of them of tool {name!r} ({where}), whose first failure ({kind}) was:\n"
            f"{message}"
        )


class ToolBox:
    def __init__(self, settings: ToolSettings):
        self.settings = settings
        limits = WorkerLimits(settings.memory_mb, math.ceil(settings.timeout_s) + 1)
        self.where = where = " and ".join(p for p in (settings.config_file, settings.function_tool_path) if p)
        sources = ToolSources(settings.config_file, settings.function_tool_path)
        setup = ToolSetup(
            sources, settings.timeout_s, settings.calls_per_worker, settings.max_response_chars, settings.truncate_side
        )
        self.pool = WorkerPool(
            "rl_tpu.episodes.tool_worker",
            (setup, limits),
            settings.num_workers,
            tool_environment(settings),
            settings.timeout_s + POOL_GRACE_S,  # a call's own deadline is kept in its worker
            f"tool worker for {where}",
            ToolError,
        )
        ready: ToolsReady = self.pool.detail
        self.schemas = ready.schemas  # name -> OpenAI function schema, for chat templates
        self.per_episode = ready.per_episode  # the tools with an instance per episode
        self.tally = FailureTally(settings.max_failure_rate)

    def begin_batch(self) -> None:
        """The failure-rate stop judges each batch of episodes on its own, as the reward workers' does."""
        self.tally = FailureTally(self.settings.max_failure_rate)

    def end_batch(self) -> None:
        """Raises `ToolError` when more than `episode.max_tool_failure_rate` of the batch's tool calls failed."""
        if not self.tally.stopped and self.tally.too_many():
            raise self.tally.error(self.where, "more than the rate allowed")

    def run(self, calls: list[ToolCall], ends: Sequence[ToolRelease] = ()) -> tuple[list[ToolResult], float]:
        """Every call's result, in order, then each release's (its reward `calc_reward`'s), and the seconds they
        took; all run at once: spread over the workers, up to `calls_per_worker` at once in each. Raises `ToolError`
        as soon as the batch's first calls all failed (the rest of the turn is not run)."""
        if not calls and not ends:
            return [], 0.0
        start = time.perf_counter()
        items = [*calls, *ends]
        names, at_least = [item.name for item in items], self.first_calls
        outcomes = self.pool.run(
            items,
            batched=False,
            failed=_failed,
            shares_per_worker=math.ceil(len(items) / (self.pool.size * self.settings.calls_per_worker)),
            give_up=None if self.tally.stopped else lambda o: self.tally.first_all_failed(names, o, at_least),
            route=_route,
            concurrent=True,
        )
        for name, outcome in zip(names, outcomes):
            self.tally.add(name, outcome)
        self.check_first_calls()
        return [_result(item, outcome) for item, outcome in zip(items, outcomes)], time.perf_counter() - start

    @property
    def first_calls(self) -> int:
        """How many first calls of a batch, all failed, stop it (`FailureTally.first_all_failed`)."""
        return max(2 * self.pool.size, 8)

    def check_first_calls(self) -> None:
        if not self.tally.stopped and self.tally.first_all_failed([], [], self.first_calls):
            raise self.tally.error(self.where, "every one of them")

    def stream(self) -> ToolStream:
        """Calls submitted while others run, each group answered as its last call ends (`ToolStream`)."""
        return ToolStream(self)

    def close(self) -> None:
        self.pool.close()


def _failed(kind: str, message: str) -> tuple:
    return ("fail", kind, message)


def _route(item: ToolCall | ToolRelease) -> int | None:
    """A per-episode instance's calls and release go to the worker that holds it."""
    return zlib.crc32(item.episode.encode()) if item.episode is not None else None


def _result(item: ToolCall | ToolRelease, outcome: tuple) -> ToolResult:
    if outcome[0] == "ok":
        _, text, reward = outcome
        return ToolResult(text, reward)  # cut in the worker
    _, kind, message = outcome
    text = failure_text(item, kind, message)
    log.warning("tool %s failed (%s): %s", item.name, kind, text)
    return ToolResult(text, 0.0, kind)


@dataclass
class _Group:
    number: int
    positions: list[int]
    start: float
    left: int


class ToolStream:
    """Tool calls of episodes that advance on their own: each group (one episode's turn of calls, or its releases)
    is submitted when it is ready and runs at once beside the others (the workers read new calls while they run
    earlier ones), and comes back when its own last call ended, however long the others take. The deadlines,
    instance routing, failure counting and the failure-rate stop are the batch's, as in `ToolBox.run`. One stream at
    a time, never beside `ToolBox.run`; `close` it (what is still running is cancelled)."""

    def __init__(self, box: ToolBox):
        self.box = box
        self.job = box.pool.stream(_failed, _route)
        self.groups: dict[int, _Group] = {}
        self.owner: dict[int, int] = {}  # position -> group

    @property
    def calls_in_flight(self) -> int:
        return len(self.owner)

    def submit(self, calls: Sequence[ToolCall], ends: Sequence[ToolRelease] = ()) -> int:
        """Sends the group's calls, then its releases; returns its number (`poll` names it when it ends)."""
        number = len(self.groups)
        positions = self.job.add([*calls, *ends])
        self.groups[number] = _Group(number, positions, time.perf_counter(), len(positions))
        self.owner.update((position, number) for position in positions)
        return number

    def poll(self, timeout: float) -> list[tuple[int, list[ToolResult], float]]:
        """The groups that ended, waiting up to `timeout` seconds for answers: each with its results in order and
        the seconds it took. Raises `ToolError` as soon as the batch's first calls all failed."""
        if self.box.pool.closed:
            raise ToolError(f"the tool workers for {self.box.where} were closed")
        if not self.job.finished:
            self.job.step(timeout)
        ended = []
        for position in self.job.take_answered():
            self.box.tally.add(self.job.items[position].name, self.job.outcomes[position])
            group = self.groups[self.owner.pop(position)]
            group.left -= 1
            if not group.left:
                ended.append(group)
        if not self.box.tally.stopped and self.box.tally.first_all_failed([], [], self.box.first_calls):
            self.job.cancel("not run: the batch was given up")
            self.box.check_first_calls()
        now, items, outcomes = time.perf_counter(), self.job.items, self.job.outcomes
        return [(g.number, [_result(items[p], outcomes[p]) for p in g.positions], now - g.start) for g in ended]

    def cpu_seconds(self) -> float:
        """The tool workers' CPU time so far (`WorkerPool.cpu_seconds`)."""
        return self.box.pool.cpu_seconds()

    def busy_workers(self) -> int:
        """How many tool workers have calls out now (`WorkerPool.busy_workers`)."""
        return self.box.pool.busy_workers()

    def close(self) -> None:
        self.job.close()
