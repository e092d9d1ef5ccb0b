"""MATH reward: 1.0 iff the completion's final answer is mathematically equal to the reference.

The answer is the last ``\\boxed{...}`` of the completion, or, without one, the final answer
`math-verify` finds in the text; equality is decided by `math-verify` (fractions and
decimals, LaTeX, intervals, sets, matrices, symbolic expressions). The ground truth is the
bare reference answer, as in verl's MATH parquet (``reward_model.ground_truth``).

A verl-signature `compute_score` with no imports from this repository: usable unchanged as a
verl custom reward function (``custom_reward_function.path=rewards/math.py``).
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_BOXED_COMMANDS = ("\\boxed", "\\fbox")
_GOLD_TARGETS = (LatexExtractionConfig(),)
_ANSWER_TARGETS = (LatexExtractionConfig(), ExprExtractionConfig())


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent."""
    start = max(text.rfind(command) for command in _BOXED_COMMANDS)
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0:
        return None
    depth = 0
    for position in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[open_brace + 1 : position]
    return None  # unbalanced: the completion was cut off inside the box


def _timeout_s() -> int | None:
    # math-verify's own timeouts use SIGALRM, which exists only in the main thread; elsewhere
    # the caller (rl_tpu's reward pool) enforces the time limit.
    return 5 if threading.current_thread() is threading.main_thread() else None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """Whether LaTeX/plain `answer` equals `ground_truth` according to math-verify."""
    timeout = _timeout_s()
    gold = parse(f"\\boxed{{{ground_truth}}}", _GOLD_TARGETS, parsing_timeout=timeout)
    predicted = parse(f"\\boxed{{{answer}}}", _ANSWER_TARGETS, parsing_timeout=timeout)
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=timeout))


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    boxed = last_boxed(solution_str)
    if boxed is not None:
        return 1.0 if is_equivalent(boxed, str(ground_truth)) else 0.0
    timeout = _timeout_s()
    gold = parse(f"\\boxed{{{ground_truth}}}", _GOLD_TARGETS, parsing_timeout=timeout)
    predicted = parse(solution_str, _ANSWER_TARGETS, parsing_timeout=timeout)
    return 1.0 if gold and predicted and verify(gold, predicted, timeout_seconds=timeout) else 0.0
