"""The `data` section: the training and held-out prompts (files, a reasoning-gym task or the arithmetic task)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_tpu.config.reasoning_gym import ReasoningGymConfig


@dataclass
class DataConfig:
    # verl-schema .parquet or .jsonl (or plain question/answer JSONL via prompt_key / answer_key);
    # unset: the synthetic arithmetic task
    train_files: Optional[str] = None
    val_files: Optional[str] = None
    prompt_key: str = "prompt"  # the column holding chat messages or a plain prompt string
    answer_key: Optional[str] = None  # a column holding the ground truth; None: reward_model.ground_truth
    data_source: Optional[str] = None  # for rows without a data_source column; None: the file name
    train_batch_size: int = 16  # prompts per step (each gets sampler.n completions)
    max_prompt_length: int = 64
    filter_overlong_prompts: bool = True  # skip (and count) longer prompts; false: stop with an error
    val_max_samples: Optional[int] = None  # evaluate on the first N validation prompts only
    seed: int = 0  # the arithmetic task's train / held-out split (and so the tiny model's warm start)
    # the order of the training prompts; None: data.seed. A run's seeds are this, sampler.seed and seed: changing
    # them alone keeps the model and the held-out set
    shuffle_seed: Optional[int] = None
    # a reasoning-gym task generated in place of data files, e.g. data.reasoning_gym.task=products
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    # the synthetic arithmetic task (used when neither train_files nor reasoning_gym.task is set)
    ops: str = "+-"
    max_operand: int = 99
    num_eval: int = 512  # exactly this many held-out problems; 47*83 and 83*47 on one side (reference-workload.md)

    def __post_init__(self) -> None:
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size={self.train_batch_size} must be at least 1")
        if self.train_files and self.reasoning_gym.task:
            raise ValueError(
                f"data.train_files={self.train_files!r} and data.reasoning_gym.task={self.reasoning_gym.task!r} are both "
                "set: a run trains on data files or on a reasoning-gym task, not both"
            )
