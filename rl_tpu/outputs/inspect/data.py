"""What the page embeds: a run's steps (from metrics.jsonl) and its recorded samples (the rollout record,
rl_tpu/controller/recording.py), one compact sample per recorded row, at most `MAX_ROWS` rows and `MAX_TOKENS` tokens.

Past either cap, whole groups are kept a step at a time, round-robin over the steps (train and evaluation alike), so
that every step keeps its first groups and none is left out for another; `cap` says how many rows were left out.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain
from pathlib import Path
from typing import Any

import yaml

from rl_tpu.outputs import rollout_log
from rl_tpu.outputs.metrics import read_metrics

MAX_ROWS = 5000  # samples embedded
MAX_TOKENS = 200_000  # completion tokens embedded (a long run of long completions is capped by these first)
SPLITS = ("train", "eval")

Key = tuple[str, int]  # (split, step)


def configured_folder(run_dir: Path) -> str | None:
    """`trainer.rollout_data_dir` as the run resolved it (None: the run folder's own `rollouts/`)."""
    path = run_dir / "resolved_config.yaml"
    settings = yaml.safe_load(path.read_text()) if path.is_file() else None
    return ((settings or {}).get("trainer") or {}).get("rollout_data_dir")


def read_record(run_dir: Path) -> dict[Key, list[dict]]:
    """Every recorded row of a run, by (split, step), each with its line in its file (`line`, from 0)."""
    folder = rollout_log.record_folder(run_dir, configured_folder(run_dir))
    record: dict[Key, list[dict]] = {}
    for split, where in zip(SPLITS, (folder, folder / rollout_log.EVAL_FOLDER)):
        steps = rollout_log.read_steps(where) if where.is_dir() else {}
        for step, rows in steps.items():
            record[(split, step)] = [{**row, "line": line} for line, row in enumerate(rows)]
    return record


def groups_of(rows: list[dict], split: str) -> list[list[dict]]:
    """A step's rows in groups, in order: a training prompt's samples, or each evaluation sample alone."""
    if split == "eval":
        return [[row] for row in rows]
    groups: dict[Any, list[dict]] = {}
    for row in rows:
        groups.setdefault(row.get("group", row.get("index")), []).append(row)
    return list(groups.values())


def tokens_of(group: list[dict]) -> int:
    return sum(len(row.get("output_ids", ())) for row in group)


def cap(record: dict[Key, list[dict]], max_rows: int, max_tokens: int) -> tuple[dict[Key, list[dict]], int]:
    """The rows kept under the caps (see the module's docstring), and how many were left out."""
    queues = {key: groups_of(rows, key[0]) for key, rows in sorted(record.items())}
    kept: dict[Key, list[dict]] = {key: [] for key in queues}
    rows_left, tokens_left = max_rows, max_tokens
    while any(queues.values()):
        for key, queue in queues.items():
            if not queue:
                continue
            group = queue[0]
            if len(group) > rows_left or tokens_of(group) > tokens_left:
                queue.clear()  # this step is full: the next groups of others may still fit
                continue
            kept[key] += queue.pop(0)
            rows_left -= len(group)
            tokens_left -= tokens_of(group)
    total = sum(map(len, record.values()))
    return kept, total - sum(map(len, kept.values()))


def finite(value: Any) -> Any:
    """JSON without NaN or infinities (the page's JSON.parse refuses them): None in their place, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def tool_calls(turns: list[dict] | None) -> int:
    return sum(len(turn.get("tools", ())) for turn in turns or () if turn["role"] == "environment")


def sample_advantage(row: dict) -> float | None:
    """One figure for the sample: the mean advantage of its tokens in the loss (outcome estimators give each the
    same), else of all its tokens; None where none was recorded."""
    advantages = row.get("advantages")
    if not advantages:
        return None
    mask = row.get("loss_mask") or [1] * len(advantages)
    chosen = [a for a, m in zip(advantages, mask) if m] or advantages
    return sum(chosen) / len(chosen)


def sample(row: dict, split: str, number: int) -> dict:
    """A recorded row as the page reads it (keys short: the page holds thousands)."""
    turns = row.get("turns")
    return {
        "id": number,
        "step": row.get("step"),
        "split": split,
        "line": row.get("line"),  # in its step's file
        "group": row.get("group", row.get("index")),
        "index": row.get("index"),
        "prompt": row.get("input", ""),
        "output": row.get("output", ""),
        "answer": row.get("answer"),
        "gts": None if row.get("gts") is None else str(row["gts"]),
        "reward": row.get("score"),
        "parts": row.get("reward_parts") or {},
        "outcome": row.get("outcome"),
        "version": row.get("weight_version"),
        "finish": row.get("finish_reason"),
        "truncated": row.get("truncated") or ("length" if row.get("finish_reason") == "length" else None),
        "n": len(row.get("output_ids", ())),
        "ids": row.get("output_ids"),
        "tokens": row.get("output_pieces"),
        "mask": row.get("loss_mask"),
        "lp": row.get("logprobs"),
        "tlp": row.get("trainer_logprobs"),
        "adv": row.get("advantages"),
        "ent": row.get("entropy"),
        "turns": turns,
        "tool_calls": tool_calls(turns),
        "advantage": sample_advantage(row),
    }


def counts(rows: list[dict]) -> dict[str, Any]:
    """A step's samples by outcome where the record has it, else by finish reason."""
    key = "outcome" if any("outcome" in row for row in rows) else "finish_reason"
    return {"counted_by": key, "counts": dict(Counter(str(row.get(key)) for row in rows))}


def step_list(metrics: list[dict], record: dict[Key, list[dict]], kept: dict[Key, list[dict]]) -> list[dict]:
    """Every step of the metrics or the record, in order: its reward and held-out accuracy, its training samples
    by outcome (all recorded, before the cap), and how many of each split the page holds."""
    by_step = {row["step"]: row for row in metrics}
    steps = sorted(set(by_step) | {step for _, step in record})
    return [
        {
            "step": step,
            "reward": by_step.get(step, {}).get("reward/mean"),
            "accuracy": by_step.get(step, {}).get("eval/accuracy"),
            **counts(record.get(("train", step), [])),
            **{split: len(kept.get((split, step), [])) for split in SPLITS},
        }
        for step in steps
    ]


def page_data(
    run: str,
    metrics: list[dict],
    record: dict[Key, list[dict]],
    max_rows: int = MAX_ROWS,
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """Everything the page shows, JSON-ready."""
    kept, left_out = cap(record, max_rows, max_tokens)
    rows = chain.from_iterable(((key[0], row) for row in rows) for key, rows in sorted(kept.items()))
    samples = [sample(row, split, number) for number, (split, row) in enumerate(rows)]
    return finite(
        {
            "run": run,
            "steps": step_list(metrics, record, kept),
            "samples": samples,
            "cap": {"max_rows": max_rows, "max_tokens": max_tokens, "left_out": left_out},
        }
    )


def run_data(run_dir: Path) -> dict:
    """A run folder's page data."""
    metrics_file = run_dir / "metrics.jsonl"
    metrics = read_metrics(metrics_file) if metrics_file.is_file() else []
    return page_data(run_dir.name, [m for m in metrics if "step" in m], read_record(run_dir))
