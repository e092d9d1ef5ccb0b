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
    """Appends a line per step to `metrics.jsonl`; a resumed run continues the same file."""

    def __init__(self, run_dir: Path, total_steps: int, show_progress: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = read_metrics(self.path) if self.path.exists() else []
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
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self.shown.update({label: metrics[key] for key, label in BAR_KEYS.items() if key in metrics})
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in self.shown.items()}, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
