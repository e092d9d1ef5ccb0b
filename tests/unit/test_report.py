"""Run and sweep reports: the summary table and the plots a multirun leaves in its folder; the Ray launcher's
admission arithmetic."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from rl_tpu.outputs.plots import lines_figure, trial_table
from rl_tpu.outputs.report import SUMMARY_CSV, run_summary, sweep_table, write_sweep_report
from rl_tpu.sweeps.ray_launcher import fits


def fake_run(folder, overrides, evals, rewards, step_s=1.0, started=None):
    """A trial's folder as a run leaves it; with `started` (Unix time), its lines carry timestamps."""
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [{"step": 0, "eval/accuracy": evals[0]}]
    for step, reward in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": reward, "time/step_s": step_s * step})
    rows[-1]["eval/accuracy"] = evals[-1]
    if started is not None:  # 30 s of start-up before the first evaluation, then the steps
        for row, elapsed in zip(rows, [30.0 + step_s * (i * (i + 1) / 2) for i in range(len(rows))]):
            row.update({"time/elapsed_s": elapsed, "timestamp": started + elapsed})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sweep_table_ranks_runs_and_shows_what_varied(tmp_path):
    fake_run(tmp_path / "0", ["+recipe=grpo_math", "algorithm.lr=1e-5"], [0.5, 0.6], [0.4, 0.5])
    fake_run(tmp_path / "1", ["+recipe=grpo_math", "algorithm.lr=3e-5"], [0.5, 0.8], [0.4, 0.7, 0.9])
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # a run that died before its first step
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+recipe=grpo_math", "algorithm.lr=1"]))
    table = sweep_table(tmp_path).splitlines()
    assert table[0] == f"Sweep {tmp_path}, common overrides: +recipe=grpo_math (times in UTC)"
    assert table[4] == "| 1 | algorithm.lr=3e-5 | 50.0% -> 80.0% | 0.900 | 2.00 | 3 |  |  |"
    assert table[5] == "| 0 | algorithm.lr=1e-5 | 50.0% -> 60.0% | 0.500 | 1.50 | 2 |  |  |"
    assert table[6].startswith("| 2 | algorithm.lr=1 | no metrics.jsonl")
    assert run_summary(tmp_path / "1")["accuracy_final"] == pytest.approx(0.8)


MIDNIGHT = 1796169600.0  # 2026-12-02 00:00:00 UTC


def test_a_2x2_sweep_plots_one_line_per_trial_and_shows_when_each_ran(tmp_path):
    grid = [
        ("algorithm.lr=1e-5", "sampler.n=4"),
        ("algorithm.lr=1e-5", "sampler.n=8"),
        ("algorithm.lr=3e-5", "sampler.n=4"),
        ("algorithm.lr=3e-5", "sampler.n=8"),
    ]
    for i, overrides in enumerate(grid):  # trials 0 and 1 ran at once, then 2 and 3
        fake_run(
            tmp_path / str(i),
            ["+recipe=grpo_math", *overrides],
            [0.5, 0.6 + 0.05 * i],
            [0.4, 0.5, 0.6 + 0.1 * i],
            started=MIDNIGHT + 3600 + 100 * (i // 2),
        )
    table = write_sweep_report(tmp_path)
    assert "| 3 | algorithm.lr=3e-5 sampler.n=8 | 50.0% -> 75.0% | 0.900 | 2.00 | 3 | 01:01:40 | 01:02:16 |" in table
    assert "| 0 | algorithm.lr=1e-5 sampler.n=4 | 50.0% -> 60.0% | 0.600 | 2.00 | 3 | 01:00:00 | 01:00:36 |" in table
    with (tmp_path / SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["3", "2", "1", "0"] and rows[3]["started"] == "2026-12-02T01:00:00+00:00"

    with (tmp_path / "plots" / "reward.csv").open() as f:
        reward = list(csv.reader(f))
    assert reward[0] == ["step", *(f"{i}: {' '.join(o)}" for i, o in reversed(list(enumerate(grid))))]
    assert [row[0] for row in reward[1:]] == ["1", "2", "3"]  # one row per step
    assert [float(v) for v in reward[3][1:]] == pytest.approx([0.9, 0.8, 0.7, 0.6])
    for name in ("reward", "accuracy", "step_time"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 10_000
    trials = {str(i): json_lines(tmp_path / str(i) / "metrics.jsonl") for i in range(4)}
    figure = lines_figure(trial_table(trials, "reward/mean"), "sweep", "reward")
    assert len(figure.axes[0].get_lines()) == 4


def json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_folder_that_is_not_a_sweep_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hydra sweep folder"):
        sweep_table(tmp_path)


def test_fits_counts_every_resource():
    assert fits({"CPU": 2, "GPU": 1}, {"CPU": 1}, {"CPU": 3, "GPU": 1})
    assert not fits({"CPU": 2, "GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 3, "GPU": 1})
    assert not fits({"TPU": 4}, {}, {"CPU": 8})
