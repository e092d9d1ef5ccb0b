"""Guess the number, the game of recipes/guess_number: its prompt and rows, and the games the tiny preset's warm
start imitates (a player who guesses at random in 1..7 and ignores every answer).

The environment is examples/tools/guess_number_env.py, served through `rl_tpu.episodes.openenv_tool.OpenEnvTool`
with `lifetime: episode`; what it answers a guess is written here exactly as the model reads it
(`observation_text` of its observation), which tests/unit/test_guess_number.py checks against the environment.
"""

from __future__ import annotations

import json
import random

from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.data.datasets import verl_rule_row

GUESS_SOURCE = "rl_tpu/guess_number"
# the tool's name in examples/tools/guess_number_game.yaml: not its argument's ("guess"), so that no token of a call
# is followed by two different ones (with both "guess", a perturbed policy wrote '{"name": "guess": 2}}')
GUESS_TOOL = "play"
# names the games' text and how the warm start reads it in the tiny preset's cache key (1: the tool was "guess";
# 2: no range in the answers; 3: the answers out of the warm start's loss)
GAME_FORMAT = 4
TOOL_RESPONSE_FORMAT = EpisodeConfig.tool_response_format  # the plain renderer's text around a result


def guess_prompt(low: int, high: int) -> str:
    return f"Q: Guess my number from {low} to {high}. A:"


def hint(secret: int, guess: int, feedback: bool) -> str:
    """The environment's answer: correct, or the direction (higher, lower); without `feedback`, only "wrong"."""
    if guess == secret:
        return "correct"
    if not feedback:
        return "wrong"
    return "higher" if secret > guess else "lower"


def narrowed(low: int, high: int, guess: int, answer: str) -> tuple[int, int]:
    """The numbers still possible after `answer` to `guess` (an answer "wrong" or "correct" narrows nothing)."""
    if answer == "higher":
        return max(low, guess + 1), high
    if answer == "lower":
        return low, min(high, guess - 1)
    return low, high


def guess_call(guess: int) -> str:
    """A model turn that guesses (Hermes format, the turn ending at its `</tool_call>` stop string)."""
    return " <tool_call>" + json.dumps({"name": GUESS_TOOL, "arguments": {"guess": guess}}) + "</tool_call>"


def guess_result(answer: str, low: int, high: int, guesses: int) -> str:
    """The environment's turn after a guess, as the plain renderer appends it (the observation's fields as JSON):
    the answer, the numbers still possible from what it said so far, and the guesses made."""
    fields = {"hint": answer, "low": low, "high": high, "guesses": guesses}
    return TOOL_RESPONSE_FORMAT.format(result=json.dumps(fields))


def random_game(rng: random.Random, low: int, high: int, max_guesses: int, feedback: bool) -> list[tuple[str, bool]]:
    """A warm-start game, as (text, the model wrote it) segments after the prompt: a random secret, guesses drawn
    at random in low..high whatever the answers, until a guess is correct or `max_guesses` were made; then the player
    stops (its last turn is the end of sequence, left to the tokenizer: an empty model segment)."""
    secret, segments = rng.randint(low, high), []
    possible = (low, high)
    for count in range(1, max_guesses + 1):
        guess = rng.randint(low, high)
        answer = hint(secret, guess, feedback)
        possible = narrowed(*possible, guess, answer)
        segments += [(guess_call(guess), True), (guess_result(answer, *possible, count), False)]
        if answer == "correct":
            break
    return segments + [("", True)]


def guess_rows(low: int, high: int, copies: int, split: str) -> list[dict]:
    """Every secret in low..high, `copies` times each: verl rows whose `tools_kwargs` reset the game to it."""
    rows = []
    for copy in range(copies):
        for secret in range(low, high + 1):
            create = {"target": secret, "low": low, "high": high}
            extra_info = {
                "split": split,
                "index": len(rows),
                "tools_kwargs": {GUESS_TOOL: {"create_kwargs": create}},
            }
            rows.append(verl_rule_row(GUESS_SOURCE, guess_prompt(low, high), str(secret), extra_info))
    return rows


def game_corpus(high: int, max_guesses: int, games: int = 2000) -> list[str]:
    """Whole random games (prompt and turns, either kind of answers) for the tiny tokenizer's training corpus, so
    that a guess's and an answer's fixed text are a few tokens."""
    rng = random.Random(0)
    return [
        guess_prompt(1, high) + "".join(text for text, _ in random_game(rng, 1, high, max_guesses, feedback))
        for feedback in (True, False)
        for _ in range(games // 2)
    ]
