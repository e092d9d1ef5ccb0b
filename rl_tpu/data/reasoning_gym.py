"""reasoning-gym tasks as a data source: `data.reasoning_gym.task` names one of its procedural generators, whose
entries become verl rows (written once per setting into the cache, like the arithmetic task's), scored by the
task's own `score_answer` (rewards/reasoning_gym.py).

A row's `extra_info.reasoning_gym` holds what regenerates its entry exactly (task, config, seed, size, index), so
the scorer gets the entry reasoning-gym made, metadata and all, without storing it. Training prompts come from
`data.seed`, held-out ones from another seed; a held-out question that is also a training question is dropped
(small task spaces repeat), so the held-out set may be smaller than `data.num_eval`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from rl_tpu.config.reasoning_gym import ReasoningGymConfig
from rl_tpu.data.datasets import write_verl_parquet

SOURCE_PREFIX = "reasoning_gym/"  # a row's data_source: the prefix and the task's name
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out entries' seed is data.seed plus this


def create_dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    """reasoning-gym's dataset for `task` (made by the reward's own `task_dataset`, so that rows and scores come
    from the same entries), with errors that name the key and what it allows."""
    from reasoning_gym.factory import DATASETS

    from rewards.reasoning_gym import task_dataset

    if task not in DATASETS:
        raise ValueError(f"data.reasoning_gym.task={task!r}: allowed values are {', '.join(sorted(DATASETS))}")
    fields = [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in ("seed", "size")]
    unknown = sorted(set(json.loads(config_json)) - set(fields))
    if unknown:
        raise ValueError(
            f"data.reasoning_gym.config: {', '.join(unknown)} not a field of {task}'s config; allowed keys are "
            f"{', '.join(fields)}"
        )
    try:
        return task_dataset(task, config_json, seed, size)
    except (AssertionError, ValueError, TypeError) as err:  # its configs check themselves with assert
        raise ValueError(f"data.reasoning_gym (task {task}, config {config_json}): {err}") from err


def entry_rows(cfg: ReasoningGymConfig, seed: int, size: int, split: str, skip: set[str]) -> list[dict]:
    """The task's entries `0..size-1` at `seed` as verl rows, leaving out questions in `skip`."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if cfg.system_prompt is not None and cfg.system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(
            f"data.reasoning_gym.system_prompt={cfg.system_prompt!r}: allowed values are "
            f"{', '.join(SYSTEM_PROMPTS)} or null (the question alone)"
        )
    system = [{"role": "system", "content": SYSTEM_PROMPTS[cfg.system_prompt]}] if cfg.system_prompt else []
    config_json = json.dumps(cfg.config)  # as the row carries it, for the scorer to make the same dataset
    dataset = create_dataset(cfg.task, config_json, seed, size)
    rows = []
    for index in range(size):
        entry = dataset[index]
        if entry["question"] in skip:
            continue
        source = {"task": cfg.task, "config": config_json, "seed": seed, "size": size, "index": index}
        rows.append(
            {
                "data_source": SOURCE_PREFIX + cfg.task,
                "prompt": [*system, {"role": "user", "content": entry["question"]}],
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {"split": split, "index": index, "reasoning_gym": source},
            }
        )
    return rows


def ensure_reasoning_gym_dataset(
    cache_dir: Path, cfg: ReasoningGymConfig, num_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write the task's train / test parquet files once per setting (and reasoning-gym version); return their paths."""
    version = importlib.metadata.version("reasoning-gym")
    setting = [cfg.task, cfg.config, cfg.size, cfg.system_prompt, num_eval, seed, version]
    key = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir / f"reasoning_gym-{cfg.task}-{key}"
    train_path, test_path = folder / "train.parquet", folder / "test.parquet"
    if not (train_path.exists() and test_path.exists()):
        train = entry_rows(cfg, seed, cfg.size, "train", skip=set())
        questions = {row["prompt"][-1]["content"] for row in train}
        test = entry_rows(cfg, seed + HELD_OUT_SEED_OFFSET, num_eval, "test", skip=questions)
        if not test:
            raise ValueError(
                f"data.reasoning_gym.task={cfg.task}: every one of the {num_eval} held-out questions is also a "
                "training question (a small task space); lower data.reasoning_gym.size or widen the task's config"
            )
        write_verl_parquet(train, train_path)
        write_verl_parquet(test, test_path)
    return train_path, test_path
