"""recipes/guess_number: the warm start's games read exactly as the environment answers them (feedback on and
off), their ids and mask are the episode the loop makes, the control's switch takes the direction away, the rows
are the committed data files, and the reward reads the game off the episode's environment turns."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from rl_tpu.config import DataConfig, TinyModelConfig
from rl_tpu.data.guess_number import GUESS_TOOL, guess_result, guess_rows, random_game
from rl_tpu.episodes.openenv_tool import OpenEnvTool
from rl_tpu.models.resolve import _segment_ids, preset_folder_name, preset_key_fields
from rl_tpu.models.tiny import build_tokenizer

TOOLS = REPO / "examples/tools"
RECIPE = REPO / "recipes/guess_number"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def tools_on_path():
    sys.path.insert(0, str(TOOLS))  # the tools YAML names guess_number_env by module, as the workers import it
    yield
    sys.path.remove(str(TOOLS))


def tool_of(yaml_name: str) -> OpenEnvTool:
    [entry] = yaml.safe_load((TOOLS / yaml_name).read_text())["tools"]
    return OpenEnvTool(entry["config"])


def play(tool: OpenEnvTool, secret: int, guesses: list[int]) -> list[str]:
    """The environment's turns after each guess, as the plain renderer appends them, up to the one that wins."""

    async def game() -> list[str]:
        instance, _ = await tool.create(create_kwargs={"target": secret, "low": 1, "high": 7})
        texts = []
        for guess in guesses:
            response, _, metrics = await tool.execute(instance, {"guess": guess})
            texts.append(response.text)
            if metrics["done"]:
                break
        await tool.release(instance)
        return texts

    return [f"\n<tool_response>\n{text}\n</tool_response>\n" for text in asyncio.run(game())]


def test_the_control_switch_answers_wrong_with_no_direction():
    with_feedback, without = tool_of("guess_number_game.yaml"), tool_of("guess_number_no_feedback.yaml")
    assert [json.loads(t.split("\n")[2])["hint"] for t in play(with_feedback, 5, [2, 7, 5])] == [
        "higher",
        "lower",
        "correct",
    ]
    assert [json.loads(t.split("\n")[2])["hint"] for t in play(without, 5, [2, 7, 5])] == ["wrong", "wrong", "correct"]

    # the numbers still possible: narrowed by each answer with feedback, the whole range without
    def possible(tool: OpenEnvTool) -> list[tuple[int, int]]:
        fields = [json.loads(t.split("\n")[2]) for t in play(tool, 5, [2, 7, 5])]
        return [(f["low"], f["high"]) for f in fields]

    assert possible(with_feedback) == [(3, 7), (3, 6), (3, 6)] and possible(without) == [(1, 7)] * 3


@pytest.mark.parametrize("feedback", [True, False])
def test_the_warm_starts_games_are_what_the_environment_answers(feedback):
    """Each warm-start game: guesses in range, stopping at the correct one or the third; every answer exactly the
    text the environment (through its YAML and OpenEnvTool) gives the same guesses; then the end of sequence."""
    tool = tool_of("guess_number_game.yaml" if feedback else "guess_number_no_feedback.yaml")
    rng = random.Random(0)
    for _ in range(40):
        game = random_game(rng, 1, 7, 3, feedback)
        assert game[-1] == ("", True) and [by_model for _, by_model in game[:-1]] == [True, False] * (len(game) // 2)
        calls = [json.loads(text.removeprefix(" <tool_call>").removesuffix("</tool_call>")) for text, _ in game[:-1:2]]
        assert all(c["name"] == GUESS_TOOL and 1 <= c["arguments"]["guess"] <= 7 for c in calls) and len(calls) <= 3
        guesses = [c["arguments"]["guess"] for c in calls]
        answers = [text for text, _ in game[1::2]]
        secrets = [s for s in range(1, 8) if play(tool, s, guesses) == answers]
        if '"correct"' in answers[-1]:
            assert secrets == [guesses[-1]]
        else:  # lost: three guesses, each answered for a secret none of them is
            assert len(calls) == 3 and secrets and not set(secrets) & set(guesses)


def test_a_warm_start_game_as_ids_masks_the_answers_and_ends_on_the_end_of_sequence():
    tokenizer = build_tokenizer(512, True, extra_lines=[])
    game = [(" <tool_call>x</tool_call>", True), (guess_result("lower", 1, 3, 1), False), ("", True)]
    ids, mask = _segment_ids(tokenizer, game)
    call, answer = tokenizer(game[0][0])["input_ids"], tokenizer.encode(game[1][0], add_special_tokens=False)
    assert ids == call + answer + [tokenizer.eos_token_id]
    assert mask == [1] * len(call) + [0] * len(answer) + [1]


def test_the_game_keys_join_the_presets_key_only_when_set():
    """Unset, the cache folders built before them (and the shipped presets' names) stay valid."""
    assert not {"warm_start_guess_max", "warm_start_guess_turns"} & set(preset_key_fields(TinyModelConfig()))
    data = DataConfig()
    arithmetic = preset_folder_name(TinyModelConfig(), data)
    game = preset_folder_name(TinyModelConfig(warm_start_guess_max=7), data)
    longer = preset_folder_name(TinyModelConfig(warm_start_guess_max=7, warm_start_guess_turns=4), data)
    assert len({arithmetic, game, longer}) == 3


def test_the_recipes_data_files_are_the_generated_rows():
    for split, copies in (("train", 16), ("val", 1)):
        rows = [json.loads(line) for line in (RECIPE / f"data/{split}.jsonl").read_text().splitlines()]
        assert rows == guess_rows(1, 7, copies, split)
    assert {r["extra_info"]["tools_kwargs"][GUESS_TOOL]["create_kwargs"]["target"] for r in rows} == set(range(1, 8))


def test_the_reward_is_a_game_won_read_from_the_environments_turns():
    reward = load(RECIPE / "reward.py", "guess_number_reward")

    def score(*answers: str) -> dict:
        turns = []
        for count, answer in enumerate(answers, 1):
            turns += [
                {"role": "model", "text": "call"},
                {"role": "environment", "text": guess_result(answer, 1, 7, count)},
            ]
        return reward.compute_score("s", "", "4", {"episode": {"turns": turns, "text": "", "truncated": None}})

    assert score("higher", "correct") == {"score": 1.0, "guesses": 2.0, "won_at": 2}
    assert score("higher", "lower", "wrong") == {"score": 0.0, "guesses": 3.0, "won_at": None}
    assert score() == {"score": 0.0, "guesses": 0.0, "won_at": None}
    with pytest.raises(ValueError, match="episode.enable=true"):
        reward.compute_score("s", "4", "4", {})
