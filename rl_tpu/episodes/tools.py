"""The tools' side of an episode: verl tools in worker processes, each call with a deadline; results as text.

A call that fails (the tool raised, timed out, killed its worker, returned something that is not a
`ToolResponse` with string text, or was asked for an unknown tool or with bad JSON) answers the model with a
short error text, as verl's agent loop does, and is counted; the episode goes on. The calls of a tool with an
instance per episode (`lifetime: episode`) all go to the worker that holds it, and so does its release.
"""

from __future__ import annotations

import logging
import math
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rl_tpu.cluster.worker_pool import WorkerLimits, WorkerPool, worker_environment
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease, ToolSources, ToolsReady

log = logging.getLogger(__name__)


MODEL_ERRORS = ("unknown_tool", "bad_arguments")  # failed calls that are the model's fault, not the tool's


class ToolError(RuntimeError):
    """The tools could not be loaded."""


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


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    reward: float  # the step reward of `execute` plus `calc_reward` (0 for a failed call)
    failure: str | None = None  # the failure's kind, None when the call succeeded


def truncate(text: str, limit: int, side: str) -> str:
    """`text` cut to `limit` characters with verl's markers (its `tool_response_truncate_side`)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


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


class ToolBox:
    def __init__(self, settings: ToolSettings):
        self.settings = settings
        limits = WorkerLimits(settings.memory_mb, math.ceil(settings.timeout_s) + 1)
        where = " and ".join(p for p in (settings.config_file, settings.function_tool_path) if p)
        self.pool = WorkerPool(
            "rl_tpu.episodes.tool_worker",
            (ToolSources(settings.config_file, settings.function_tool_path), limits),
            settings.num_workers,
            tool_environment(settings),
            settings.timeout_s,
            f"tool worker for {where}",
            ToolError,
        )
        ready: ToolsReady = self.pool.detail
        self.schemas = ready.schemas  # name -> OpenAI function schema, for chat templates
        self.per_episode = ready.per_episode  # the tools with an instance per episode

    def run(self, calls: list[ToolCall], ends: Sequence[ToolRelease] = ()) -> tuple[list[ToolResult], float]:
        """Every call's result, in order, then each release's (its reward `calc_reward`'s), and the seconds they
        took; all run at once across the workers."""
        if not calls and not ends:
            return [], 0.0
        start = time.perf_counter()
        items = [*calls, *ends]
        outcomes = self.pool.run(
            items,
            batched=False,
            failed=lambda kind, message: ("fail", kind, message),
            shares_per_worker=len(items),
            route=lambda item: zlib.crc32(item.episode.encode()) if item.episode is not None else None,
        )
        results = []
        for call, outcome in zip(items, outcomes):
            if outcome[0] == "ok":
                _, text, reward = outcome
                results.append(
                    ToolResult(truncate(text, self.settings.max_response_chars, self.settings.truncate_side), reward)
                )
                continue
            _, kind, message = outcome
            text = failure_text(call, kind, message)
            log.warning("tool %s failed (%s): %s", call.name, kind, text)
            results.append(ToolResult(text, 0.0, kind))
        return results, time.perf_counter() - start

    def close(self) -> None:
        self.pool.close()
