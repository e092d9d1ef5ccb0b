"""A tool worker process: loads verl's tools once (a tools YAML of `BaseTool` subclasses, and/or a file of
`@function_tool` functions), then runs the calls it is sent.

Started by `rl_tpu.episodes.tools.ToolBox` through `rl_tpu.cluster.worker_pool` as
``python -m rl_tpu.episodes.tool_worker READ_FD WRITE_FD``. A `BaseTool` call runs its life cycle as verl's
agent loop does (``create(create_kwargs=...)``, ``execute``, then ``calc_reward`` and ``release`` on the same
instance); a function tool is called with the arguments. Every outcome is a message: ``("ok", text, reward)``
or ``("fail", kind, message)`` with kind ``unknown_tool``, ``bad_arguments``, ``exception``, ``invalid`` or
``lost``.

A `BaseTool` whose YAML config says ``lifetime: episode`` keeps one instance per episode instead (a stateful
environment: a game, a shell, a database): its episode's first call creates it, every call of that episode runs
``execute`` on it (the pool sends them all to this worker), and a `ToolRelease` at the episode's end asks
``calc_reward`` once and releases it. A call for an instance this worker does not hold, though an earlier call of
the episode succeeded, fails as ``lost`` (the worker was replaced after a crash or timeout: its state is gone).

It speaks `rl_tpu.cluster.worker_pool`'s protocol (bounded memory and CPU seconds, death with its parent): its
setup is the `ToolSources`, its ready detail a `ToolsReady` (the tools' OpenAI schemas by name, and which keep an
instance per episode), and it answers item by item.
"""

from __future__ import annotations

import json
import math
import numbers
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Iterator

from rl_tpu.cluster.worker_pool import serve


@dataclass(frozen=True)
class ToolSources:
    config_file: str | None  # verl's tools YAML (`tools_config_file`)
    function_tool_path: str | None  # a .py file of `@function_tool` functions


LIFETIMES = ("call", "episode")  # a BaseTool's `lifetime` config key: an instance per call, or per episode


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON, as the parser read it
    create_kwargs: dict  # the example's `extra_info.tools_kwargs[name].create_kwargs` (verl's convention)
    episode: str | None = None  # the episode's key, for a tool with an instance per episode
    may_create: bool = True  # no earlier call of this tool in the episode succeeded: a missing instance is made


@dataclass(frozen=True)
class ToolRelease:
    """The end of an episode's instance of a per-episode tool."""

    name: str
    episode: str
    held: bool = False  # a call of the episode succeeded: the worker holds its instance, or it was lost


@dataclass
class ToolWorker:
    tools: dict[str, Any]
    instances: dict[tuple[str, str], Any]  # (episode, tool name) -> instance id, for per-episode tools


def lifetime(tool: Any) -> str:
    """A tool's `lifetime` config key (function tools have none: an instance per call)."""
    value = (getattr(tool, "config", None) or {}).get("lifetime", "call")
    if value not in LIFETIMES:
        raise ValueError(f"tool {tool.name!r}: config lifetime={value!r}; allowed values are {', '.join(LIFETIMES)}")
    return value


def check_modules(config_file: str) -> None:
    """Every module a tools YAML names can be found (verl's loader fails on one that cannot with "'NoneType' object
    has no attribute 'loader'", naming neither the module nor the tool)."""
    import importlib.util

    from omegaconf import OmegaConf

    for entry in OmegaConf.load(config_file).get("tools") or []:
        module = str(entry.get("class_name", "")).rpartition(".")[0]
        try:
            found = not module or importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a package above it is missing
            found = False
        if not found:
            name = (entry.get("tool_schema") or {}).get("function", {}).get("name", "?")
            raise ModuleNotFoundError(
                f"{config_file}: tool {name!r} names class_name={entry.class_name!r}, but no module {module!r} is on "
                "the tool workers' import path (the YAML's folder, then the run's)"
            )


def load_tools(sources: ToolSources) -> dict[str, Any]:
    if sources.config_file:
        check_modules(sources.config_file)
    from verl.tools.tool_registry import load_all_tools

    return {tool.name: tool for tool in load_all_tools(sources.config_file, sources.function_tool_path)}


def schemas(tools: dict[str, Any]) -> dict[str, dict]:
    return {name: tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for name, tool in tools.items()}


@dataclass(frozen=True)
class ToolsReady:
    """A worker's ready detail."""

    schemas: dict[str, dict]  # name -> OpenAI function schema, for chat templates
    per_episode: frozenset[str]  # the tools with an instance per episode


class InvalidResult(ValueError):
    """A tool returned something that is not a tool response."""


def _reward(value: Any, what: str) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise InvalidResult(f"{what} returned {value!r}; a reward must be a finite number")
    return float(value)


