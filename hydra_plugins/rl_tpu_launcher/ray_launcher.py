"""`hydra/launcher=ray`: the sweep's trials at once on a Ray cluster (the work is in rl_tpu/sweeps/ray_launcher.py).

Hydra finds launchers only in the `hydra_plugins` package, and imports every module there at start-up,
so this one stays small and imports Ray only when a sweep launches.
"""

from __future__ import annotations

from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from rl_tpu.sweeps.ray_launcher import RayLauncherConf, launch

ConfigStore.instance().store(group="hydra/launcher", name="ray", node=RayLauncherConf, provider="rl_tpu")


class RayLauncher(Launcher):
    def __init__(self, max_concurrent: Optional[int] = None, trial_timeout_s: float = RayLauncherConf.trial_timeout_s):
        self.settings = RayLauncherConf(max_concurrent=max_concurrent, trial_timeout_s=trial_timeout_s)
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        return launch(
            self.settings, self.config, self.hydra_context, self.task_function, job_overrides, initial_job_idx
        )
