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
`tool_schema`. The environment runs in the tool worker process (deadline and memory limit as for any tool); a
remote OpenEnv server (`EnvClient`) is not wired.

Config keys (the YAML entry's `config`, beside verl's `type: native`): `environment` (import path of the
`Environment` subclass), `action` (import path of its `Action`; default: the one the class declares as its first
type argument), `name` and `description` (the function's; defaults: the class's name and docstring),
`environment_kwargs` (given to the class), `lifetime` (`call` or `episode`).
"""

from __future__ import annotations

import importlib
import json
import typing
import uuid
from typing import Any, Optional

from pydantic import ValidationError
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

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


def action_schema(action: type, name: str, description: str) -> OpenAIFunctionToolSchema:
    """An OpenAI function schema of the action's fields (verl's schema keeps a property's type, description and
    enum)."""
    schema = action.model_json_schema()
    properties = {
        field: {"type": spec.get("type", "string"), **{k: spec[k] for k in ("description", "enum") if k in spec}}
        for field, spec in schema.get("properties", {}).items()
        if field != "metadata"
    }
    required = [field for field in schema.get("required", []) if field in properties]
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": parameters}
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": function})


def observation_text(observation: Any) -> str:
    """What the model reads: the one field an observation has beyond OpenEnv's own as text, or all of them as
    JSON."""
    fields = observation.model_dump(exclude=set(OBSERVATION_BOOKKEEPING), mode="json")
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(fields)


class OpenEnvTool(BaseTool):
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        if "environment" not in config:
            raise ValueError("OpenEnvTool: config.environment (the Environment subclass's import path) is required")
        self.environment = import_object(config["environment"], "environment")
        declared = config.get("action")
        self.action = import_object(declared, "action") if declared else declared_action(self.environment)
        self.environment_kwargs = dict(config.get("environment_kwargs") or {})
        self.instances: dict[str, Any] = {}
        self.finished: set[str] = set()  # instances whose last observation said done
        if tool_schema is None:
            name = config.get("name", self.environment.__name__)
            description = config.get("description", (self.environment.__doc__ or name).strip().splitlines()[0])
            tool_schema = action_schema(self.action, name, description)
        super().__init__(config, tool_schema)

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        environment = self.environment(**self.environment_kwargs)
        environment.reset(**(kwargs.get("create_kwargs") or {}))
        self.instances[instance_id] = environment
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if instance_id in self.finished:
            raise ValueError(f"{self.name}: this episode's environment is done; it takes no more actions")
        observation = self.instances[instance_id].step(self.parse_action(parameters))
        if observation.done:
            self.finished.add(instance_id)
        reward = 0.0 if observation.reward is None else float(observation.reward)
        return ToolResponse(text=observation_text(observation)), reward, {"done": bool(observation.done)}

    def parse_action(self, parameters: dict[str, Any]) -> Any:
        """The action of the call's arguments; arguments it refuses fail the call (counted) with one line the model
        reads, not pydantic's multi-line report."""
        try:
            return self.action(**parameters)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in err.errors())
            raise ValueError(f"invalid arguments for {self.name}: {problems}") from None

    async def release(self, instance_id: str, **kwargs) -> None:
        self.finished.discard(instance_id)
        environment = self.instances.pop(instance_id, None)
        if environment is not None:
            environment.close()
