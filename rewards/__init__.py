"""Reward functions with verl's signature, and the loader that picks one by name.

`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`
"""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[..., "float | dict"]

BUILTIN_REWARDS = ("arithmetic",)


def load_reward(name: str) -> RewardFn:
    """The built-in reward `name` (a module of this package exporting `compute_score`)."""
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"reward.name={name!r}: allowed values are {', '.join(BUILTIN_REWARDS)}")
    return importlib.import_module(f"rewards.{name}").compute_score
