"""Run outputs: `metrics.jsonl` (one JSON object per step) and the progress bar."""

from __future__ import annotations

import json
import math
import resource
import statistics
from pathlib import Path

from tqdm import tqdm

# Shown on the progress bar, in this order, when present.
BAR_KEYS = {"reward/mean": "reward", "eval/accuracy": "eval", "actor/logprob_diff": "lp_diff",
            "time/step_s": "s/step", "sync/version": "v"}


def final_accuracy(evals: list[float]) -> float:
    """A run's result: the mean of its last three evaluations after the first (which precedes training)."""
    return statistics.fmean(evals[1:][-3:]) if len(evals) > 1 else (evals[0] if evals else math.nan)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, show_progress: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="grpo", dynamic_ncols=True, disable=not show_progress)
        self.shown: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise FloatingPointError(f"metric {key} is {value} at step {step}")
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.shown.update({label: metrics[key] for key, label in BAR_KEYS.items() if key in metrics})
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
