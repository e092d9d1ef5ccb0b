"""A tool worker process: loads verl's tools once (a tools YAML of `BaseTool` subclasses, and/or a file of
`@function_tool` functions), then runs the calls it is sent.

Started by `rl_tpu.episodes.tools.ToolBox` through `rl_tpu.cluster.worker_pool` as
``python -m rl_tpu.episodes.tool_worker READ_FD WRITE_FD``. A `BaseTool` call runs its life cycle as verl's
agent loop does (``create(create_kwargs=...)``, ``execute``, then ``calc_reward`` and ``release`` on the same
instance); a function tool is called with the arguments. Every outcome is a message: ``("ok", text, reward)``
or ``("fail", kind, message)`` with kind ``unknown_tool``, ``bad_arguments``, ``exception`` or ``invalid``.

It speaks `rl_tpu.cluster.worker_pool`'s protocol (bounded memory and CPU seconds, death with its parent): its
setup is the `ToolSources`, its ready detail the tools' OpenAI schemas by name, and it answers call by call.
"""

from __future__ import annotations

import json
import math
import numbers
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

from rl_tpu.cluster.worker_pool import serve


@dataclass(frozen=True)
class ToolSources:
    config_file: str | None  # verl's tools YAML (`tools_config_file`)
    function_tool_path: str | None  # a .py file of `@function_tool` functions


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON, as the parser read it
    create_kwargs: dict  # the example's `extra_info.tools_kwargs[name].create_kwargs` (verl's convention)


def load_tools(sources: ToolSources) -> dict[str, Any]:
    from verl.tools.tool_registry import load_all_tools

    return {tool.name: tool for tool in load_all_tools(sources.config_file, sources.function_tool_path)}


def schemas(tools: dict[str, Any]) -> dict[str, dict]:
    return {name: tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for name, tool in tools.items()}


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


async def _run_base_tool(tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    instance = None
    try:
        instance, _ = await tool.create(create_kwargs=call.create_kwargs)
        result = await tool.execute(instance, arguments)
        if not isinstance(result, tuple) or len(result) != 3:
            raise InvalidResult(f"tool {call.name!r}: execute returned {result!r}, not (ToolResponse, reward, metrics)")
        response, step_reward, _metrics = result
        text = _text(response, call.name)
        reward = _reward(step_reward, f"tool {call.name!r} execute") + _reward(
            await tool.calc_reward(instance), f"tool {call.name!r} calc_reward"
        )
        return text, reward
    finally:
        if instance is not None:
            await tool.release(instance)


async def _run_function_tool(tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    from verl.tools.function_tool import normalize_function_tool_return

    response, step_reward, _metrics = normalize_function_tool_return(await tool.call(arguments))
    return _text(response, call.name), _reward(step_reward, f"tool {call.name!r}")


async def run_call(tools: dict[str, Any], call: ToolCall) -> tuple:
    from verl.tools.function_tool import FunctionTool

    tool = tools.get(call.name)
    if tool is None:
        return ("fail", "unknown_tool", f"Unknown function {call.name!r}. Available tools: {sorted(tools)}")
    try:
        arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):
            raise TypeError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    except (json.JSONDecodeError, TypeError) as err:
        return ("fail", "bad_arguments", f"Invalid JSON in arguments for {call.name!r}: {err}")
    try:
        run = _run_function_tool if isinstance(tool, FunctionTool) else _run_base_tool
        text, reward = await run(tool, call, arguments)
    except InvalidResult as err:
        return ("fail", "invalid", str(err))
    except Exception as err:
        return ("fail", "exception", "".join(traceback.format_exception(err)))
    return ("ok", text, reward)


def load(sources: ToolSources) -> tuple[dict[str, Any], dict[str, dict]]:
    tools = load_tools(sources)
    return tools, schemas(tools)


def answer(tools: dict[str, Any], positions: list[int], calls: list[ToolCall], loop) -> Iterator[list]:
    for position, call in zip(positions, calls):
        yield [(position, loop.run_until_complete(run_call(tools, call)))]


if __name__ == "__main__":
    serve(load, answer)
