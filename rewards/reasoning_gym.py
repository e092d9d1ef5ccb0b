"""reasoning-gym's own scorer for rows of `data.reasoning_gym` (rl_tpu/data/reasoning_gym.py), unchanged.

The answer is what the completion puts between ``<answer>`` tags (reasoning-gym's `extract_answer`, as its
instruction asks); no tags: 0. The row's `extra_info.reasoning_gym` regenerates the entry (task, config, seed,
size, index), and the task's `score_answer(answer, entry)` scores it: 1.0 for a correct answer, and for some tasks
partial credit (reasoning-gym's default gives `len(answer) / len(given)` when the given text merely contains it).

A verl-signature `compute_score` with no imports from this repository.
"""

from __future__ import annotations

import functools
import json


@functools.lru_cache(maxsize=8)
def task_dataset(task: str, config_json: str, seed: int, size: int):
    """reasoning-gym's dataset of a row's `extra_info.reasoning_gym` (its config as JSON): the one function that
    makes a task's entries, for the rows (rl_tpu/data/reasoning_gym.py) and for scoring them."""
    import reasoning_gym

    config = json.loads(config_json)
    if task == "composite":  # its mixture is a list of DatasetSpec objects
        from reasoning_gym.composite import DatasetSpec

        config["datasets"] = [DatasetSpec(**spec) for spec in config.get("datasets", [])]
    return reasoning_gym.create_dataset(task, seed=seed, size=size, **config)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    from reasoning_gym.utils import extract_answer

    source = (extra_info or {}).get("reasoning_gym")
    if not source:
        raise ValueError(
            f"reward reasoning_gym: a row of {data_source!r} has no extra_info.reasoning_gym; it scores the rows "
            "that data.reasoning_gym.task generates"
        )
    dataset = task_dataset(source["task"], source["config"], int(source["seed"]), int(source["size"]))
    entry = dataset[int(source["index"])]
    if str(entry["answer"]) != str(ground_truth):  # a row made by another reasoning-gym version, say
        raise ValueError(
            f"reward reasoning_gym: {source['task']} entry {source['index']} regenerates with answer "
            f"{entry['answer']!r}, but the row's ground truth is {ground_truth!r}"
        )
    answer = extract_answer(solution_str)
    return 0.0 if answer is None else float(dataset.score_answer(answer, entry))
