"""The arithmetic dataset, verl-schema loading with row-level errors, and the arithmetic reward."""

from __future__ import annotations

import pandas as pd
import pytest

from rewards import load_reward
from rewards.arithmetic import compute_score
from rl_tpu.data import batches, ensure_arithmetic_dataset, load_examples, split_arithmetic_problems


def test_split_is_exhaustive_and_disjoint():
    train, test = split_arithmetic_problems("+-", 99, 512, seed=0)
    assert len(test) == 512 and len(train) == 2 * 100 * 100 - 512
    assert not set(train) & set(test)
    assert split_arithmetic_problems("+-", 99, 512, seed=0) == (train, test)  # deterministic
    with pytest.raises(ValueError, match="allowed characters"):
        split_arithmetic_problems("+/", 99, 10, seed=0)


def test_dataset_is_verl_schema_and_loads(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    train_path, test_path = ensure_arithmetic_dataset(tmp_path, "+-", 20, 50, seed=0)
    row = pd.read_parquet(test_path).iloc[0].to_dict()
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Q: What is ")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = load_examples(test_path, tokenizer, max_prompt_length=64)
    assert len(examples) == 50
    first = examples[0]
    assert tokenizer.decode(first.prompt_ids) == row["prompt"][0]["content"]
    assert first.ground_truth == row["reward_model"]["ground_truth"]


@pytest.mark.parametrize("field, bad, message", [
    ("prompt", [], "row 2: field 'prompt' must be a non-empty list"),
    ("reward_model", None, "row 2: missing field 'reward_model'"),
    ("reward_model", {"style": "rule"}, "row 2: missing field 'reward_model.ground_truth'"),
])
def test_bad_row_names_file_row_and_field(tmp_path, tiny_model_dir, field, bad, message):
    from transformers import AutoTokenizer

    _, test_path = ensure_arithmetic_dataset(tmp_path, "+", 9, 5, seed=0)
    frame = pd.read_parquet(test_path)
    frame.at[2, field] = bad
    broken = tmp_path / "broken.parquet"
    frame.to_parquet(broken)
    with pytest.raises(ValueError, match=str(broken).replace(".", r"\.") + ": " + message.replace("'", "'")):
        load_examples(broken, AutoTokenizer.from_pretrained(tiny_model_dir), max_prompt_length=64)


def test_too_long_prompt_is_an_error_not_a_silent_drop(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    _, test_path = ensure_arithmetic_dataset(tmp_path, "+", 9, 5, seed=0)
    with pytest.raises(ValueError, match="row 0: prompt has .* tokens, over data.max_prompt_length=4"):
        load_examples(test_path, AutoTokenizer.from_pretrained(tiny_model_dir), max_prompt_length=4)


def test_batches_cover_every_example_once_per_epoch():
    items = list(range(10))
    stream = batches(items, 5, seed=1)
    epoch = next(stream) + next(stream)
    assert sorted(epoch) == items


@pytest.mark.parametrize("completion, truth, expected", [
    (" 42", "42", 1.0), (" -7 and more", "-7", 1.0), (" 41", "42", 0.0), ("", "3", 0.0),
    (" 4 2", "42", 0.0), (" 042", "42", 1.0), (" 12 13", "13", 0.0),
])
def test_arithmetic_reward_reads_the_first_integer(completion, truth, expected):
    assert compute_score("rl_tpu/arithmetic", completion, truth) == expected


def test_unknown_reward_names_allowed_values():
    with pytest.raises(ValueError, match="reward.name='arith': allowed values are arithmetic"):
        load_reward("arith")


@pytest.mark.parametrize("a, op, b, expected", [
    (57, "+", 68, 115), (12, "+", 34, 46), (99, "+", 99, 188),  # 46: no carry, the teacher is right
    (62, "-", 27, 45), (27, "-", 62, -45), (50, "-", 50, 0), (3, "-", 9, -6), (95, "-", 31, 64),
])
def test_forgetful_teacher_writes_columns_without_carry(a, op, b, expected):
    from rl_tpu.data import answer_without_carry

    assert answer_without_carry(a, op, b) == expected
