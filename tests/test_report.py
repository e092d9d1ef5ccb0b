"""Run and sweep reports: the summary table a multirun leaves in its folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from rl_tpu.report import run_summary, sweep_table


def fake_run(folder, overrides, evals, rewards, step_s=1.0):
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [{"step": 0, "eval/accuracy": evals[0]}]
    for step, reward in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": reward, "time/step_s": step_s * step})
    rows[-1]["eval/accuracy"] = evals[-1]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sweep_table_ranks_runs_and_shows_what_varied(tmp_path):
    fake_run(tmp_path / "0", ["+recipe=grpo_math", "algorithm.lr=1e-5"], [0.5, 0.6], [0.4, 0.5])
    fake_run(tmp_path / "1", ["+recipe=grpo_math", "algorithm.lr=3e-5"], [0.5, 0.8], [0.4, 0.7, 0.9])
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # a run that died before its first step
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+recipe=grpo_math", "algorithm.lr=1"]))
    table = sweep_table(tmp_path).splitlines()
    assert table[0] == f"Sweep {tmp_path}, common overrides: +recipe=grpo_math"
    assert table[4] == "| 1 | algorithm.lr=3e-5 | 50.0% -> 80.0% | 0.900 | 2.00 | 3 |"
    assert table[5] == "| 0 | algorithm.lr=1e-5 | 50.0% -> 60.0% | 0.500 | 1.50 | 2 |"
    assert table[6].startswith("| 2 | algorithm.lr=1 | no metrics.jsonl")
    assert run_summary(tmp_path / "1")["accuracy_final"] == pytest.approx(0.8)


def test_a_folder_that_is_not_a_sweep_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hydra sweep folder"):
        sweep_table(tmp_path)


@pytest.mark.e2e
def test_multirun_writes_its_summary(tmp_path):
    cmd = [sys.executable, "-m", "rl_tpu.main", "-m", "+recipe=grpo_math", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           f"cache_dir={tmp_path / 'cache'}", "model.tiny.warm_start_steps=0", "data.train_batch_size=4", "sampler.n=4",
           "data.num_eval=16", "trainer.total_steps=1", "trainer.checkpoint_final=false", "trainer.export=false",
           "algorithm.lr=1e-5,1e-4", "sampler.n=4,0"]  # sampler.n=0 is invalid: two of the four trials fail
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0 and "2 trial(s) of the sweep failed (2, 3)" in result.stderr, result.stderr[-4000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    finished = [r for r in rows if "->" in r]
    assert len(finished) == 2 and all("sampler.n=4" in r for r in finished)
    assert "| sampler.n=4 algorithm.lr=1e-05 |" in summary  # as Hydra writes them
    failed = [r for r in rows if "failed: ValueError: sampler.n=0" in r]
    assert len(failed) == 2 and all("sampler.n=0" in r for r in failed)
    assert summary in result.stdout
