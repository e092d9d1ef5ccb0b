"""Format reward: 1.0 iff the completion states a final answer in a form a verifier can read.

Accepted forms: a ``\\boxed{...}`` with content, or a ``#### <number>`` line (verl's GSM8K
convention). Meant to be mixed in with a small weight (``reward.combine``), so that a policy
that has not yet learned to answer still gets a signal for answering in the right form.

A verl-signature `compute_score` with no imports from this repository.
"""

from __future__ import annotations

import re

_FINAL_ANSWER = re.compile(r"\\boxed\s*\{\s*[^}\s]|####\s*\$?-?[\d.,]*\d")


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    return 1.0 if _FINAL_ANSWER.search(solution_str) else 0.0
