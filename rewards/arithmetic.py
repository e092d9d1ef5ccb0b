"""Arithmetic reward: 1.0 iff the first integer of the answer equals the ground truth. The answer is the completion
after its last tool result (`</tool_response>`), tool calls left out: numbers in tool calls and results are not
answers. rl_tpu passes an episode's final model turn before any tool call already (docs/episodes.md); the rule
still holds for a whole decoded episode, as verl's reward managers pass one.

A verl-signature `compute_score`, usable unchanged as a verl custom reward function.
"""

from __future__ import annotations

import re

_FIRST_INTEGER = re.compile(r"-?\d+")
_TOOL_RESULT_END = "</tool_response>"
_TOOL_CALL = re.compile(r"<tool_call>.*?(</tool_call>|$)", re.DOTALL)  # an unterminated call runs to the end


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    answer = _TOOL_CALL.sub(" ", solution_str.rpartition(_TOOL_RESULT_END)[2])
    match = _FIRST_INTEGER.search(answer)
    if match is None:
        return 0.0
    return 1.0 if int(match.group()) == int(ground_truth) else 0.0
