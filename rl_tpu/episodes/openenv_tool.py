"""OpenEnv environments as verl tools: a verl tools YAML entry with `class_name:
rl_tpu.episodes.openenv_tool.OpenEnvTool` turns an OpenEnv `Environment` (openenv-core) into a tool the model calls.

    model's call {"name": ..., "arguments": {...}}
        -> create: a fresh environment, reset(**the row's create_kwargs)
        -> execute: step(Action(**arguments)) -> Observation
        -> the observation's fields as the text the model reads; its reward as the call's step reward
        -> release: close()

By default (`lifetime: call`) a call is one reset and one step of its own environment, as verl's agent loop gives
every call its own tool instance: environments whose episode is one action (a calculator, a code runner, a
checker) fit as they are. With `lifetime: episode` the environment lives for the model's whole episode: its first
call resets it, every call is one step of it, and it closes when the episode ends (rl_tpu.episodes.tool_worker
keeps it in one tool worker); once an observation says `done`, further calls fail with a line saying so. The
tool's schema is the action's fields (its pydantic schema, less OpenEnv's `metadata`), unless the YAML gives
`tool_schema`. The environment runs in the tool worker process (deadline and memory limit as for any tool), or,
with `base_url`, on an OpenEnv server (its `http_server` app, in a container or elsewhere): an instance is then a
session of OpenEnv's `GenericEnvClient` over the server's WebSocket (one connection, hence one environment on
the server, from the reset to the release: see `RemoteEnvironment` for what a restart or a slow step does), and the
tool's schema is read from the server's `/schema` at load.

Config keys (the YAML entry's `config`, beside verl's `type: native`): `environment` (import path of the
`Environment` subclass) or `base_url` (an OpenEnv server's http(s) address; `name` then required), `action`
(import path of its `Action`; default: the one the class declares as its first type argument, or for a server its
schema), `name` and `description` (the function's; defaults: the class's name and docstring),
`environment_kwargs` (given to the class), `timeout_s` (a server's connect and reply deadline, default 30),
`lifetime` (`call` or `episode`), `reconnects` and `reconnect_backoff_s` (how often a session tries a server that
is away again, default 3, and the first wait, doubled at each try, default 0.5 s: with the defaults, 3.5 s of
waits, inside the call's own deadline `episode.tool_timeout_s`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
import typing
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Optional

from openenv.core.generic_client import GenericEnvClient  # here, not at a call: seconds inside its deadline
from pydantic import ValidationError
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from websockets.exceptions import ConnectionClosed

from rl_tpu.cluster.call_deadlines import CallTimeout
from rl_tpu.episodes.refusals import BadArguments
from rl_tpu.episodes.tool_worker import LostInstance

OBSERVATION_BOOKKEEPING = ("done", "reward", "metadata")  # OpenEnv's own Observation fields, not the model's text


def import_object(path: str, key: str) -> Any:
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(f"OpenEnvTool config {key}={path!r}: give an import path, module.Class")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"OpenEnvTool config {key}={path!r} cannot be imported: {err}") from err


def declared_action(environment: type) -> type:
    """The `Action` type an `Environment[Act, Obs, State]` subclass names as its first type argument."""
    for base in getattr(environment, "__orig_bases__", ()):
        arguments = typing.get_args(base)
        if arguments and isinstance(arguments[0], type):
            return arguments[0]
    raise ValueError(
        f"OpenEnvTool: {environment.__name__} declares no action type (Environment[Action, Observation, State]); "
        "set config.action to the action class's import path"
    )


def server_action_schema(base_url: str, timeout_s: float) -> dict:
    """The action's JSON schema, from an OpenEnv server's `/schema`."""
    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/schema", timeout=timeout_s) as reply:
            return json.loads(reply.read())["action"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"OpenEnvTool config base_url={base_url!r}: no action schema at its /schema ({err})") from err


def action_schema(schema: dict, name: str, description: str) -> OpenAIFunctionToolSchema:
    """An OpenAI function schema of an action's JSON schema (verl's schema keeps a property's type, description and
    enum)."""
    properties = {
        field: {"type": spec.get("type", "string"), **{k: spec[k] for k in ("description", "enum") if k in spec}}
        for field, spec in schema.get("properties", {}).items()
        if field != "metadata"
    }
    required = [field for field in schema.get("required", []) if field in properties]
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": parameters}
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": function})


def observation_text(fields: dict) -> str:
    """What the model reads: the one field an observation has beyond OpenEnv's own as text, or all of them as
    JSON."""
    fields = {k: v for k, v in fields.items() if k not in OBSERVATION_BOOKKEEPING}
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(fields)


class LocalEnvironment:
    """An `Environment` in this process."""

    def __init__(self, environment: Any):
        self.environment = environment

    async def reset(self, create_kwargs: dict) -> None:
        self.environment.reset(**create_kwargs)

    async def step(self, action: Any) -> tuple[dict, Optional[float], bool]:
        observation = self.environment.step(action)
        return observation.model_dump(mode="json"), observation.reward, bool(observation.done)

    async def close(self) -> None:
        self.environment.close()


@dataclass(frozen=True)
class Reconnect:
    """How a session waits for a server that is away (the `reconnects` and `reconnect_backoff_s` config keys)."""

    tries: int  # connections tried again after the first fails
    backoff_s: float  # the wait before the first of them, doubled before each next one

    def waits(self) -> list[float]:
        return [self.backoff_s * 2**i for i in range(self.tries)]


# what a connection that went away raises: refused or reset (OSError, of which OpenEnv's ConnectionError on connect),
# closed under a message (websockets); a reply's deadline (TimeoutError, also an OSError) is caught before these
GONE = (OSError, ConnectionClosed)


class RemoteEnvironment:
    """A session on an OpenEnv server (OpenEnv's own WebSocket client): one WebSocket held from the reset to the close,
    hence one environment on the server for the instance's whole life, as the server makes an environment per
    connection and destroys it when the connection closes (openenv-core's `http_server.websocket_endpoint`).

    So a connection that goes away after the reset (the server restarted, the connection reset) has taken the
    episode's state with it: the step fails as `lost` and so does every later one, never sent to a fresh
    environment as if it were the same; a session is waited for (reconnected, with backoff) only where there is no
    state yet: the reset, or to tell a server that is back (the episode is `lost`, the next ones get new
    sessions) from one that stays away (a counted failure naming it). A reply past `timeout_s` fails the step as
    a `timeout` and ends the session too: its late reply would otherwise be read as the next step's."""

    def __init__(self, base_url: str, timeout_s: float, name: str, reconnect: Reconnect):
        self.base_url, self.timeout_s, self.reconnect = base_url, timeout_s, reconnect
        self.name = name  # the tool's, for the line the model reads when the server refuses its arguments
        self.client: Any = None
        self.lost: str | None = None  # why this session's state is gone; its later steps fail as lost

    async def reset(self, create_kwargs: dict) -> None:
        self.client = await self.session(create_kwargs)

    async def session(self, create_kwargs: dict | None) -> Any:
        """A new session, reset with `create_kwargs` (None: not reset), tried again while the server is away;
        ConnectionError naming the server and the tries once they are spent."""
        start, failures = time.monotonic(), []
        for wait in [0.0, *self.reconnect.waits()]:
            await asyncio.sleep(wait)
            client = GenericEnvClient(self.base_url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s)
            try:
                await client.connect()
                if create_kwargs is not None:
                    await self.answer(client.reset(**create_kwargs), "a reset")
                return client
            except GONE as err:
                failures.append(one_line(err))
            except Exception:
                await closed(client, self.timeout_s)
                raise
            await closed(client, self.timeout_s)
        raise ConnectionError(
            f"the OpenEnv server at {self.base_url} took no session in {len(failures)} tries over "
            f"{time.monotonic() - start:.1f} s (tool {self.name!r}, config reconnects={self.reconnect.tries}, "
            f"reconnect_backoff_s={self.reconnect.backoff_s:g}); the last: {failures[-1]}"
        )

    async def answer(self, request: Awaitable[Any], what: str) -> Any:
        """The server's reply to `what`: its refusal as one line, none within `timeout_s` a timeout naming it."""
        try:
            return await request
        except TimeoutError:
            raise CallTimeout(
                f"the OpenEnv server at {self.base_url} did not answer {what} within {self.timeout_s:g} s "
                f"(tool {self.name!r}, config timeout_s)"
            ) from None
        except RuntimeError as err:  # the server refused the action or failed: one line for the model, not a report
            line = " ".join(str(err).split())
            if "(code: VALIDATION_ERROR)" in line:
                raise BadArguments(f"invalid arguments for {self.name}: {line}") from None
            raise ValueError(line) from None

    async def step(self, action: Any) -> tuple[dict, Optional[float], bool]:
        if self.lost:
            raise LostInstance(self.lost)
        try:
            result = await self.answer(self.client.step(action), "a step")
        except CallTimeout:
            self.lost = f"tool {self.name!r}: a step of this episode's session timed out; the session is closed"
            await self.close()
            raise
        except GONE as err:
            await self.close()
            self.lost = (
                f"tool {self.name!r}: the OpenEnv server at {self.base_url} dropped this episode's session "
                f"({one_line(err)}); the server's environment ended with the "
                "connection: the episode's state is lost"
            )
            await closed(await self.session(None), self.timeout_s)  # the server is back, or a counted failure
            raise LostInstance(self.lost) from None
        return result.observation, result.reward, bool(result.done)

    async def close(self) -> None:
        if self.client is not None:
            await closed(self.client, self.timeout_s)


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


async def closed(client: Any, timeout_s: float) -> None:
    """`client` closed, within `timeout_s` (a close handshake with a server that does not answer waits longer)."""
    try:
        await asyncio.wait_for(client.close(), timeout_s)
    except (TimeoutError, *GONE):
        pass


def reconnect_setting(config: dict) -> Reconnect:
    """The `reconnects` (default 3) and `reconnect_backoff_s` (default 0.5) config keys, refused when negative."""
    tries, backoff_s = config.get("reconnects", 3), config.get("reconnect_backoff_s", 0.5)
    if not isinstance(tries, int) or isinstance(tries, bool) or tries < 0:
        raise ValueError(f"OpenEnvTool config reconnects={tries!r}: allowed values are integers >= 0")
    if not isinstance(backoff_s, (int, float)) or isinstance(backoff_s, bool) or backoff_s < 0:
        raise ValueError(f"OpenEnvTool config reconnect_backoff_s={backoff_s!r}: allowed values are numbers >= 0")
    return Reconnect(tries, float(backoff_s))


class OpenEnvTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        self.base_url = config.get("base_url")
        self.timeout_s = float(config.get("timeout_s", 30))
        self.reconnect = reconnect_setting(config)
        if ("environment" in config) == bool(self.base_url):
            raise ValueError(
                "OpenEnvTool: set one of config.environment (the Environment subclass's import path) and "
                "config.base_url (an OpenEnv server's address)"
            )
        declared = config.get("action")
        if self.base_url:
            if "name" not in config:
                raise ValueError(f"OpenEnvTool config base_url={self.base_url!r}: config.name is required")
            self.environment = None
            self.action = import_object(declared, "action") if declared else None
        else:
            self.environment = import_object(config["environment"], "environment")
            self.action = import_object(declared, "action") if declared else declared_action(self.environment)
        self.environment_kwargs = dict(config.get("environment_kwargs") or {})
        self.instances: dict[str, LocalEnvironment | RemoteEnvironment] = {}
        self.finished: set[str] = set()  # instances whose last observation said done
        if tool_schema is None:
            tool_schema = self.default_schema(config)
        super().__init__(config, tool_schema)

    def default_schema(self, config: dict) -> OpenAIFunctionToolSchema:
        if self.action is not None:
            schema = self.action.model_json_schema()
        else:
            schema = server_action_schema(self.base_url, self.timeout_s)
        documented = self.environment or self.action
        name = config.get("name") or documented.__name__
        description = config.get("description") or ((documented.__doc__ if documented else None) or name)
        return action_schema(schema, name, description.strip().splitlines()[0])

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        if self.base_url:
            environment = RemoteEnvironment(self.base_url, self.timeout_s, self.name, self.reconnect)
        else:
            environment = LocalEnvironment(self.environment(**self.environment_kwargs))
        await environment.reset(kwargs.get("create_kwargs") or {})
        self.instances[instance_id] = environment
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if instance_id in self.finished:
            raise ValueError(f"{self.name}: this episode's environment is done; it takes no more actions")
        action = self.parse_action(parameters)
        fields, reward, done = await self.instances[instance_id].step(action)
        if done:
            self.finished.add(instance_id)
        return ToolResponse(text=observation_text(fields)), float(reward or 0.0), {"done": done}

    def parse_action(self, parameters: dict[str, Any]) -> Any:
        """The action of the call's arguments (a server without a local action class checks them itself);
        arguments it refuses fail the call (counted) with one line the model reads, not pydantic's multi-line
        report."""
        if self.action is None:
            return parameters
        try:
            action = self.action(**parameters)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            raise BadArguments(f"invalid arguments for {self.name}: {problems}") from None
        return action.model_dump(mode="json", exclude={"metadata"}) if self.base_url else action

    async def release(self, instance_id: str, **kwargs) -> None:
        self.finished.discard(instance_id)
        environment = self.instances.pop(instance_id, None)
        if environment is not None:
            await environment.close()
