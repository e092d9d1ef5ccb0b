"""`hydra/sweeper=optuna`: an Optuna study over the sweep's overrides (the parts in rl_tpu/sweeps/optuna_study.py).

Hydra finds sweepers only in the `hydra_plugins` package and imports every module there at start-up, so
Optuna itself is imported only when a sweep starts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from rl_tpu.sweeps import optuna_study as impl

ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=impl.OptunaSweeperConf, provider="rl_tpu")
log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any):
        self.settings = impl.settings(**settings)
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Optional[Launcher] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        """Batches of `n_jobs` trials until `n_trials` ran; returns the launcher's results, batch by batch."""
        assert self.config is not None and self.launcher is not None
        space = impl.search_space(self.settings.params, arguments)
        study = impl.make_study(self.settings)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        log.info(
            "Optuna study %s (%s, sampler %s): %d trials, %d at a time, over %s",
            study.study_name,
            self.settings.direction.value,
            self.settings.sampler.value,
            self.settings.n_trials,
            self.settings.n_jobs,
            ", ".join(space.distributions) or "nothing",
        )
        jobs: dict[int, int] = {}  # Optuna's trial number -> its job number (folder) in this sweep
        returns = []
        while len(jobs) < self.settings.n_trials:
            returns.append(self.run_batch(study, space, jobs))
        summary = impl.results(study, jobs)
        path = impl.write_results(sweep_dir, summary)
        self.report(summary, path)
        return returns

    def run_batch(self, study, space: impl.SearchSpace, jobs: dict[int, int]) -> Sequence[JobReturn]:
        """Ask for the next trials, run them with the launcher, tell Optuna how each did."""
        assert self.launcher is not None
        size = min(self.settings.n_jobs, self.settings.n_trials - len(jobs))
        trials = [study.ask(space.distributions) for _ in range(size)]
        batch = [space.overrides(trial.params) for trial in trials]
        try:
            self.validate_batch_is_legal(batch)  # a bad key fails here, before any trial of the batch starts
        except Exception:
            for trial in trials:  # not left running in a stored study
                impl.tell_failed(study, trial)
            raise
        first = len(jobs)
        jobs.update({trial.number: first + i for i, trial in enumerate(trials)})
        results = self.launcher.launch(batch, initial_job_idx=first)
        for trial, result in zip(trials, results):
            impl.tell(study, trial, result)
        return results

    def report(self, summary: dict[str, Any], path: Path) -> None:
        """Log the best trial; when every trial of this sweep failed, raise (after the sweep's end callbacks)."""
        if any(t["state"] == "COMPLETE" for t in summary["trials"] if "job" in t):
            log.info(
                "best value %s with %s (trial %s); every trial in %s",
                summary["best_value"],
                summary["best_params"],
                summary["best_trial"],
                path,
            )
            return
        message = (
            f"every trial of this sweep failed (Optuna study {summary['study_name']}): see {path} and the "
            f"trials' folders"
        )
        log.error(message)
        # Hydra runs on_multirun_end only when sweep() returns; run it now so the sweep's summary is still written
        assert self.config is not None and self.hydra_context is not None
        self.hydra_context.callbacks.on_multirun_end(config=self.config)
        raise RuntimeError(message)
