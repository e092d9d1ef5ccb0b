"""Where a run's metrics go besides `metrics.jsonl`: TensorBoard, Weights & Biases, MLflow, trackio ...

Each tracker is one backend of verl's `Tracking` (`verl.utils.tracking`), made on its own. So a
tracker that is missing, or whose service cannot be reached, costs one warning and the run goes on
with the others. `metrics.jsonl` is always written: resume, the reports and the sweep table read
it. Files a tracker writes locally go into the run folder (`tensorboard/`, `wandb/`, `mlruns.db`),
unless the tracker's own environment variable says otherwise.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rl_tpu.config import RunConfig

log = logging.getLogger(__name__)

# trainer.logger names handled here, through verl's Tracking; `console` (the progress bar) and `jsonl`
# are the run's own (rl_tpu/outputs/metrics.py)
VERL_BACKENDS = ("tensorboard", "wandb", "mlflow", "trackio", "swanlab", "clearml")
TENSORBOARD_DIR = "tensorboard"


def local_dirs(run_dir: Path) -> dict[str, str]:
    """The environment variables verl's backends read for their local files, pointed into the run folder."""
    return {
        "TENSORBOARD_DIR": str(run_dir / TENSORBOARD_DIR),
        "WANDB_DIR": str(run_dir),
        "MLFLOW_TRACKING_URI": f"sqlite:///{run_dir / 'mlruns.db'}",
        "SWANLAB_LOG_DIR": str(run_dir / "swanlog"),
    }


@contextmanager
def environment_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set each variable the user has not set, for the duration of the block (a sweep's next trial has its own)."""
    added = [key for key in values if key not in os.environ]
    os.environ.update({key: values[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def for_run(cfg: RunConfig, run_dir: Path) -> "Trackers":
    """The trackers `trainer.logger` names, with the run's resolved config."""
    from omegaconf import OmegaConf

    t = cfg.trainer
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    return Trackers(
        list(t.logger),
        run_dir,
        t.project_name,
        t.experiment_name or f"{run_dir.parent.name}/{run_dir.name}",
        config,
    )


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics (trackers plot numbers; `sync/transport` and other labels stay in metrics.jsonl)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    """The run's external trackers; every failure is a warning, never the end of the run."""

    def __init__(self, names: list[str], run_dir: Path, project: str, experiment: str, config: dict[str, Any]):
        from verl.utils.tracking import Tracking

        self.backends: dict[str, Any] = {}
        with environment_defaults(local_dirs(Path(run_dir))):
            for name in (n for n in names if n in VERL_BACKENDS):
                try:
                    self.backends[name] = Tracking(project, experiment, default_backend=[name], config=config)
                except ImportError as missing:
                    log.warning("trainer.logger: %s is not installed (%s); the run goes on without it", name, missing)
                except Exception as failed:  # offline, no credentials, a server that refuses: not worth the run
                    log.warning(
                        "trainer.logger: %s could not start (%s: %s); the run goes on without it",
                        name,
                        type(failed).__name__,
                        failed,
                    )
        if "tensorboard" in self.backends:
            self._tensorboard_config(config)

    def _tensorboard_config(self, config: dict[str, Any]) -> None:
        # verl's TensorBoard adapter logs scalars only; the resolved config goes beside them as text, through the
        # adapter's public SummaryWriter
        import yaml

        writer = self.backends["tensorboard"].logger["tensorboard"].writer
        writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = scalars(metrics)
        for name, tracking in list(self.backends.items()):
            try:
                tracking.log(values, step)
            except Exception as failed:
                log.warning(
                    "trainer.logger: %s failed at step %d (%s: %s); no more metrics go to it",
                    name,
                    step,
                    type(failed).__name__,
                    failed,
                )
                self._finish(name, tracking)

    def close(self) -> None:
        for name, tracking in list(self.backends.items()):
            self._finish(name, tracking)

    def _finish(self, name: str, tracking: Any) -> None:
        self.backends.pop(name, None)
        try:
            tracking.finish()
        except Exception as failed:
            log.warning("trainer.logger: %s did not close cleanly (%s: %s)", name, type(failed).__name__, failed)
