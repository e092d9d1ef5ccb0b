"""The `reward` section and verl's `custom_reward_function` key: which reward functions score the completions, and the
limits of the worker processes they run in (rl_tpu/grader/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class CustomRewardConfig:
    """A verl-signature reward function in a Python file, as verl's `custom_reward_function`."""

    path: Optional[str] = None
    name: str = "compute_score"
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of every call
    # verl's batch form takes lists (`data_sources`, `solution_strs`, ...); None: read it from the signature
    batched: Optional[bool] = None


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment, by verl's keys: completions longer than sampler.response_length - len
    lose up to penalty_factor, in proportion to how far into the buffer they reach. An episode counts its model
    tokens only, against episode.max_tokens."""

    enable: bool = False
    len: Optional[int] = None  # the buffer's length in tokens; None: a fifth of it (DAPO: 4096 of 20480)
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    name: str = "arithmetic"  # a built-in: arithmetic, gsm8k, math, format, reasoning_gym (rewards/NAME.py)
    # A weighted sum instead of one reward, e.g. {gsm8k: 1.0, format: 0.1}; the key `custom` is the
    # plugin. It must include the primary reward (`custom` when set, else `name`): eval/accuracy.
    combine: dict[str, float] = field(default_factory=dict)
    custom: CustomRewardConfig = field(default_factory=CustomRewardConfig)  # when path is set: the primary
    num_workers: Optional[int] = None  # reward worker processes; None: min(4, cores)
    timeout_s: float = 10.0  # per sample; a sample past it scores 0 and its worker is replaced
    max_failure_rate: float = 0.1  # stop the run when a larger fraction of one batch fails to score
    # Reward code runs as trusted code, but bounded: the address space each worker may add once its plugin is
    # loaded (RLIMIT_AS; a sample that allocates past it fails) and CPU seconds per sample (RLIMIT_CPU); null: no limit
    worker_memory_mb: Optional[int] = 4096
    # environment variables a worker keeps (besides PATH, HOME, locale and temp-dir ones); secrets stay out
    pass_env: list[str] = field(default_factory=list)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def __post_init__(self) -> None:
        memory = self.worker_memory_mb
        if not 0.0 <= self.max_failure_rate <= 1.0 or self.timeout_s <= 0 or (memory is not None and memory <= 0):
            raise ValueError(
                f"reward.max_failure_rate={self.max_failure_rate} must be in [0, 1], reward.timeout_s="
                f"{self.timeout_s} > 0 and reward.worker_memory_mb={memory} > 0 (null: no limit)"
            )
