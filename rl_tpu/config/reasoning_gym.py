"""The `data.reasoning_gym` section: a reasoning-gym task generated in place of data files (rl_tpu/data/reasoning_gym.py),
scored by the task's own scorer (`reward.name=reasoning_gym`, rewards/reasoning_gym.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ReasoningGymConfig:
    # a reasoning-gym dataset name (basic_arithmetic, products, chain_sum, ..., or composite); None: data files
    task: Optional[str] = None
    # the task's config fields, as its config dataclass names them (e.g. {max_digits: 3}); composite: {datasets:
    # [{name, weight, config}, ...]}
    config: dict[str, Any] = field(default_factory=dict)
    size: int = 2000  # training prompts generated from data.seed; data.num_eval held-out ones from another seed
    # reasoning-gym's instruction (a key of reasoning_gym.utils.SYSTEM_PROMPTS) as the system turn; None: the
    # question alone
    system_prompt: Optional[str] = "default"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"data.reasoning_gym.size={self.size} must be at least 1")
        if "size" in self.config or "seed" in self.config:
            raise ValueError(
                "data.reasoning_gym.config: set the number of prompts with data.reasoning_gym.size and the seed with "
                "data.seed, not in the task's config"
            )
