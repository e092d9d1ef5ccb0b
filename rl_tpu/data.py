"""Datasets in verl's parquet schema: the synthetic arithmetic task, loading, prompt tokenisation.

A row is verl's: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model`` {``style``, ``ground_truth``}, ``extra_info`` {``split``, ``index``, ...}.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import pandas as pd

ARITHMETIC_SOURCE = "rl_tpu/arithmetic"
ARITHMETIC_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def answer_without_carry(a: int, op: str, b: int) -> int:
    """What a teacher who forgets to carry (+) or borrow (-) writes: each column on its own.

    57 + 68 -> 115 (7+8 = 15, write 5, carry forgotten; 5+6 = 11); 62 - 27 -> 45 (|2-7| = 5; 6-2 = 4).
    Equals the true answer when no column carries or borrows.
    """
    if op == "+":
        return (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    if op == "-":
        high, low, sign = (a, b, 1) if a >= b else (b, a, -1)
        return sign * ((high // 10 - low // 10) * 10 + abs(high % 10 - low % 10))
    return ARITHMETIC_OPS[op](a, b)


def arithmetic_prompt(a: int, op: str, b: int) -> str:
    return f"Q: What is {a} {op} {b}? A:"


def arithmetic_rows(ops: str, max_operand: int, split: str, problems: Sequence[tuple[int, str, int]]) -> list[dict]:
    rows = []
    for index, (a, op, b) in enumerate(problems):
        question = arithmetic_prompt(a, op, b)
        answer = str(ARITHMETIC_OPS[op](a, b))
        rows.append(
            {
                "data_source": ARITHMETIC_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
        )
    return rows


def split_arithmetic_problems(
    ops: str, max_operand: int, num_eval: int, seed: int
) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """Every (a, op, b) with operands in 0..max_operand, shuffled, the first ``num_eval`` held out.

    Splitting the exhaustive set (rather than sampling twice) guarantees no eval problem is
    ever trained on, in the warm start or in GRPO.
    """
    unknown = set(ops) - set(ARITHMETIC_OPS)
    if unknown or not ops:
        raise ValueError(f"arithmetic ops {ops!r}: allowed characters are {''.join(ARITHMETIC_OPS)}")
    problems = [(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < num_eval < len(problems):
        raise ValueError(f"data.num_eval={num_eval} must be between 1 and {len(problems) - 1} for ops {ops!r}")
    random.Random(seed).shuffle(problems)
    return problems[num_eval:], problems[:num_eval]


def write_parquet_atomic(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)


def ensure_arithmetic_dataset(cache_dir: Path, ops: str, max_operand: int, num_eval: int, seed: int) -> tuple[Path, Path]:
    """Write the train / test parquet files once per setting; return their paths."""
    key = hashlib.sha256(json.dumps([ops, max_operand, num_eval, seed]).encode()).hexdigest()[:12]
    folder = cache_dir / f"arithmetic-{key}"
    train_path, test_path = folder / "train.parquet", folder / "test.parquet"
    if not (train_path.exists() and test_path.exists()):
        train, test = split_arithmetic_problems(ops, max_operand, num_eval, seed)
        write_parquet_atomic(arithmetic_rows(ops, max_operand, "train", train), train_path)
        write_parquet_atomic(arithmetic_rows(ops, max_operand, "test", test), test_path)
    return train_path, test_path


@dataclass(frozen=True)
class Example:
    """One prompt, tokenised, with what its reward function needs."""

    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any]


REQUIRED_FIELDS = ("data_source", "prompt", "reward_model")


def _prompt_text(row: dict, tokenizer, path: Path, index: int) -> str:
    messages = row["prompt"]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if len(messages) == 0 or not all(isinstance(m, dict) and m.get("content") for m in messages):
        raise ValueError(f"{path}: row {index}: field 'prompt' must be a non-empty list of {{role, content}} messages")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    # Tokenisers without a chat template (the tiny preset's) see the raw user text.
    return "\n".join(m["content"] for m in messages)


def load_examples(path: str | Path, tokenizer, max_prompt_length: int) -> list[Example]:
    """Read a verl-schema parquet file and tokenise its prompts; bad rows fail with file, row and field."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    records = pd.read_parquet(path).to_dict("records")
    examples = []
    for index, row in enumerate(records):
        for field in REQUIRED_FIELDS:
            if row.get(field) is None:
                raise ValueError(f"{path}: row {index}: missing field '{field}' (verl schema needs {REQUIRED_FIELDS})")
        ground_truth = (row["reward_model"] or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"{path}: row {index}: missing field 'reward_model.ground_truth'")
        prompt_ids = tokenizer(_prompt_text(row, tokenizer, path, index), add_special_tokens=False)["input_ids"]
        if len(prompt_ids) > max_prompt_length:
            raise ValueError(
                f"{path}: row {index}: prompt has {len(prompt_ids)} tokens, over data.max_prompt_length={max_prompt_length}"
            )
        examples.append(Example(prompt_ids, str(row["data_source"]), str(ground_truth), dict(row.get("extra_info") or {})))
    if not examples:
        raise ValueError(f"dataset file {path} has no rows")
    return examples


def batches(examples: Sequence[Example], batch_size: int, seed: int) -> Iterator[list[Example]]:
    """Endless shuffled batches; each epoch is a fresh permutation so every example is seen once per epoch."""
    if batch_size > len(examples):
        raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({len(examples)} rows)")
    rng = random.Random(seed)
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [examples[i] for i in order[start : start + batch_size]]
