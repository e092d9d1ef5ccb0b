"""The Ray launcher's admission: trials start while their placement demand fits, and a trial past its deadline
is cancelled and recorded as failed. Real Ray tasks stand in for the trials' runs."""

from __future__ import annotations

import time

from conftest import ship_by_value
from hydra.conf import HydraConf
from omegaconf import OmegaConf

from rl_tpu.outputs.report import FAILED_FILE
from rl_tpu.sweeps.ray_launcher import RayLauncherConf, Trial, fits, run_all


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


def test_fits_counts_every_resource():
    assert fits({"CPU": 2, "GPU": 1}, {"CPU": 1}, {"CPU": 3, "GPU": 1})
    assert not fits({"CPU": 2, "GPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 3, "GPU": 1})
    assert not fits({"TPU": 4}, {}, {"CPU": 8})
