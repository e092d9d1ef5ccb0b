"""PNG plots of a run or of a sweep, each with the data behind it in a CSV of the same name.

A run's plots go into RUN_DIR/plots/, a sweep's into SWEEP_DIR/plots/ (one line per trial on shared
axes). Matplotlib's object API (`Figure`, no pyplot) draws off-screen and keeps no global state, so a
sweep's trials can plot at once.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Callable

from rl_tpu.outputs.metrics import ELAPSED, read_metrics
from rl_tpu.records import Outcome

log = logging.getLogger(__name__)
PLOTS_DIR = "plots"
# the parts of a step, as the driver waits for them; they add up to time/step_s
STEP_PARTS = {
    "time/generate_s": "generate (wait)",
    "time/reward_s": "reward",
    "time/train_step_s": "train",
    "time/sync_s": "weight sync",
}
IDLE = {"time/trainer_idle_s": "trainer idle", "time/sampler_idle_s": "sampler idle"}


@dataclass
class Table:
    """One plot's data: `step` (and `time/elapsed_s` where known), then one column per series; a row per step."""

    columns: list[str]
    rows: list[list[float | None]]

    def series(self) -> list[str]:
        return [c for c in self.columns if c not in ("step", ELAPSED)]

    def column(self, name: str) -> list[float | None]:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(self.columns)
            writer.writerows(["" if v is None else v for v in row] for row in self.rows)


def with_elapsed(rows: list[dict]) -> list[dict]:
    """Rows with `time/elapsed_s`; a run made before that metric existed gets the running sum of its steps."""
    if all(ELAPSED in r for r in rows):
        return rows
    sums = accumulate(r.get("time/step_s", 0.0) for r in rows)
    return [{**r, ELAPSED: s} for r, s in zip(rows, sums)]


def step_table(rows: list[dict], keys: list[str]) -> Table:
    return Table(["step", ELAPSED, *keys], [[r["step"], r.get(ELAPSED), *(r.get(k) for k in keys)] for r in rows])


def present(values: list[float | None], xs: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, v) for x, v in zip(xs, values) if v is not None and x is not None]
    return [x for x, _ in pairs], [v for _, v in pairs]


def new_figure(panels: int = 1):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4 * panels, 4.2), layout="constrained")
    return figure, figure.subplots(1, panels, squeeze=False)[0]


def reward_figure(table: Table, title: str):
    figure, (by_step, by_time) = new_figure(2)
    steps, minutes = table.column("step"), [None if t is None else t / 60 for t in table.column(ELAPSED)]
    for axes, xs, label in ((by_step, steps, "step"), (by_time, minutes, "wall time (min)")):
        axes.plot(*present(table.column("reward/mean"), xs), label="train reward (mean)")
        axes.plot(*present(table.column("eval/accuracy"), xs), "o-", label="held-out accuracy")
        axes.set_xlabel(label)
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
    by_step.legend()
    figure.suptitle(f"{title}: reward and held-out accuracy")
    return figure


def time_figure(table: Table, title: str):
    figure, (axes,) = new_figure()
    steps = table.column("step")
    bottom = [0.0] * len(steps)
    for key, label in STEP_PARTS.items():
        heights = [v or 0.0 for v in table.column(key)]
        axes.bar(steps, heights, bottom=bottom, label=label, width=0.9)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for key, label in IDLE.items():
        axes.plot(*present(table.column(key), steps), "--", label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("seconds")
    axes.legend(fontsize="small")
    axes.set_title(f"{title}: time per step")
    return figure


def lines_figure(table: Table, title: str, ylabel: str, log_y: bool = False):
    """Every series of the table against the step."""
    figure, (axes,) = new_figure()
    steps, series = table.column("step"), table.series()
    for name in series:
        axes.plot(*present(table.column(name), steps), label=name)
    if log_y and any(v for name in series for v in table.column(name)):
        axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    axes.set_title(title)
    return figure


# one run's plots: file name -> (the series, how to draw them)
RUN_PLOTS: dict[str, tuple[list[str], Callable[[Table, str], object]]] = {
    "reward": (["reward/mean", "eval/accuracy"], reward_figure),
    "time": ([*STEP_PARTS, "time/step_s", *IDLE], time_figure),
    "logprob_gap": (
        ["actor/logprob_diff"],
        lambda t, title: lines_figure(t, f"{title}: sampler - trainer logprob gap", "mean |diff|", True),
    ),
    "response_length": (
        ["response/length_mean"],
        lambda t, title: lines_figure(t, f"{title}: response length", "tokens"),
    ),
    "outcomes": (  # log scale: a few failures beside a batch of scored rollouts
        [*(f"outcome/{kind}" for kind in Outcome), "outcome/retries"],
        lambda t, title: lines_figure(t, f"{title}: rollouts by outcome", "rollouts", True),
    ),
}


def save(figure, table: Table, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    figure.savefig(folder / f"{name}.png", dpi=100)
    table.write_csv(folder / f"{name}.csv")
    return folder / f"{name}.png"


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots (and their CSVs) into RUN_DIR/plots/; returns the PNGs."""
    run_dir = Path(run_dir)
    rows = with_elapsed(read_metrics(run_dir / "metrics.jsonl"))
    title = f"{run_dir.parent.name}/{run_dir.name}"
    written = []
    for name, (keys, draw) in RUN_PLOTS.items():
        chosen = rows if name == "reward" else [r for r in rows if "time/step_s" in r]  # step 0 is the first eval
        table = step_table(chosen, keys)
        written.append(save(draw(table, title), table, run_dir / PLOTS_DIR, name))
    return written


def plot_finished_run(run_dir: Path) -> Path | None:
    """A run's plots at its end; a plot that fails is a warning, since the run itself succeeded."""
    try:
        plot_run(run_dir)
    except Exception as failed:
        log.warning(
            "could not plot %s (%s: %s); `python -m rl_tpu.report %s` tries again",
            run_dir,
            type(failed).__name__,
            failed,
            run_dir,
        )
        return None
    return run_dir / PLOTS_DIR


def trial_table(trials: dict[str, list[dict]], key: str) -> Table:
    """One column per trial: `key` at each step any trial logged it (blank where a trial did not)."""
    steps = sorted({r["step"] for rows in trials.values() for r in rows if key in r})
    values = {label: {r["step"]: r[key] for r in rows if key in r} for label, rows in trials.items()}
    return Table(["step", *trials], [[s, *(values[label].get(s) for label in trials)] for s in steps])


SWEEP_PLOTS = {
    "reward": ("reward/mean", "train reward (mean)"),
    "accuracy": ("eval/accuracy", "held-out accuracy"),
    "step_time": ("time/step_s", "seconds per step"),
}


def plot_sweep(sweep_dir: str | Path, trials: dict[str, Path]) -> list[Path]:
    """One line per trial (label -> run folder) on shared axes, into SWEEP_DIR/plots/."""
    metrics = {
        label: read_metrics(run / "metrics.jsonl") for label, run in trials.items() if (run / "metrics.jsonl").is_file()
    }
    written = []
    for name, (key, ylabel) in SWEEP_PLOTS.items():
        table = trial_table(metrics, key)
        figure = lines_figure(table, f"{Path(sweep_dir).name}: {ylabel}", ylabel)
        written.append(save(figure, table, Path(sweep_dir) / PLOTS_DIR, name))
    return written
