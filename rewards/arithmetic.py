"""Arithmetic reward: 1.0 iff the first integer in the completion equals the answer.

A verl-signature `compute_score`, usable unchanged as a verl custom reward function.
"""

from __future__ import annotations

import re

_FIRST_INTEGER = re.compile(r"-?\d+")


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    match = _FIRST_INTEGER.search(solution_str)
    if match is None:
        return 0.0
    return 1.0 if int(match.group()) == int(ground_truth) else 0.0
