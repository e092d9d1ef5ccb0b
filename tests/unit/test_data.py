"""Datasets: the arithmetic task, verl-schema parquet / JSONL / plain Q&A loading with row-level errors, prepare scripts."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
from conftest import REPO

from rl_tpu.config import DataConfig
from rl_tpu.data.arithmetic import ensure_arithmetic_dataset, problem_units, split_arithmetic_problems
from rl_tpu.data.datasets import batches, load_examples

GSM8K_FIXTURE = REPO / "tests" / "fixtures" / "gsm8k"
MATH_FIXTURE = REPO / "tests" / "fixtures" / "math"


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_split_is_exhaustive_and_disjoint():
    train, test = split_arithmetic_problems("+-", 99, 512, seed=0)
    assert len(test) == 512 and len(train) == 2 * 100 * 100 - 512
    assert not set(train) & set(test)
    assert split_arithmetic_problems("+-", 99, 512, seed=0) == (train, test)  # deterministic
    with pytest.raises(ValueError, match="allowed characters"):
        split_arithmetic_problems("+/", 99, 10, seed=0)


@pytest.mark.parametrize("ops, num_eval", [("+-", 512), ("*", 512), ("*", 511)])
def test_no_held_out_problem_has_its_twin_in_training(ops, num_eval):
    """47 * 83 held out and 83 * 47 trained on would leak the answer: commuted twins are held out together, and
    the held-out set is still exactly num_eval problems."""
    train, test = split_arithmetic_problems(ops, 99, num_eval, seed=0)
    commuted = {(b, op, a) for a, op, b in test if op in "+*"}
    assert len(test) == num_eval and len(train) + len(test) == len(ops) * 100 * 100
    assert not commuted & set(train)
    assert len(commuted & set(test)) == len(commuted)  # the twins are the held-out set's own


def test_a_num_eval_that_pairs_cannot_fill_is_refused():
    """0+0 and 1+1 shuffled first and the pair 0+1 / 1+0 last: 3 held-out places cannot be filled."""

    def pair_comes_last(seed: int) -> bool:
        units = problem_units("+", 1)
        random.Random(seed).shuffle(units)
        return len(units[-1]) == 2

    seed = next(s for s in range(100) if pair_comes_last(s))
    with pytest.raises(ValueError, match=r"data\.num_eval=3: .* fill 2 places: set data\.num_eval=2"):
        split_arithmetic_problems("+", 1, 3, seed=seed)


def test_dataset_is_verl_schema_and_loads(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    train_path, test_path = ensure_arithmetic_dataset(tmp_path, "+-", 20, 50, seed=0)
    row = pd.read_parquet(test_path).iloc[0].to_dict()
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].startswith("Q: What is ")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = load_examples(test_path, tokenizer, DataConfig(max_prompt_length=64))
    assert len(examples) == 50
    first = examples[0]
    assert tokenizer.decode(first.prompt_ids) == row["prompt"][0]["content"]
    assert first.ground_truth == row["reward_model"]["ground_truth"]


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("prompt", [], "row 2: field 'prompt' must be a non-empty list"),
        ("reward_model", None, "row 2: missing field 'reward_model'"),
        ("reward_model", {"style": "rule"}, "row 2: missing field 'reward_model.ground_truth'"),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path, tiny_model_dir, field, bad, message):
    from transformers import AutoTokenizer

    _, test_path = ensure_arithmetic_dataset(tmp_path, "+", 9, 5, seed=0)
    frame = pd.read_parquet(test_path)
    frame.at[2, field] = bad
    broken = tmp_path / "broken.parquet"
    frame.to_parquet(broken)
    with pytest.raises(ValueError, match=str(broken).replace(".", r"\.") + ": " + message.replace("'", "'")):
        load_examples(broken, AutoTokenizer.from_pretrained(tiny_model_dir), DataConfig())


def test_overlong_prompts_are_skipped_and_counted_or_raise(tmp_path, tiny_model_dir, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [{"question": q, "answer": "1"} for q in ["short", "a much longer question " * 5, "short too"]])
    cfg = DataConfig(prompt_key="question", answer_key="answer", max_prompt_length=12)
    with caplog.at_level("WARNING"):
        examples = load_examples(path, tokenizer, cfg)
    assert [tokenizer.decode(e.prompt_ids) for e in examples] == ["short", "short too"]
    assert "skipped 1 of 3 prompts longer than data.max_prompt_length=12 tokens (rows 1)" in caplog.text
    with pytest.raises(ValueError, match=r"row 1: prompt has \d+ tokens, over data.max_prompt_length=12"):
        load_examples(
            path,
            tokenizer,
            DataConfig(prompt_key="question", answer_key="answer", max_prompt_length=12, filter_overlong_prompts=False),
        )


def test_batches_cover_every_example_once_per_epoch():
    items = list(range(10))
    stream = batches(items, 5, seed=1)
    epoch = next(stream) + next(stream)
    assert sorted(epoch) == items


@pytest.mark.parametrize(
    "a, op, b, expected",
    [
        (57, "+", 68, 115),
        (12, "+", 34, 46),
        (99, "+", 99, 188),  # 46: no carry, the teacher is right
        (62, "-", 27, 45),
        (27, "-", 62, -45),
        (50, "-", 50, 0),
        (3, "-", 9, -6),
        (95, "-", 31, 64),
    ],
)
def test_forgetful_teacher_writes_columns_without_carry(a, op, b, expected):
    from rl_tpu.data.arithmetic import answer_without_carry

    assert answer_without_carry(a, op, b) == expected


def verl_row(question: str, truth, **extra) -> dict:
    return {
        "data_source": "my/source",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"index": 7, **extra},
    }


def test_verl_schema_jsonl_loads_like_parquet(tmp_path, tokenizer):
    rows = [verl_row("Q: What is 1 + 2? A:", "3"), verl_row("Q: What is 5 - 9? A:", "-4")]
    write_jsonl(tmp_path / "rows.jsonl", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet")
    from_jsonl = load_examples(tmp_path / "rows.jsonl", tokenizer, DataConfig())
    from_parquet = load_examples(tmp_path / "rows.parquet", tokenizer, DataConfig())
    assert from_jsonl == from_parquet
    assert [e.ground_truth for e in from_jsonl] == ["3", "-4"] and from_jsonl[0].data_source == "my/source"
    assert (
        from_jsonl[0].extra_info == {"index": 7}
        and tokenizer.decode(from_jsonl[1].prompt_ids) == "Q: What is 5 - 9? A:"
    )


def test_plain_question_answer_jsonl_through_the_column_mapping(tokenizer):
    cfg = DataConfig(prompt_key="question", answer_key="answer", max_prompt_length=1024, data_source="openai/gsm8k")
    examples = load_examples(GSM8K_FIXTURE / "test.jsonl", tokenizer, cfg)
    first = json.loads((GSM8K_FIXTURE / "test.jsonl").read_text().splitlines()[0])
    assert len(examples) == 8 and examples[0].data_source == "openai/gsm8k"
    assert tokenizer.decode(examples[0].prompt_ids) == first["question"]
    assert examples[0].ground_truth == first["answer"]  # the whole solution; the gsm8k reward reads its '####'
    assert (
        load_examples(
            GSM8K_FIXTURE / "test.jsonl",
            tokenizer,
            DataConfig(prompt_key="question", answer_key="answer", max_prompt_length=1024),
        )[0].data_source
        == "test.jsonl"
    )


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "   ", "reward_model": {"ground_truth": "1"}}, "row 1: field 'prompt' must be a non-empty list"),
        ({"prompt": [{"role": "user", "content": 5}], "reward_model": {"ground_truth": "1"}}, "row 1: field 'prompt'"),
        ({"reward_model": {"ground_truth": "1"}}, "row 1: missing field 'prompt'"),
        (
            {"prompt": "Q?", "reward_model": {"ground_truth": {"a": 1}}},
            "row 1: field 'reward_model.ground_truth' must be",
        ),
        ({"prompt": "Q?", "reward_model": {"ground_truth": ""}}, "row 1: missing field 'reward_model.ground_truth'"),
        ({"prompt": "Q?", "reward_model": {"ground_truth": "1"}, "data_source": 3}, "row 1: field 'data_source' must"),
        ({"prompt": "Q?", "reward_model": {"ground_truth": "1"}, "extra_info": [1]}, "row 1: field 'extra_info' must"),
    ],
)
def test_bad_jsonl_row_names_file_row_and_field(tmp_path, tokenizer, row, message):
    path = tmp_path / "rows.jsonl"
    write_jsonl(path, [verl_row("Q: fine? A:", "1"), row])
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        load_examples(path, tokenizer, DataConfig())


def test_unreadable_files_are_named(tmp_path, tokenizer):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n{not json\n')
    with pytest.raises(ValueError, match=r"rows.jsonl: line 2: not valid JSON"):
        load_examples(tmp_path / "rows.jsonl", tokenizer, DataConfig())
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unknown format '.csv'; allowed: .parquet, .jsonl, .json"):
        load_examples(tmp_path / "rows.csv", tokenizer, DataConfig())
    with pytest.raises(FileNotFoundError, match="missing.parquet does not exist"):
        load_examples(tmp_path / "missing.parquet", tokenizer, DataConfig())


def test_chat_template_of_the_tokenizer_is_applied(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    row = verl_row("What is 2 + 2?", "4")
    row["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    write_jsonl(tmp_path / "rows.jsonl", [row])
    (example,) = load_examples(tmp_path / "rows.jsonl", tokenizer, DataConfig())
    assert tokenizer.decode(example.prompt_ids) == "<system>Be brief.\n<user>What is 2 + 2?\n<assistant>"


def test_gsm8k_prepare_writes_verl_rows(tmp_path):
    import pyarrow.parquet as pq

    from recipes.grpo_gsm8k.prepare import INSTRUCTION, main

    main(["--input_dir", str(GSM8K_FIXTURE), "--output_dir", str(tmp_path)])
    assert pq.read_schema(tmp_path / "test.parquet").names == [
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    ]
    rows = pd.read_parquet(tmp_path / "test.parquet").to_dict("records")
    raw = [json.loads(line) for line in (GSM8K_FIXTURE / "test.jsonl").read_text().splitlines()]
    assert len(rows) == len(raw) == 8
    first = rows[0]
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert list(first["prompt"]) == [{"role": "user", "content": raw[0]["question"] + " " + INSTRUCTION}]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "18"}
    assert first["extra_info"] == {
        "split": "test",
        "index": 0,
        "answer": raw[0]["answer"],
        "question": raw[0]["question"],
    }
    assert [r["reward_model"]["ground_truth"] for r in rows] == [
        r["answer"].split("#### ")[1].replace(",", "") for r in raw
    ]


def test_gsm8k_prepare_names_a_row_without_final_answer(tmp_path):
    from recipes.grpo_gsm8k.prepare import main

    write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"train.jsonl: row 0: field 'answer' has no '#### <number>'"):
        main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])


def test_math_prepare_takes_the_last_boxed_answer(tmp_path):
    from recipes.grpo_math_boxed.prepare import INSTRUCTION, main

    main(["--input_dir", str(MATH_FIXTURE), "--output_dir", str(tmp_path)])
    rows = pd.read_parquet(tmp_path / "test.parquet").to_dict("records")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{3}", "3", "9\\pi", "[-1,3]"]
    assert rows[0]["prompt"][0]["content"].endswith(" " + INSTRUCTION) and rows[3]["extra_info"] == {
        "split": "test",
        "index": 3,
    }


def test_a_json_file_holds_an_array_of_rows_or_json_lines_and_errors_name_the_format(tmp_path, tokenizer):
    rows = [verl_row("Q: 1+1? A:", "2"), verl_row("Q: 2+2? A:", "4")]
    (tmp_path / "array.json").write_text(json.dumps(rows, indent=2))
    write_jsonl(tmp_path / "lines.json", rows)  # what Hugging Face's to_json writes to a .json file
    for name in ("array.json", "lines.json"):
        assert [e.ground_truth for e in load_examples(tmp_path / name, tokenizer, DataConfig())] == ["2", "4"]
    (tmp_path / "bad.json").write_text(json.dumps([rows[0], [1, 2]]))
    with pytest.raises(
        ValueError, match=r"bad.json: read as a JSON array of rows: row 1 \(counting from 0\) is a list"
    ):
        load_examples(tmp_path / "bad.json", tokenizer, DataConfig())
    (tmp_path / "torn.json").write_text('[{"prompt": "x"},\n')
    with pytest.raises(ValueError, match=r"torn.json: read as a JSON array of rows: not valid JSON at line 2"):
        load_examples(tmp_path / "torn.json", tokenizer, DataConfig())
