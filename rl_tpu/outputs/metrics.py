"""Run outputs: `metrics.jsonl` (one JSON object per step), the progress bar, and the trackers they feed."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from rl_tpu.outputs.tracking import Trackers

log = logging.getLogger(__name__)

# Shown on the progress bar, in this order, when present.
BAR_KEYS = {
    "reward/mean": "reward",
    "eval/accuracy": "eval",
    "actor/logprob_diff": "lp_diff",
    "time/step_s": "s/step",
    "sync/version": "v",
}
ELAPSED = "time/elapsed_s"  # seconds since the run started, counting the earlier processes of a resumed run
TIMESTAMP = "timestamp"  # when the line was written (Unix time): a sweep's table shows which trials overlapped


def final_accuracy(evals: list[float]) -> float:
    """A run's result: the mean of its last three evaluations after the first (which precedes training)."""
    return statistics.fmean(evals[1:][-3:]) if len(evals) > 1 else (evals[0] if evals else math.nan)


class MetricsLogger:
    """Appends a line per step to `metrics.jsonl` and passes it to the trackers; a resumed run continues the file."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        show_progress: bool = True,
        trackers: Optional[Trackers] = None,
        started: Optional[float] = None,
    ):
        """`started`: when the run's process started (time.monotonic()); None: now."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = read_metrics(self.path) if self.path.exists() else []
        started = time.monotonic() if started is None else started
        self.started = started - (self.records[-1].get(ELAPSED, 0.0) if self.records else 0.0)
        self.trackers = trackers
        self.bar = tqdm(total=total_steps, desc="grpo", dynamic_ncols=True, disable=not show_progress)
        self.shown: dict[str, float] = {}

    def truncate_after(self, step: int | None) -> None:
        """Keep the records of steps up to `step` (None: none): the run continues after `step`."""
        self.records = [r for r in self.records if step is not None and r["step"] <= step]
        partial = self.path.with_suffix(".jsonl.partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        partial.replace(self.path)
        self.bar.n = step or 0
        self.bar.refresh()

    def evals(self) -> list[float]:
        """The held-out accuracies so far, in step order (the first is the one before training)."""
        return [r["eval/accuracy"] for r in self.records if "eval/accuracy" in r]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise FloatingPointError(f"metric {key} is {value} at step {step}")
        metrics = {**metrics, ELAPSED: time.monotonic() - self.started}
        record = {"step": step, TIMESTAMP: time.time(), **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # the step's line is on disk before the next step starts
        self.records.append(record)
        if self.trackers:
            self.trackers.log(step, metrics)
        self.shown.update({label: metrics[key] for key, label in BAR_KEYS.items() if key in metrics})
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        if self.trackers:
            self.trackers.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl. A torn last line, what a crash in the middle of a write leaves, is dropped with a
    warning naming it; any other line that is not JSON is an error naming the file and the line."""
    lines = [(number, line) for number, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    rows = []
    for index, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            if index < len(lines) - 1:
                raise ValueError(
                    f"{path}: line {number} is not a JSON object ({err}); only a torn last line is dropped"
                ) from err
            log.warning(
                "%s: line %d is torn (%s), as a crash in the middle of a write leaves it: dropped", path, number, err
            )
    return rows
