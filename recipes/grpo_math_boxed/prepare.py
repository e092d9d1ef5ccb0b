"""MATH-style JSONL -> verl-schema parquet, field for field as verl's `examples/data_preprocess/math_dataset.py`.

    python recipes/grpo_math_boxed/prepare.py --input_dir ~/raw/math --output_dir ~/data/math

reads `train.jsonl` and `test.jsonl` with MATH's `problem` / `solution` fields (as in the
MATH-lighteval release) and writes `train.parquet` and `test.parquet`: data_source
`DigitalLearningGmbH/MATH-lighteval`, the problem plus verl's ``\\boxed{}`` instruction as one
user message, `reward_model.ground_truth` the content of the solution's last ``\\boxed{}``,
`extra_info` {split, index}.
"""

from __future__ import annotations

from pathlib import Path

from rewards.math import last_boxed
from rl_tpu.data.datasets import RowError, convert_cli, string_fields, verl_rule_row

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def verl_row(example: dict, split: str, index: int, path: Path) -> dict:
    problem, solution = string_fields(example, ("problem", "solution"), path, index)
    truth = last_boxed(solution)
    if truth is None:
        raise RowError(path, index, "field 'solution' has no complete \\boxed{...} answer")
    return verl_rule_row(DATA_SOURCE, problem + " " + INSTRUCTION, truth, {"split": split, "index": index})


def main(argv: list[str] | None = None) -> None:
    convert_cli(__doc__, verl_row, Path("~/data/math"), argv)


if __name__ == "__main__":
    main()
