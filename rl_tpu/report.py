"""Reports from what runs leave behind: one run's summary, and a table of a sweep's runs.

    python -m rl_tpu.report multirun/2026-11-30/10-00-00     # a sweep: one row per run
    python -m rl_tpu.report outputs/2026-11-30/10-00-00      # one run

A Hydra multirun writes the same table to `summary.md` in its sweep folder when it ends
(`SweepSummary`, registered in configs/config.yaml).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from rl_tpu.metrics import final_accuracy, read_metrics

SUMMARY_FILE = "summary.md"
FAILED_FILE = "error.txt"  # a sweep trial that raised leaves its traceback here


def run_summary(run_dir: str | Path) -> dict[str, Any]:
    """Held-out accuracy before and after, steps done, and the step's speed, from `metrics.jsonl`."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "time/step_s" in r]
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "accuracy_start": evals[0] if evals else float("nan"),
        "accuracy_final": final_accuracy(evals),
        "reward_last": steps[-1]["reward/mean"] if steps else float("nan"),
        "step_s": statistics.median(r["time/step_s"] for r in steps) if steps else float("nan"),
    }


def run_overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(path.read_text()) or []) if path.is_file() else []


def sweep_table(sweep_dir: str | Path) -> str:
    """A markdown table of every finished run in a sweep folder, best final accuracy first.

    Only the overrides that differ between runs are shown; a run that stopped before its first
    metrics is listed as such rather than left out.
    """
    sweep_dir = Path(sweep_dir)
    runs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not runs:
        raise FileNotFoundError(f"{sweep_dir}: no numbered run folders (0, 1, ...): not a Hydra sweep folder")
    overrides = {run: run_overrides(run) for run in runs}
    shared = set.intersection(*(set(o) for o in overrides.values()))
    lines = ["| run | overrides | held-out accuracy start -> final | last reward | s/step | steps |",
             "|---|---|---|---|---|---|"]
    finished, failed = [], []
    for run in runs:
        varied = " ".join(o for o in overrides[run] if o not in shared) or "(none)"
        if (run / FAILED_FILE).is_file():  # crashed, perhaps mid-run: failed, not ranked
            error = (run / FAILED_FILE).read_text().strip().splitlines()[-1]
            failed.append((run, varied, f"failed: {error}"))
        elif (run / "metrics.jsonl").is_file():
            finished.append((run, varied, run_summary(run)))
        else:
            failed.append((run, varied, "no metrics.jsonl (the run failed before its first step)"))
    for run, varied, s in sorted(finished, key=lambda item: -_or_minus_inf(item[2]["accuracy_final"])):
        lines.append(f"| {run.name} | {varied} | {100 * s['accuracy_start']:.1f}% -> {100 * s['accuracy_final']:.1f}% | "
                     f"{s['reward_last']:.3f} | {s['step_s']:.2f} | {s['steps']} |")
    lines += [f"| {run.name} | {varied} | {why.replace('|', '/')} | | | |" for run, varied, why in failed]
    common = " ".join(sorted(shared))
    return f"Sweep {sweep_dir}" + (f", common overrides: {common}" if common else "") + "\n\n" + "\n".join(lines) + "\n"


def _or_minus_inf(value: float) -> float:
    return value if value == value else float("-inf")  # NaN (no evaluation yet) sorts last


class SweepSummary(Callback):
    """Hydra callback: after a multirun, write the sweep's table to `summary.md` and print it."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        table = sweep_table(sweep_dir)
        (sweep_dir / SUMMARY_FILE).write_text(table)
        print(table)
        failed = sorted(p.parent.name for p in sweep_dir.glob(f"*/{FAILED_FILE}"))
        if failed:  # the sweep ran every trial; its exit status still says that some failed
            # SystemExit, since Hydra turns a callback's exceptions into warnings and exits 0
            raise SystemExit(f"{len(failed)} trial(s) of the sweep failed ({', '.join(failed)}): see "
                             f"{sweep_dir / SUMMARY_FILE} and each trial's {FAILED_FILE}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m rl_tpu.report RUN_OR_SWEEP_FOLDER")
    folder = Path(args[0])
    if (folder / "metrics.jsonl").is_file():
        print("\n".join(f"{key}: {value}" for key, value in run_summary(folder).items()))
    else:
        print(sweep_table(folder))


if __name__ == "__main__":
    main()
