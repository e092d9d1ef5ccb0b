"""GSM8K reward: 1.0 iff the completion's final number equals the reference answer.

The final answer is the first number after the last ``####`` (the format verl's GSM8K prompt
asks for) or, when there is no ``####``, the last number in the text. Numbers compare as
decimals after dropping ``$``, thousands separators and trailing units, so ``$1,200.00``,
``1200 dollars`` and ``1200`` are the same answer. The ground truth may be the bare answer
(verl's parquet) or a whole GSM8K solution ending in ``#### N``.

A verl-signature `compute_score` with no imports from this repository: usable unchanged as a
verl custom reward function (``custom_reward_function.path=rewards/gsm8k.py``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")
_MARKER = "####"
# Long completions: the answer is at the end, and scanning megabytes of text is wasted time.
_TAIL_CHARS = 2000


def extract_answer(text: str) -> Decimal | None:
    """The final numeric answer of a solution text, or None when it has none."""
    text = text[-_TAIL_CHARS:].replace("$", "")
    if _MARKER in text:
        numbers = _NUMBER.findall(text.rsplit(_MARKER, 1)[1])
        chosen = numbers[0] if numbers else None
    else:
        numbers = _NUMBER.findall(text)
        chosen = numbers[-1] if numbers else None
    if chosen is None:
        return None
    try:
        return Decimal(chosen.replace(",", ""))
    except InvalidOperation:
        return None


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs
) -> float:
    expected = extract_answer(str(ground_truth))
    if expected is None:
        raise ValueError(f"gsm8k reward: ground truth {ground_truth!r} has no number")
    answer = extract_answer(solution_str)
    return 1.0 if answer is not None and answer == expected else 0.0
