"""GSM8K JSONL -> verl-schema parquet, field for field as verl's `examples/data_preprocess/gsm8k.py`.

    python recipes/grpo_gsm8k/prepare.py --input_dir ../shared/data/gsm8k --output_dir ~/data/gsm8k

reads `train.jsonl` and `test.jsonl` (GSM8K's own `question` / `answer` rows) and writes
`train.parquet` and `test.parquet`: data_source `openai/gsm8k`, the question plus verl's
instruction as one user message, `reward_model.ground_truth` the number after ``####``
(commas removed), `extra_info` {split, index, answer, question}.
"""

from __future__ import annotations

import re
from pathlib import Path

from rl_tpu.data.datasets import RowError, convert_cli, string_fields, verl_rule_row

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def final_answer(solution: str) -> str | None:
    """verl's ground truth: the number after the first ``#### ``, without commas."""
    match = _FINAL_ANSWER.search(solution)
    return match.group(1).replace(",", "") if match else None


def verl_row(example: dict, split: str, index: int, path: Path) -> dict:
    question, solution = string_fields(example, ("question", "answer"), path, index)
    truth = final_answer(solution)
    if truth is None:
        raise RowError(path, index, "field 'answer' has no '#### <number>' final answer")
    extra_info = {"split": split, "index": index, "answer": solution, "question": question}
    return verl_rule_row(DATA_SOURCE, question + " " + INSTRUCTION, truth, extra_info)


def main(argv: list[str] | None = None) -> None:
    convert_cli(__doc__, verl_row, Path("~/data/gsm8k"), argv)


if __name__ == "__main__":
    main()