def _text(response: Any, name: str) -> str:
    from verl.tools.schemas import ToolResponse

    if not isinstance(response, ToolResponse):
        raise InvalidResult(f"tool {name!r} returned {type(response).__name__}, not verl's ToolResponse")
    if response.text is not None and not isinstance(response.text, str):
        raise InvalidResult(f"tool {name!r} returned text of type {type(response.text).__name__}, not str")
    return response.text or ""


class LostInstance(RuntimeError):
    """A per-episode tool's instance is not in this worker (it was replaced after a failure)."""


async def _execute(tool: Any, instance: str, name: str, arguments: dict) -> tuple[str, float]:
    result = await tool.execute(instance, arguments)
    if not isinstance(result, tuple) or len(result) != 3:
        raise InvalidResult(f"tool {name!r}: execute returned {result!r}, not (ToolResponse, reward, metrics)")
    response, step_reward, _metrics = result
    return _text(response, name), _reward(step_reward, f"tool {name!r} execute")


async def _run_base_tool(tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    instance = None
    try:
        instance, _ = await tool.create(create_kwargs=call.create_kwargs)
        text, reward = await _execute(tool, instance, call.name, arguments)
        return text, reward + _reward(await tool.calc_reward(instance), f"tool {call.name!r} calc_reward")
    finally:
        if instance is not None:
            await tool.release(instance)


async def _run_episode_tool(worker: ToolWorker, tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    key = (call.episode, call.name)
    if key not in worker.instances:
        if not call.may_create:
            raise LostInstance(
                f"tool {call.name!r}: this episode's instance is gone with the tool worker that held it (replaced "
                "after a crash or timeout); its state is lost"
            )
        worker.instances[key], _ = await tool.create(create_kwargs=call.create_kwargs)
    return await _execute(tool, worker.instances[key], call.name, arguments)


async def _release(worker: ToolWorker, end: ToolRelease) -> tuple[str, float]:
    """An episode's instance: its `calc_reward`, then released. One this worker does not hold has nothing to release:
    never created, or, where a call of the episode succeeded (`held`), lost with a replaced worker: its reward is
    unknown, and the release fails as `lost`."""
    instance = worker.instances.pop((end.episode, end.name), None)
    if instance is None and end.held:
        raise LostInstance(
            f"tool {end.name!r}: this episode's instance is gone with the tool worker that held it; its reward is lost"
        )
    if instance is None:
        return "", 0.0
    tool = worker.tools[end.name]
    try:
        return "", _reward(await tool.calc_reward(instance), f"tool {end.name!r} calc_reward")
    finally:
        await tool.release(instance)


async def _run_function_tool(tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    from verl.tools.function_tool import normalize_function_tool_return

    response, step_reward, _metrics = normalize_function_tool_return(await tool.call(arguments))
    return _text(response, call.name), _reward(step_reward, f"tool {call.name!r}")


async def run_call(worker: ToolWorker, call: ToolCall) -> tuple:
    from verl.tools.function_tool import FunctionTool

    tools = worker.tools
    tool = tools.get(call.name)
    if tool is None:
        return ("fail", "unknown_tool", f"Unknown function {call.name!r}. Available tools: {sorted(tools)}")
    try:
        arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    except (json.JSONDecodeError, TypeError) as err:
        return ("fail", "bad_arguments", f"Invalid JSON in arguments for {call.name!r}: {err}")
    if isinstance(tool, FunctionTool):
        return await contained(_run_function_tool(tool, call, arguments))
    if call.episode is not None:
        return await contained(_run_episode_tool(worker, tool, call, arguments))
    return await contained(_run_base_tool(tool, call, arguments))


async def contained(work: Awaitable[tuple[str, float]]) -> tuple:
    """The outcome message of a tool's work: its text and reward, or what failed."""
    try:
        text, reward = await work
    except InvalidResult as err:
        return ("fail", "invalid", str(err))
    except LostInstance as err:
        return ("fail", "lost", str(err))
    except Exception as err:
        return ("fail", "exception", "".join(traceback.format_exception(err)))
    return ("ok", text, reward)


def load(sources: ToolSources) -> tuple[ToolWorker, ToolsReady]:
    tools = load_tools(sources)
    per_episode = frozenset(name for name, tool in tools.items() if lifetime(tool) == "episode")
    return ToolWorker(tools, {}), ToolsReady(schemas(tools), per_episode)


def answer(worker: ToolWorker, positions: list[int], items: list, loop) -> Iterator[list]:
    for position, item in zip(positions, items):
        run = contained(_release(worker, item)) if isinstance(item, ToolRelease) else run_call(worker, item)
        yield [(position, loop.run_until_complete(run))]


if __name__ == "__main__":
    # run as the imported module, not as __main__: the classes it sends and receives must be the parent's
    from rl_tpu.episodes import tool_worker

    serve(tool_worker.load, tool_worker.answer)
