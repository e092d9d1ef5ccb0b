"""The calculator as an OpenEnv environment (openenv-core's `Environment`), served to the model as a tool by
`rl_tpu.episodes.openenv_tool.OpenEnvTool` (openenv_calculator.yaml): one action, the expression; one observation,
its value. The same evaluation as calculator.py, so the recipes' warm start calls it as it calls `calc`. It keeps
no state worth keeping, so either `lifetime` serves it: a fresh one per call (openenv_calculator.yaml) or one per
episode."""

from __future__ import annotations

from calculator import evaluate  # a tool file's folder is on the tool workers' import path
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class CalcAction(Action):
    expression: str = Field(description='integers with + - * / and parentheses, e.g. "37*48"')


class CalcObservation(Observation):
    value: str = ""


class CalculatorEnvironment(Environment[CalcAction, CalcObservation, State]):
    """Evaluate an arithmetic expression."""

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs) -> CalcObservation:
        self._state = State(episode_id=episode_id)
        return CalcObservation()

    def step(self, action: CalcAction, timeout_s=None, **kwargs) -> CalcObservation:
        self._state.step_count += 1
        try:
            value = evaluate(action.expression)
        except (ValueError, SyntaxError, ZeroDivisionError) as err:
            value = f"error: {err}"
        return CalcObservation(value=value)  # never done: with `lifetime: episode` one calculator serves every call

    @property
    def state(self) -> State:
        return self._state
