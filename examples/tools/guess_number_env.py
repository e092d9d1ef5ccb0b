"""Guess the number, an OpenEnv environment with state across the model's turns: served as a tool by
`rl_tpu.episodes.openenv_tool.OpenEnvTool` with `lifetime: episode` (guess_number.yaml), so every guess of an
episode is a step of the same game. Each guess is answered "higher", "lower" or "correct"; the correct guess ends
the game with reward 1, less 0.1 for every earlier guess.

guess_number_server.py serves the same game from an OpenEnv server (guess_number_remote.yaml).

The secret comes from the row's `extra_info.tools_kwargs.guess.create_kwargs` (`target`, or `seed` to draw it),
between `low` and `high` (default 1 and 100). `feedback=False` (the YAML's `environment_kwargs`,
guess_number_no_feedback.yaml) answers every wrong guess "wrong", with no direction: the control of
recipes/guess_number, where reading the answers cannot help.
"""

from __future__ import annotations

import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: int = Field(description="your guess, an integer")


class GuessObservation(Observation):
    hint: str = ""  # higher | lower | correct (without feedback: wrong | correct)
    guesses: int = 0  # guesses so far in this game


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret integer: each guess is answered higher, lower or correct."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session is an instance of its own (guess_number_server.py)

    def __init__(self, feedback: bool = True):
        super().__init__()
        self._state, self._target, self._feedback = State(), 0, feedback

    def reset(self, seed=None, episode_id=None, target=None, low=1, high=100, **kwargs) -> GuessObservation:
        if target is None:
            target = random.Random(seed).randint(low, high)
        if not low <= target <= high:
            raise ValueError(f"guess_number: target {target} is outside [{low}, {high}]")
        self._state, self._target = State(episode_id=episode_id), target
        return GuessObservation()

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._target:
            reward = max(0.0, 1.0 - 0.1 * (self._state.step_count - 1))
            return GuessObservation(hint="correct", guesses=self._state.step_count, done=True, reward=reward)
        hint = "wrong" if not self._feedback else "higher" if self._target > action.guess else "lower"
        return GuessObservation(hint=hint, guesses=self._state.step_count)

    @property
    def state(self) -> State:
        return self._state
