"""The reward of recipes/guess_number: 1.0 when the game was won within the turn limit, read from the episode's
environment turns (an answer "correct"); the limit is the episode's (`episode.max_turns` less the turn after the
last guess), so a game the loop ended is lost.

Beside the score (verl's dict form, logged as `reward/extra/custom/...` and `eval/extra/custom/...`): `guesses`, the
game's guesses (its environment turns); `won_at`, the guess that won (absent from a lost game, so its mean is over
won games only).
"""

from __future__ import annotations

import json

CORRECT = "correct"


def hints(turns: list[dict]) -> list[str]:
    """The answer of each environment turn: the observation's `hint`, or "" for a line that is not one (a failed
    or refused call)."""
    answers = []
    for turn in turns:
        if turn["role"] != "environment":
            continue
        text = turn["text"].strip().removeprefix("<tool_response>").removesuffix("</tool_response>").strip()
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        answers.append(fields.get("hint", "") if isinstance(fields, dict) else "")
    return answers


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    episode = (extra_info or {}).get("episode")
    if episode is None:
        raise ValueError("guess_number's reward reads an episode: run it with episode.enable=true")
    answers = hints(episode["turns"])
    won_at = answers.index(CORRECT) + 1 if CORRECT in answers else None
    return {"score": float(won_at is not None), "guesses": float(len(answers)), "won_at": won_at}
