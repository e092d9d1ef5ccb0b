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
session of OpenEnv's `GenericEnvClient` over the server's WebSocket, and the tool's schema is read from the
server's `/schema` at load.

Config keys (the YAML entry's `config`, beside verl's `type: native`): `environment` (import path of the
`Environment` subclass) or `base_url` (an OpenEnv server's http(s) address; `name` then required), `action`
(import path of its `Action`; default: the one the class declares as its first type argument, or for a server its
schema), `name` and `description` (the function's; defaults: the class's name and docstring),
`environment_kwargs` (given to the class), `timeout_s` (a server's connect and reply deadline, default 30),
`lifetime` (`call` or `episode`).
"""

from __future__ import annotations

import importlib
import json
import typing
import urllib.request
import uuid
from typing import Any, Optional

from pydantic import ValidationError
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from rl_tpu.episodes.refusals import BadArguments

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


class RemoteEnvironment:
    """A session on an OpenEnv server (OpenEnv's own WebSocket client)."""

    def __init__(self, base_url: str, timeout_s: float, name: str):
        from openenv.core.generic_client import GenericEnvClient

        self.name = name  # the tool's, for the line the model reads when the server refuses its arguments
        self.client = GenericEnvClient(base_url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)

    async def reset(self, create_kwargs: dict) -> None:
        await self.client.reset(**create_kwargs)

    async def step(self, action: Any) -> tuple[dict, Optional[float], bool]:
        try:
            result = await self.client.step(action)
        except RuntimeError as err:  # the server refused the action or failed: one line for the model, not a report
            line = " ".join(str(err).split())
            if "(code: VALIDATION_ERROR)" in line:
                raise BadArguments(f"invalid arguments for {self.name}: {line}") from None
            raise ValueError(line) from None
        return result.observation, result.reward, bool(result.done)

    async def close(self) -> None:
        await self.client.close()


class OpenEnvTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        self.base_url = config.get("base_url")
        self.timeout_s = float(config.get("timeout_s", 30))
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
            environment = RemoteEnvironment(self.base_url, self.timeout_s, self.name)
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
