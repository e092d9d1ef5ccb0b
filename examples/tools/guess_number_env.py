"""Guess the number, an OpenEnv environment with state across the model's turns: served as a tool by
`rl_tpu.episodes.openenv_tool.OpenEnvTool` with `lifetime: episode` (guess_number.yaml), so every guess of an
episode is a step of the same game. Each guess is answered "higher", "lower" or "correct", with the numbers still
possible after every answer so far (`low`..`high`); the correct guess ends the game with reward 1, less 0.1 for every
earlier guess.

guess_number_server.py serves the same game from an OpenEnv server (guess_number_remote.yaml).

The secret comes from the row's `extra_info.tools_kwargs.guess.create_kwargs` (`target`, or `seed` to draw it),
between `low` and `high` (default 1 and 100). `feedback=False` (the YAML's `environment_kwargs`,
guess_number_no_feedback.yaml) answers every wrong guess "wrong", with no direction and the whole range: the
control of recipes/guess_number, where reading the answers cannot help.
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
    low: int = 0  # the numbers still possible after the answers so far: low..high
    high: int = 0
    guesses: int = 0  # guesses so far in this game


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret integer: each guess is answered higher, lower or correct."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session is an instance of its own (guess_number_server.py)

    def __init__(self, feedback: bool = True):
        super().__init__()
        self._state, self._target, self._feedback = State(), 0, feedback
        self._low, self._high = 0, 0

    def reset(self, seed=None, episode_id=None, target=None, low=1, high=100, **kwargs) -> GuessObservation:
        if target is None:
            target = random.Random(seed).randint(low, high)
        if not low <= target <= high:
            raise ValueError(f"guess_number: target {target} is outside [{low}, {high}]")
        self._state, self._target = State(episode_id=episode_id), target
        self._low, self._high = low, high
        return GuessObservation(low=low, high=high)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        count = self._state.step_count
        if action.guess == self._target:
            reward = max(0.0, 1.0 - 0.1 * (count - 1))
            return GuessObservation(
                hint="correct", low=self._low, high=self._high, guesses=count, done=True, reward=reward
            )
        if not self._feedback:
            return GuessObservation(hint="wrong", low=self._low, high=self._high, guesses=count)
        if self._target > action.guess:
            hint, self._low = "higher", max(self._low, action.guess + 1)
        else:
            hint, self._high = "lower", min(self._high, action.guess - 1)
        return GuessObservation(hint=hint, low=self._low, high=self._high, guesses=count)

    @property
    def state(self) -> State:
        return self._state
