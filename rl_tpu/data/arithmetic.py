"""The synthetic arithmetic task of the default recipe: every problem of a setting, split once, as verl rows."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Sequence

from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.data.datasets import verl_rule_row, write_verl_parquet

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


# tool_math: the calculator tool's name (examples/tools/calc_function.py) and what the tool's result looks like
CALCULATOR = "calc"
TOOL_RESPONSE_FORMAT = EpisodeConfig.tool_response_format


def tool_trace(a: int, op: str, b: int, malformed: bool = False) -> tuple[str, str, str]:
    """A teacher's episode for ``a op b`` with the calculator: its call (Hermes format), the tool's result as the
    plain renderer writes it, and its answer. A malformed call lacks a closing brace: no parser reads it, so
    the episode would end there, unanswered (the answer is then empty)."""
    arguments = json.dumps({"expression": f"{a}{op}{b}"})
    call = json.dumps({"name": CALCULATOR, "arguments": json.loads(arguments)})
    if malformed:
        call = call[:-1]
    result = ARITHMETIC_OPS[op](a, b)
    if malformed:
        return f" <tool_call>{call}</tool_call>", "", ""
    return f" <tool_call>{call}</tool_call>", TOOL_RESPONSE_FORMAT.format(result=result), f" {result}"


def arithmetic_rows(ops: str, max_operand: int, split: str, problems: Sequence[tuple[int, str, int]]) -> list[dict]:
    rows = []
    for index, (a, op, b) in enumerate(problems):
        question = arithmetic_prompt(a, op, b)
        answer = str(ARITHMETIC_OPS[op](a, b))
        extra_info = {"split": split, "index": index, "answer": answer, "question": question}
        rows.append(verl_rule_row(ARITHMETIC_SOURCE, question, answer, extra_info))
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


def ensure_arithmetic_dataset(
    cache_dir: Path, ops: str, max_operand: int, num_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write the train / test parquet files once per setting; return their paths."""
    key = hashlib.sha256(json.dumps([ops, max_operand, num_eval, seed]).encode()).hexdigest()[:12]
    folder = cache_dir / f"arithmetic-{key}"
    train_path, test_path = folder / "train.parquet", folder / "test.parquet"
    if not (train_path.exists() and test_path.exists()):
        train, test = split_arithmetic_problems(ops, max_operand, num_eval, seed)
        write_verl_parquet(arithmetic_rows(ops, max_operand, "train", train), train_path)
        write_verl_parquet(arithmetic_rows(ops, max_operand, "test", test), test_path)
    return train_path, test_path
