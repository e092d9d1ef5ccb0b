"""Reports from what runs leave behind: one run's summary and plots, and a sweep's table and plots.

    python -m rl_tpu.report outputs/2026-11-30/10-00-00      # one run: its summary, plots into RUN/plots/,
                                                             # and the rollout inspector, RUN/inspect.html
    python -m rl_tpu.report multirun/2026-11-30/10-00-00     # a sweep: summary.md, summary.csv, plots/

A Hydra multirun writes the sweep's report when it ends (`SweepSummary`, registered in configs/config.yaml),
and every run plots itself at its end (`trainer.plots`).
"""

from __future__ import annotations

import csv
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from rl_tpu.outputs.inspect import write_page
from rl_tpu.outputs.metrics import ELAPSED, TIMESTAMP, final_accuracy, read_metrics
from rl_tpu.outputs.plots import plot_run, plot_sweep

SUMMARY_FILE = "summary.md"
SUMMARY_CSV = "summary.csv"
FAILED_FILE = "error.txt"  # a sweep trial that raised leaves its traceback here


def clock(timestamp: float | None) -> str:
    """A UTC time of day, `HH:MM:SS` (the date is in the sweep folder's name)."""
    return "" if timestamp is None else datetime.fromtimestamp(timestamp, timezone.utc).strftime("%H:%M:%S")


def run_summary(run_dir: str | Path) -> dict[str, Any]:
    """Held-out accuracy before and after, steps done, the step's speed, and when the run started and ended."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step_s" in r]
    timed = [r for r in rows if TIMESTAMP in r]
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "accuracy_start": evals[0] if evals else float("nan"),
        "accuracy_final": final_accuracy(evals),
        "reward_last": steps[-1]["reward/mean"] if steps else float("nan"),
        "step_s": statistics.median(r["time/step_s"] for r in steps) if steps else float("nan"),
        # the run's first record comes after start-up; its elapsed time says how long that took
        "started": timed[0][TIMESTAMP] - timed[0].get(ELAPSED, 0.0) if timed else None,
        "ended": timed[-1][TIMESTAMP] if timed else None,
    }


def run_overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(path.read_text()) or []) if path.is_file() else []


def trial_folders(sweep_dir: Path) -> list[Path]:
    runs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not runs:
        raise FileNotFoundError(f"{sweep_dir}: no numbered run folders (0, 1, ...): not a Hydra sweep folder")
    return runs


def sweep_rows(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per trial (finished ones by final accuracy, best first; then the failed), and the shared overrides."""
    runs = trial_folders(sweep_dir)
    overrides = {run: run_overrides(run) for run in runs}
    shared = set.intersection(*(set(o) for o in overrides.values()))
    finished, failed = [], []
    for run in runs:
        row = {"run": run.name, "overrides": " ".join(o for o in overrides[run] if o not in shared) or "(none)"}
        if (run / FAILED_FILE).is_file():  # crashed, perhaps mid-run: failed, not ranked
            error = (run / FAILED_FILE).read_text().strip().splitlines()[-1]
            failed.append({**row, "status": f"failed: {error}"})
        elif (run / "metrics.jsonl").is_file():
            finished.append({**row, "status": "finished", **run_summary(run)})
        else:
            failed.append({**row, "status": "no metrics.jsonl (the run failed before its first step)"})
    finished.sort(key=lambda r: -_or_minus_inf(r["accuracy_final"]))
    return finished + failed, sorted(shared)


def sweep_table(sweep_dir: str | Path) -> str:
    """A markdown table of every trial in a sweep folder, best final accuracy first.

    Only the overrides that differ between runs are shown; a run that stopped before its first
    metrics is listed as such rather than left out. Start and end times show which trials overlapped.
    """
    return markdown_table(Path(sweep_dir), *sweep_rows(Path(sweep_dir)))


def markdown_table(sweep_dir: Path, rows: list[dict[str, Any]], shared: list[str]) -> str:
    lines = [
        "| run | overrides | held-out accuracy start -> final | last reward | s/step | steps | started | ended |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] == "finished":
            lines.append(
                f"| {r['run']} | {r['overrides']} | {100 * r['accuracy_start']:.1f}% -> "
                f"{100 * r['accuracy_final']:.1f}% | {r['reward_last']:.3f} | {r['step_s']:.2f} | "
                f"{r['steps']} | {clock(r['started'])} | {clock(r['ended'])} |"
            )
        else:
            lines.append(f"| {r['run']} | {r['overrides']} | {r['status'].replace('|', '/')} | | | | | |")
    common = " ".join(shared)
    return (
        f"Sweep {sweep_dir}"
        + (f", common overrides: {common}" if common else "")
        + " (times in UTC)\n\n"
        + "\n".join(lines)
        + "\n"
    )


def write_sweep_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = [
        "run",
        "overrides",
        "status",
        "accuracy_start",
        "accuracy_final",
        "reward_last",
        "step_s",
        "steps",
        "started",
        "ended",
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(
                {
                    **r,
                    **{
                        k: datetime.fromtimestamp(r[k], timezone.utc).isoformat()
                        for k in ("started", "ended")
                        if r.get(k) is not None
                    },
                }
            )


def write_sweep_report(sweep_dir: str | Path) -> str:
    """summary.md, summary.csv and the sweep's plots (one line per trial); returns the markdown table."""
    sweep_dir = Path(sweep_dir)
    rows, shared = sweep_rows(sweep_dir)
    table = markdown_table(sweep_dir, rows, shared)
    (sweep_dir / SUMMARY_FILE).write_text(table)
    write_sweep_csv(rows, sweep_dir / SUMMARY_CSV)
    plot_sweep(sweep_dir, {f"{r['run']}: {r['overrides']}": sweep_dir / r["run"] for r in rows})
    return table


def _or_minus_inf(value: float) -> float:
    return value if value == value else float("-inf")  # NaN (no evaluation yet) sorts last


class SweepSummary(Callback):
    """Hydra callback: after a multirun, write the sweep's report (table, CSV, plots) and print the table."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        print(write_sweep_report(sweep_dir))
        print(f"plots: {sweep_dir / 'plots'}")
        failed = sorted(p.parent.name for p in sweep_dir.glob(f"*/{FAILED_FILE}"))
        if failed:  # the sweep ran every trial; its exit status still says that some failed
            # SystemExit, since Hydra turns a callback's exceptions into warnings and exits 0
            raise SystemExit(
                f"{len(failed)} trial(s) of the sweep failed ({', '.join(failed)}): see "
                f"{sweep_dir / SUMMARY_FILE} and each trial's {FAILED_FILE}"
            )


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m rl_tpu.report RUN_OR_SWEEP_FOLDER")
    folder = Path(args[0])
    if (folder / "metrics.jsonl").is_file():
        print("\n".join(f"{key}: {value}" for key, value in run_summary(folder).items()))
        print("plots:", *plot_run(folder), sep="\n  ")
        print(f"rollout inspector: {write_page(folder)}")
    else:
        print(write_sweep_report(folder))
        print(f"plots: {folder / 'plots'}")


if __name__ == "__main__":
    main()
