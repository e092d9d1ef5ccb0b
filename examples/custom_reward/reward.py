"""A reward plugin written for verl, used by rl_tpu unchanged.

verl loads it with `custom_reward_function.path=examples/custom_reward/reward.py`
`custom_reward_function.name=compute_score`; so does rl_tpu. It gives full credit for the
exact answer, partial credit for an answer off by one, and returns verl's dict form: `score`
is the reward, the other numeric fields are logged as metrics (`reward/extra/custom/...`).
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"-?\d+", solution_str)
    if match is None:
        return {"score": 0.0, "exact": 0.0, "answered": 0.0}
    error = abs(int(match.group()) - int(ground_truth))
    score = 1.0 if error == 0 else 0.3 if error == 1 else 0.0
    return {"score": score, "exact": float(error == 0), "answered": 1.0}
