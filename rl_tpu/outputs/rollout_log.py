"""`trainer.rollout_data_dir`: what each step trained on, one JSON Lines file per step, `<step>.jsonl`, with
verl's rollout-dump fields (`input`, `output`, `gts`, `score`, `step`) and ours: `index`, the prompt's row in the
training file, `weight_version`, the weights that sampled the completion, `answer`, the text the rewards read (the
completion, or an episode's final turn before any tool call), `outcome`, how the sample ended
(`rl_tpu.records.Outcome`: scored, reward_error, tool_failure, timeout, truncated or lost; `algorithm.outcomes`
decides whether it counted), `input_ids` and `output_ids`, the token ids the trainer scored (the text fields drop
special tokens), and for an episode `turns`: its spans of `output_ids` in order, each {"role": "model" or
"environment", "start", "end"}. The rollout inspector's fields, and which samples a run records (every one where
`trainer.rollout_data_dir` is set, a share of them in `<run folder>/rollouts` by default, and the evaluations' in
`eval/<step>.jsonl`), are rl_tpu/controller/recording.py's.

A file is written whole or not at all (renamed into place); a step trained again after a crash overwrites its file,
so the folder holds each step once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUN_FOLDER = "rollouts"  # in the run folder, where `trainer.rollout_data_dir` is unset
EVAL_FOLDER = "eval"  # in the record's folder: the evaluations' samples, `eval/<step>.jsonl`


def record_folder(run_dir: str | Path, rollout_data_dir: str | None) -> Path:
    """Where a run's record is: `trainer.rollout_data_dir`, or its run folder's `rollouts/`."""
    return Path(rollout_data_dir).expanduser() if rollout_data_dir else Path(run_dir) / RUN_FOLDER


def write_step(folder: str | Path, step: int, rows: list[dict]) -> Path:
    """Write `rows` (the step's trained samples) as `<folder>/<step>.jsonl`; returns the file."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    partial = path.with_name(path.name + ".partial")
    # default=str: a ground truth read from parquet may hold numpy values
    partial.write_text(
        "".join(json.dumps({**row, "step": step}, ensure_ascii=False, default=str) + "\n" for row in rows)
    )
    os.replace(partial, path)
    return path


def read_steps(folder: str | Path) -> dict[int, list[dict]]:
    """Every step's rows in `folder`, by step."""
    steps = {}
    for path in Path(folder).glob("*.jsonl"):
        steps[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines()]
    return dict(sorted(steps.items()))
