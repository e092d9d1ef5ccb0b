"""Entry point: `python -m rl_tpu.main +recipe=grpo_math [overrides]` (add `-m` for a sweep)."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rl_tpu.config import RunConfig, register_configs
from rl_tpu.report import FAILED_FILE

register_configs()
log = logging.getLogger("rl_tpu")


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> float:
    from rl_tpu import controller

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run_cfg: RunConfig = OmegaConf.to_object(cfg)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        summary = controller.run(run_cfg, run_dir)
    else:  # one failed trial must not end the sweep: record it, and the summary lists it as failed
        try:
            summary = controller.run(run_cfg, run_dir)
        except Exception:  # noqa: BLE001  (any failure of a trial, reported in its folder and the summary)
            log.exception("trial %s failed", run_dir.name)
            (run_dir / FAILED_FILE).write_text(traceback.format_exc())
            return float("nan")
    print(f"held-out accuracy: {100 * summary['eval/accuracy_start']:.1f}% after warm start -> "
          f"{100 * summary['eval/accuracy_final']:.1f}% after GRPO; wall time {summary['time/wall_s']:.0f} s; "
          f"outputs in {run_dir}")
    return summary["eval/accuracy_final"]  # the value a sweeper optimises


if __name__ == "__main__":
    main()
