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
COMMUTATIVE = "+*"
# names the split in the data's and the tiny model's cache keys; 2: commuted twins held out together
SPLIT_VERSION = 2


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


def problem_units(ops: str, max_operand: int) -> list[tuple[tuple[int, str, int], ...]]:
    """Every (a, op, b) with operands in 0..max_operand, grouped so that a split never separates twins: a
    commutative problem and its commuted twin (47 * 83, 83 * 47) are one unit; a square (a op a) or a subtraction
    is a unit alone."""
    units = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op not in COMMUTATIVE or a == b:
                    units.append(((a, op, b),))
                elif a < b:
                    units.append(((a, op, b), (b, op, a)))
    return units


def split_arithmetic_problems(
    ops: str, max_operand: int, num_eval: int, seed: int
) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """Exactly ``num_eval`` held-out problems and every other one to train on, both orders of a commutative
    problem on the same side.

    Splitting the exhaustive set (rather than sampling twice) keeps every eval problem out of the warm start and
    GRPO; splitting it by `problem_units` keeps its commuted twin out too (a plain split trained on 83 * 47 for
    about 95% of held-out 47 * 83). The units are shuffled and each joins the held-out set while it fits, so the
    set is ``num_eval`` problems: a pair is passed over when one place is left, and the next single fills it.
    """
    unknown = set(ops) - set(ARITHMETIC_OPS)
    if unknown or not ops:
        raise ValueError(f"arithmetic ops {ops!r}: allowed characters are {''.join(ARITHMETIC_OPS)}")
    units = problem_units(ops, max_operand)
    total = sum(len(unit) for unit in units)
    if not 0 < num_eval < total:
        raise ValueError(f"data.num_eval={num_eval} must be between 1 and {total - 1} for ops {ops!r}")
    random.Random(seed).shuffle(units)
    train: list[tuple[int, str, int]] = []
    test: list[tuple[int, str, int]] = []
    for unit in units:
        (test if len(test) + len(unit) <= num_eval else train).extend(unit)
    if len(test) < num_eval:  # only in tiny settings: no single left after the last pair that fits
        raise ValueError(
            f"data.num_eval={num_eval}: ops {ops!r} up to {max_operand} hold out a problem with its commuted twin, "
            f"and these pairs fill {len(test)} places: set data.num_eval={len(test)}"
        )
    return train, test


def ensure_arithmetic_dataset(
    cache_dir: Path, ops: str, max_operand: int, num_eval: int, seed: int
) -> tuple[Path, Path]:
    """Write the train / test parquet files once per setting; return their paths."""
    key = hashlib.sha256(json.dumps([ops, max_operand, num_eval, seed, SPLIT_VERSION]).encode()).hexdigest()[:12]
    folder = cache_dir / f"arithmetic-{key}"
    train_path, test_path = folder / "train.parquet", folder / "test.parquet"
    if not (train_path.exists() and test_path.exists()):
        train, test = split_arithmetic_problems(ops, max_operand, num_eval, seed)
        write_verl_parquet(arithmetic_rows(ops, max_operand, "train", train), train_path)
        write_verl_parquet(arithmetic_rows(ops, max_operand, "test", test), test_path)
    return train_path, test_path
