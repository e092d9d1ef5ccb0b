"""The command: `rl-tpu doctor +recipe=NAME [overrides]`, the recipe and overrides of a run; one line per check,
OUT/doctor.json, and exit status 0 only when no check failed. OUT is outputs/doctor/DATE/TIME unless
`hydra.run.dir=` says otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rl_tpu.config import register_configs
from rl_tpu.doctor.probe import REPORT_FILE, diagnose

DEFAULTS = ("hydra.run.dir=outputs/doctor/${now:%Y-%m-%d}/${now:%H-%M-%S}", "hydra.job.name=doctor")


def doctor_task(cfg: DictConfig) -> None:
    out = Path(HydraConfig.get().runtime.output_dir)
    report = diagnose(OmegaConf.to_object(cfg), out)
    print("\n".join([*report.lines(), f"report: {out / REPORT_FILE}"]), flush=True)
    if not report.passed:
        sys.exit(1)


def cli(args: list[str]) -> None:
    """`args`: what follows `doctor` on the command line (Hydra reads them from sys.argv)."""
    register_configs()
    given = {arg.partition("=")[0] for arg in args}
    sys.argv = [sys.argv[0], *(d for d in DEFAULTS if d.partition("=")[0] not in given), *args]
    hydra.main(version_base=None, config_path="pkg://rl_tpu.configs", config_name="config")(doctor_task)()
