"""The Ray launcher: trials start while their placement demand fits, and a trial past its deadline is cancelled and
recorded as failed (real Ray tasks stand in for the trials' runs); a real sweep of runs on it, with its report."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from datetime import datetime

from conftest import ship_by_value
from hydra.conf import HydraConf
from omegaconf import OmegaConf

from rl_tpu.outputs.report import FAILED_FILE, SUMMARY_CSV
from rl_tpu.sweeps.ray_launcher import RayLauncherConf, Trial, run_all


def trial(index: int, demand: dict, sweep_dir) -> Trial:
    hydra = OmegaConf.structured(HydraConf)
    hydra.sweep.dir, hydra.sweep.subdir = str(sweep_dir), str(index)
    return Trial(index, [f"seed={index}"], OmegaConf.create({"hydra": hydra, "seed": index}), demand)


def test_trials_start_only_while_their_demand_fits(ray_cluster, tmp_path):
    ship_by_value(__name__)

    @ray_cluster.remote(num_cpus=0)
    def run_for(seconds: float) -> tuple[float, float]:
        began = time.time()
        time.sleep(seconds)
        return began, time.time()

    # a cluster of 3 CPUs: the two 2-CPU trials cannot overlap; the 1-CPU one runs beside the first
    trials = [trial(0, {"CPU": 2.0}, tmp_path), trial(1, {"CPU": 1.0}, tmp_path), trial(2, {"CPU": 2.0}, tmp_path)]

    def start(t: Trial) -> None:
        t.ref = run_for.remote(1.5 if t.index == 0 else 0.5)

    results = run_all(trials, start, {"CPU": 3.0}, RayLauncherConf())
    spans = {i: r for i, r in results.items()}
    assert spans[1][0] < spans[0][1]  # trial 1 ran beside trial 0
    assert spans[2][0] >= spans[0][1] - 0.05  # trial 2 waited for trial 0's CPUs


def test_a_trial_past_its_deadline_is_cancelled_and_recorded(ray_cluster, tmp_path):
    ship_by_value(__name__)

    @ray_cluster.remote(num_cpus=0)
    def hang() -> None:
        time.sleep(600)

    trials = [trial(0, {"CPU": 1.0}, tmp_path)]

    def start(t: Trial) -> None:
        t.ref = hang.remote()

    began = time.monotonic()
    results = run_all(trials, start, {"CPU": 4.0}, RayLauncherConf(trial_timeout_s=1.0))
    assert time.monotonic() - began < 30
    assert results[0].return_value != results[0].return_value  # NaN: the sweeper sees a failed trial
    assert (
        "trial 0 still running after hydra.launcher.trial_timeout_s=1 s" in (tmp_path / "0" / FAILED_FILE).read_text()
    )


def test_a_ray_launched_sweep_runs_trials_at_once_and_records_the_failed_ones(tmp_path):
    """A 2x2 sweep on the Ray launcher; a local cluster of 4 CPUs holds two 2-CPU trials at once.

    The batch of 100000 prompts is more than the task has: those two trials fail, are listed as failed, and
    the sweep still runs the others and exits non-zero.
    """
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.main",
        "-m",
        "+recipe=grpo_math",
        "hydra/launcher=ray",
        "ray.num_cpus=4",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        f"cache_dir={tmp_path / 'cache'}",
        "model.tiny.warm_start_steps=0",
        "sampler.n=4",
        "data.num_eval=16",
        "trainer.total_steps=2",
        "trainer.checkpoint_final=false",
        "trainer.export=false",
        "algorithm.lr=1e-5,1e-4",
        "data.train_batch_size=4,100000",
    ]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode != 0 and "2 trial(s) of the sweep failed (1, 3)" in result.stderr, result.stderr[-4000:]
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert summary in result.stdout
    assert (
        "| algorithm.lr=1e-05 data.train_batch_size=100000 | failed: ValueError: data.train_batch_size=100000"
        in summary
    )
    with (tmp_path / "sweep" / SUMMARY_CSV).open() as f:
        finished = [r for r in csv.DictReader(f) if r["status"] == "finished"]
    assert len(finished) == 2 and all(r["steps"] == "2" for r in finished)
    spans = [(datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["ended"])) for r in finished]
    overlapping = max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)
    assert overlapping >= 2, f"no two trials ran at once: {spans}"
    with (tmp_path / "sweep" / "plots" / "reward.csv").open() as f:
        header = next(csv.reader(f))
    assert len(header) == 1 + 2  # step, then one line per finished trial
