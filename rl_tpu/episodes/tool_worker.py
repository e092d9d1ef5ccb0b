"""A tool worker process: loads verl's tools once (a tools YAML of `BaseTool` subclasses, and/or a file of
`@function_tool` functions), then runs the calls it is sent.

Started by `rl_tpu.episodes.tools.ToolBox` through `rl_tpu.cluster.worker_pool` as
``python -m rl_tpu.episodes.tool_worker READ_FD WRITE_FD``. A `BaseTool` call runs its life cycle as verl's
agent loop does (``create(create_kwargs=...)``, ``execute``, then ``calc_reward`` and ``release`` on the same
instance); a function tool is called with the arguments. Every outcome is a message: ``("ok", text, reward)``
or ``("fail", kind, message)`` with kind ``unknown_tool``, ``bad_arguments``, ``exception``, ``invalid`` or
``lost``. ``bad_arguments`` is the model's mistake: arguments that are not a JSON object, miss a parameter the
tool's schema requires, or that the tool refuses by raising `rl_tpu.episodes.refusals.BadArguments` (`OpenEnvTool`
does for an action its class or server refuses); anything else a tool raises is an ``exception``, the tool's failure.

A `BaseTool` whose YAML config says ``lifetime: episode`` keeps one instance per episode instead (a stateful
environment: a game, a shell, a database): its episode's first call creates it, every call of that episode runs
``execute`` on it (the pool sends them all to this worker), and a `ToolRelease` at the episode's end asks
``calc_reward`` once and releases it. A call for an instance this worker does not hold, though an earlier call of
the episode succeeded, fails as ``lost`` (the worker was replaced after a crash or timeout: its state is gone).

Calls run at once: the items of every job it was sent are tasks on the worker's event loop (it reads a new job
while earlier ones run: `serve_concurrently`; at most `calls_per_worker` run), each answered as it ends and each
with its own deadline (`rl_tpu.cluster.call_deadlines`: a call that awaits too long is cancelled, one that blocks
the loop is interrupted, one stuck in a thread is left to the pool, which replaces the worker). A per-episode
instance's calls and release run one after another, in the order sent; one whose call timed out is dropped (its
state is unknown: later calls fail as ``lost``). Code that blocks (``time.sleep``, a synchronous client) runs one
call at a time whatever the bound: only awaiting lets the others run. A result's text is cut to
`max_response_chars` here, before it crosses the pipe.

Ray is off in a tool worker: it is a plain process outside the run's Ray cluster, where a tool's Ray actor would
start a private cluster per worker (see `refuse_ray`).

It speaks `rl_tpu.cluster.worker_pool`'s protocol (bounded memory and CPU seconds, death with its parent): its
setup is a `ToolSetup`, its ready detail a `ToolsReady` (the tools' OpenAI schemas by name, and which keep an
instance per episode), and it answers item by item.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable

from rl_tpu.cluster.call_deadlines import CallTimeout, Deadlines
from rl_tpu.cluster.worker_pool import serve_concurrently
from rl_tpu.episodes.refusals import BadArguments


@dataclass(frozen=True)
class ToolSources:
    config_file: str | None  # verl's tools YAML (`tools_config_file`)
    function_tool_path: str | None  # a .py file of `@function_tool` functions


@dataclass(frozen=True)
class ToolSetup:
    """A tool worker's setup: its tools, and what bounds their calls."""

    sources: ToolSources
    timeout_s: float  # a call's deadline
    calls_per_worker: int  # calls run at once
    max_response_chars: int  # a result's text is cut to this, with verl's markers
    truncate_side: str  # where: left, right, middle


FAILURE_CHARS = 4096  # what a failure's message keeps (its end, where the traceback's last line is)
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
    setup: ToolSetup
    instances: dict[tuple[str, str], Any] = field(default_factory=dict)  # (episode, tool) -> id: per-episode tools
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)  # a per-episode instance's turn
    deadlines: Deadlines | None = None  # set up with the event loop, at the first job
    running: asyncio.Semaphore | None = None  # at most `calls_per_worker` calls at once
    background: set[asyncio.Task] = field(default_factory=set)  # releases of dropped instances

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.deadlines is None:
            self.deadlines = Deadlines(loop, self.setup.timeout_s, self.setup.calls_per_worker)
            self.running = asyncio.Semaphore(self.setup.calls_per_worker)

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def drop(self, key: tuple[str, str]) -> None:
        """Forget an instance whose call timed out (its state is unknown: a server's reply may still be on its
        way), releasing it meanwhile, within a deadline."""
        instance = self.instances.pop(key, None)
        if instance is not None:
            release = asyncio.ensure_future(contained(self.deadlines.run(self.tools[key[1]].release(instance))))
            self.background.add(release)
            release.add_done_callback(self.background.discard)


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


def bounded(outcome: tuple, setup: ToolSetup) -> tuple:
    """An outcome as sent: a result's text cut to the setting, a failure's message to its last `FAILURE_CHARS`."""
    if outcome[0] == "ok":
        _, text, reward = outcome
        return ("ok", truncate(text, setup.max_response_chars, setup.truncate_side), reward)
    _, kind, message = outcome
    return ("fail", kind, truncate(message, FAILURE_CHARS, "left"))


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


