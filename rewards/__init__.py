"""Built-in rewards: one verl-signature `compute_score` per module, selected by `reward.name`.

`compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`

`solution_str` is the decoded completion, or in an episode the model's final turn before any tool call (never a
tool's text); the whole episode is in `extra_info["episode"]` (rl_tpu/controller/rollouts.py, `grade`).

Each module imports nothing from rl_tpu, so it can be tested on its own and handed to verl
unchanged as a custom reward function. How rewards are run (worker processes, timeouts,
weights) is `rl_tpu.grader`'s business.
"""

BUILTIN_REWARDS = ("arithmetic", "gsm8k", "math", "format", "reasoning_gym")
