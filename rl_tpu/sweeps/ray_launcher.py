"""Sweep trials at once on a Ray cluster: `-m ... hydra/launcher=ray`.

Each trial is a Ray task that runs one whole run (Hydra's `run_job`, as the basic launcher does in
its own process), with placement groups of its own for its trainer ranks and engines. A trial
starts when the resources its placement plan asks for are free beside those of the trials already
running, so the number of trials at once follows from the cluster (or `ray.num_cpus` of a local one)
and a trial does not start only to wait out its placement timeout behind the others (the count is
against the cluster's totals, not each node's).

Why not Hydra's Ray launcher plugin (hydra-ray-launcher 1.2.2): it requires cloudpickle<3, and vLLM
runs here with cloudpickle 3; it pulls boto3 and ray[default] for its AWS mode; and it submits every
trial at once with no resources held, so the trials' placement groups race and the losers wait out
`ray.placement_timeout_s`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rl_tpu.cluster import placement
from rl_tpu.outputs.report import FAILED_FILE

log = logging.getLogger(__name__)


@dataclass
class RayLauncherConf:
    """`hydra.launcher.*` of `hydra/launcher=ray`; the cluster itself is the trials' `ray.*` config."""

    _target_: str = "hydra_plugins.rl_tpu_launcher.ray_launcher.RayLauncher"
    max_concurrent: Optional[int] = None  # at most this many trials at once; None: as many as the resources hold
    trial_timeout_s: float = 7 * 86400.0  # a trial still running after this long is cancelled and marked failed


@dataclass
class Trial:
    index: int
    overrides: list[str]
    config: DictConfig  # the trial's whole config, `hydra` node included
    demand: dict[str, float]  # what its placement plan reserves
    ref: Any = None  # the Ray task, once started
    deadline: float = math.inf
    started: float = 0.0


def task_config(sweep_config: DictConfig) -> DictConfig:
    cfg = copy.deepcopy(sweep_config)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def trial_demand(sweep_config: DictConfig, cluster: dict[str, float]) -> dict[str, float]:
    """The resources the trial's actors will reserve; {} when its config cannot be planned (it fails on its own)."""
    try:
        cfg = OmegaConf.to_object(task_config(sweep_config))
        return placement.make_plan(cfg, placement.device_kind(cfg.device, cluster), cluster).asked
    except Exception as error:  # the trial starts at once, and its run stops with the error and the key
        log.info("trial %s: no placement plan (%s); it runs at once and reports why", sweep_config.hydra.job.num, error)
        return {}


def fits(demand: dict[str, float], in_use: dict[str, float], cluster: dict[str, float]) -> bool:
    return all(in_use.get(k, 0.0) + v <= cluster.get(k, 0.0) + 1e-9 for k, v in demand.items())


def trial_dir(sweep_config: DictConfig) -> Path:
    HydraConfig.instance().set_config(sweep_config)  # for ${hydra:job.num} in hydra.sweep.subdir
    return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)


def run_trial(
    hydra_context: HydraContext, sweep_config: DictConfig, task_function: TaskFunction, singleton_state: dict
) -> JobReturn:
    """In the trial's Ray task: the Hydra state of the sweep, then the run, as the basic launcher runs it."""
    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    return run_job(
        hydra_context=hydra_context,
        task_function=task_function,
        config=sweep_config,
        job_dir_key="hydra.sweep.dir",
        job_subdir_key="hydra.sweep.subdir",
    )


def failed_return(trial: Trial, why: str) -> JobReturn:
    """A trial whose task died or ran out of time: recorded in its folder, and the sweep goes on (as for a run
    that raised, whose `main` records it)."""
    folder = trial_dir(trial.config)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED_FILE).write_text(why + "\n")
    log.error("trial %d failed: %s", trial.index, why.strip().splitlines()[-1])
    return JobReturn(
        overrides=trial.overrides,
        cfg=task_config(trial.config),
        working_dir=str(folder),
        status=JobStatus.COMPLETED,
        _return_value=float("nan"),
    )


def launch(
    settings: RayLauncherConf,
    config: DictConfig,
    hydra_context: HydraContext,
    task_function: TaskFunction,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
) -> list[JobReturn]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rl_tpu.cluster.placement import start_ray

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    start_ray(OmegaConf.to_object(config.ray))
    cluster = ray.cluster_resources()
    trials = make_trials(config, hydra_context, job_overrides, initial_job_idx, cluster)
    log.info("Ray launcher: %d trials on a cluster with %s", len(trials), placement.describe(cluster))
    remote_trial = ray.remote(num_cpus=0, max_retries=0)(run_trial)  # the trial's actors hold its resources
    # the trials' drivers run on this node, where the sweep folder, the cache and the data paths are
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    def start(trial: Trial) -> None:
        trial.ref = remote_trial.options(name=f"trial_{trial.index}", scheduling_strategy=here).remote(
            hydra_context, trial.config, task_function, Singleton.get_state()
        )

    results = run_all(trials, start, cluster, settings)
    return [results[t.index] for t in trials]


def make_trials(
    config: DictConfig,
    hydra_context: HydraContext,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    cluster: dict[str, float],
) -> list[Trial]:
    # the sweep folder is resolved here, once: its ${now:} would give each task its own time
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    trials = []
    for i, overrides in enumerate(job_overrides):
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = initial_job_idx + i
            sweep_config.hydra.sweep.dir = str(sweep_dir)
        trials.append(Trial(initial_job_idx + i, list(overrides), sweep_config, trial_demand(sweep_config, cluster)))
    return trials


def run_all(trials: list[Trial], start, cluster: dict[str, float], settings: RayLauncherConf) -> dict[int, JobReturn]:
    """Start trials in order while their demand fits beside the running ones' (one at least), until all are done."""
    import ray

    waiting, running, results = list(trials), [], {}
    while waiting or running:
        while (
            waiting
            and (not running or fits(waiting[0].demand, in_use(running), cluster))
            and len(running) < (settings.max_concurrent or math.inf)
        ):
            trial = waiting.pop(0)
            start(trial)
            trial.started, trial.deadline = time.monotonic(), time.monotonic() + settings.trial_timeout_s
            running.append(trial)
            log.info(
                "trial %d started (%s; reserves %s; %d running)",
                trial.index,
                " ".join(filter_overrides(trial.overrides)),
                placement.describe(trial.demand),
                len(running),
            )
        next_deadline = min(t.deadline for t in running)
        done, _ = ray.wait(
            [t.ref for t in running], num_returns=1, timeout=max(0.0, min(next_deadline - time.monotonic(), 3600.0))
        )
        for trial in [t for t in running if t.ref in done or time.monotonic() > t.deadline]:
            running.remove(trial)
            results[trial.index] = collect(trial, settings.trial_timeout_s)
    return results


def collect(trial: Trial, timeout_s: float) -> JobReturn:
    import ray

    ready, _ = ray.wait([trial.ref], timeout=0)
    if not ready:
        ray.cancel(trial.ref, force=True)
        return failed_return(
            trial,
            f"TimeoutError: trial {trial.index} still running after "
            f"hydra.launcher.trial_timeout_s={timeout_s:g} s; cancelled",
        )
    try:
        result = ray.get(trial.ref)
    except Exception:  # the task's process died (killed, out of memory): the trial could not record it itself
        return failed_return(trial, traceback.format_exc())
    log.info("trial %d finished in %.0f s", trial.index, time.monotonic() - trial.started)
    return result


def in_use(running: list[Trial]) -> dict[str, float]:
    return dict(sum((Counter(t.demand) for t in running), Counter()))