async def _run_episode_call(worker: ToolWorker, tool: Any, call: ToolCall, arguments: dict) -> tuple[str, float]:
    """A per-episode tool's call: after the episode's earlier items, within its deadline; an instance whose call
    timed out is dropped."""
    key = (call.episode, call.name)
    async with worker.lock(key), worker.running:
        try:
            return await worker.deadlines.run(_run_episode_tool(worker, tool, call, arguments))
        except CallTimeout:
            worker.drop(key)
            raise


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
    missing = [name for name in tool.tool_schema.function.parameters.required if name not in arguments]
    if missing:
        return ("fail", "bad_arguments", f"Missing required arguments for {call.name!r}: {', '.join(missing)}")
    if isinstance(tool, FunctionTool):
        work = _run_function_tool(tool, call, arguments)
    elif call.episode is not None:
        return await contained(_run_episode_call(worker, tool, call, arguments))
    else:
        work = _run_base_tool(tool, call, arguments)
    async with worker.running:
        return await contained(worker.deadlines.run(work))


async def run_release(worker: ToolWorker, end: ToolRelease) -> tuple:
    """An episode's release: after its calls, within its deadline."""
    key = (end.episode, end.name)
    try:
        async with worker.lock(key), worker.running:
            return await contained(worker.deadlines.run(_release(worker, end)))
    finally:
        worker.locks.pop(key, None)


async def contained(work: Awaitable[tuple[str, float]]) -> tuple:
    """The outcome message of a tool's work: its text and reward, or what failed."""
    try:
        text, reward = await work
    except InvalidResult as err:
        return ("fail", "invalid", str(err))
    except BadArguments as err:
        return ("fail", "bad_arguments", str(err))
    except LostInstance as err:
        return ("fail", "lost", str(err))
    except CallTimeout as err:
        return ("fail", "timeout", str(err))
    except Exception as err:
        if uses_ray(err):
            return ("fail", "exception", RAY_REFUSAL)
        return ("fail", "exception", "".join(traceback.format_exception(err)))
    return ("ok", text, reward)


async def answer_item(worker: ToolWorker, item: ToolCall | ToolRelease) -> tuple | None:
    """An item's outcome, bounded; None for a call that timed out while its thread runs on (no answer: the pool's
    deadline replaces this worker, and with it the thread)."""
    threads = worker.deadlines.track()
    outcome = await (run_release(worker, item) if isinstance(item, ToolRelease) else run_call(worker, item))
    if outcome[:2] == ("fail", "timeout") and worker.deadlines.stuck(threads):
        return None
    return bounded(outcome, worker.setup)


RAY_REFUSAL = (
    "a tool may not use Ray: a tool worker is a plain process outside the run's Ray cluster, where a Ray actor or "
    "task would start a private Ray cluster in every worker (unseen by the run's resources, a named actor such as "
    "a global rate limiter once per worker, its processes outliving a replaced worker); call the service from "
    "an async `execute` instead (a worker runs episode.tool_calls_per_worker calls at once)"
)


def refuse_ray() -> None:
    """Ray's implicit start (the first `.remote` starts a local cluster) is off here; a tool that started Ray
    itself is refused once its tools are loaded, its cluster shut down."""
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"  # read when ray is imported, which the tools do after this
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        raise RuntimeError(f"a tool started Ray (ray.init): {RAY_REFUSAL}")


def uses_ray(err: BaseException | None) -> bool:
    """Whether `err`, or an error it came from, is Ray's refusal to start (a tool used Ray where it is off)."""
    exceptions = sys.modules.get("ray.exceptions")
    while exceptions is not None and err is not None:
        if isinstance(err, exceptions.RaySystemError):
            return True
        err = err.__cause__ or err.__context__
    return False


def tool_of(err: BaseException) -> str:
    """The class of the tool whose method raised `err` (the innermost frame whose `self` is a verl tool)."""
    from verl.tools.base_tool import BaseTool

    name = "a tool"
    tb = err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, BaseTool):
            name = f"{type(owner).__module__}.{type(owner).__qualname__}"
        tb = tb.tb_next
    return name


def load(setup: ToolSetup) -> tuple[ToolWorker, ToolsReady]:
    refuse_ray()
    try:
        tools = load_tools(setup.sources)
    except Exception as err:
        if uses_ray(err):
            raise RuntimeError(f"{tool_of(err)} uses Ray in its tool worker: {RAY_REFUSAL}") from err
        raise
    refuse_ray()
    per_episode = frozenset(name for name, tool in tools.items() if lifetime(tool) == "episode")
    return ToolWorker(tools, setup), ToolsReady(schemas(tools), per_episode)


async def answer(worker: ToolWorker, item: ToolCall | ToolRelease, loop) -> tuple | None:
    """One item's outcome (`serve_concurrently`: the items of every job run at once, each answered as it ends)."""
    worker.start(loop)
    return await answer_item(worker, item)


if __name__ == "__main__":
    # run as the imported module, not as __main__: the classes it sends and receives must be the parent's
    from rl_tpu.episodes import tool_worker

    serve_concurrently(tool_worker.load, tool_worker.answer)
