"""Entry point: `rl-tpu +recipe=grpo_math [overrides]` or `python -m rl_tpu.main ...` (add `-m` for a sweep);
`rl-tpu doctor ...` runs the preflight alone (rl_tpu/doctor/)."""

from __future__ import annotations

import gc
import logging
import shlex
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rl_tpu.config import RunConfig, register_configs
from rl_tpu.outputs.plots import PLOTS_DIR
from rl_tpu.outputs.report import FAILED_FILE

register_configs()
log = logging.getLogger("rl_tpu")
HYDRA_RECORD = ".hydra"  # where Hydra keeps a run's settings, by default


def resume_command(run_dir: Path) -> str:
    """The command line that continues this run in its own folder from its newest checkpoint."""
    kept = [
        o
        for o in HydraConfig.get().overrides.task
        if not o.startswith(("hydra.run.dir=", "trainer.resume=", "trainer.resume_from="))
    ]
    return shlex.join(["python", "-m", "rl_tpu.main", *kept, f"hydra.run.dir={run_dir}", "trainer.resume=auto"])


def record_run(run_dir: Path, cfg: DictConfig) -> None:
    """The run's settings, written into its folder once its checks have passed (a refused run leaves the folder as
    it was): resolved_config.yaml, and Hydra's own record in .hydra/, which Hydra is told not to write before the
    run starts (hydra.output_subdir: null in configs/config.yaml)."""
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    record = run_dir / HYDRA_RECORD
    record.mkdir(exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg  # as Hydra writes them: the task's settings, Hydra's, the overrides
    overrides = hydra_cfg.hydra.overrides.task
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", overrides)):
        (record / name).write_text(OmegaConf.to_yaml(node))


def run_task(cfg: DictConfig) -> float:
    """One run (or one sweep trial) in the folder Hydra chose; returns the final held-out accuracy."""
    from rl_tpu.controller import evaluation
    from rl_tpu.controller.recovery import RunInterrupted
    from rl_tpu.controller.run import run
    from rl_tpu.outputs import checkpoints

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_cfg: RunConfig = OmegaConf.to_object(cfg)
    checked = False
    t = run_cfg.trainer

    def on_checked() -> None:
        nonlocal checked
        checked = True
        record_run(run_dir, cfg)

    try:
        if t.preflight and checkpoints.resume_point(run_dir, t.resume == "auto", t.resume_from) is None:
            from rl_tpu.doctor.probe import preflight

            preflight(run_cfg, run_dir / "preflight")  # stops here when a check fails
        summary = run(run_cfg, run_dir, on_checked=on_checked)
    except RunInterrupted as stopped:  # preemption or Ctrl-C: saved, stop with the shell's status for the signal
        print(f"{stopped}. Continue with:\n  {resume_command(run_dir)}", flush=True)
        sys.exit(143 if stopped.signal_name == "SIGTERM" else 130)
    except Exception:
        if checked and checkpoints.complete(run_dir):  # not after a refusal: the command would be refused again
            log.error("the run failed; it can continue from its newest checkpoint with:\n  %s", resume_command(run_dir))
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise
        # one failed trial must not end the sweep: record it, and the summary lists it as failed, with its overrides
        log.exception("trial %s failed", run_dir.name)
        if not checked:
            record_run(run_dir, cfg)
        (run_dir / FAILED_FILE).write_text(traceback.format_exc())
        return float("nan")
    plots = f"; plots in {run_dir / PLOTS_DIR}" if (run_dir / PLOTS_DIR).is_dir() else ""
    print(f"{evaluation.describe(summary)}; outputs in {run_dir}{plots}")
    return summary["eval/accuracy_final"]  # the value a sweeper optimises


# a plain function under the decorator, so that a sweep's Ray tasks receive it by name (rl_tpu/sweeps/ray_launcher.py)
main = hydra.main(version_base=None, config_path="pkg://rl_tpu.configs", config_name="config")(run_task)


def inspect_run(args: list[str]) -> None:
    """`rl-tpu inspect RUN`: write the run's rollout inspector, RUN/inspect.html, and print where it is."""
    from rl_tpu.outputs.inspect import write_page

    if len(args) != 1 or args[0].startswith("-"):
        raise SystemExit("usage: rl-tpu inspect RUN_FOLDER")
    print(write_page(args[0]))


SUBCOMMANDS = {"inspect": inspect_run}  # `rl-tpu NAME ...`: the first argument names them (rl_tpu/cli_help.py)


def cli() -> None:
    """The `rl-tpu` command: a subcommand (`SUBCOMMANDS`), or a run; `--help` lists the recipes and keys (Hydra's own
    help is `--hydra-help`)."""
    if sys.argv[1:2] and sys.argv[1] in SUBCOMMANDS:
        SUBCOMMANDS[sys.argv[1]](sys.argv[2:])
        return
    if {"-h", "--help"} & set(sys.argv[1:]):
        from rl_tpu.cli_help import help_text

        print(help_text(), end="")
        return
    entry = main
    if sys.argv[1:2] == ["doctor"]:  # a subcommand: what follows is a run's recipe and overrides
        from rl_tpu.doctor.command import cli as doctor

        def entry() -> None:
            doctor(sys.argv[2:])

    try:
        entry()
    finally:
        # the interpreter's exit then skips its last collections over everything torch, vLLM and Ray imported:
        # 3-4 s of a short run's exit on a 2-core host (docs/performance.md#start-up-and-exit). Nothing is lost:
        # the run's files are closed by now, and exit hooks and reference counting still run.
        gc.freeze()


if __name__ == "__main__":
    cli()
