"""Checkpoints of a run: where they go, which one to resume from, and how many to keep.

A checkpoint is `RUN_DIR/checkpoints/step_N`: the trainer ranks' sharded model, optimizer and
scheduler state (torch.distributed.checkpoint). The ranks write into `step_N.partial` and rank 0
renames it once all have finished, so only a folder named exactly `step_N` with a `.metadata`
file is complete; anything else (a crash mid-save) is ignored and removed by the next save.
Inside it, written before that rename, the driver's part: `data.json` holds how many generation batches the
steps so far took (the step, unless dynamic sampling took more): the prompts' order is replayed from the data
seed past them, and every prompt's sampling seed follows from the run's seed and its batch's number;
`kl_ctrl.json` the KL controller's coefficient; `config.yaml` the run's settings; `queued.json` the generation
batches queued ahead of the step, generated, which a resumed run trains on as they were. A resume that needs one of
them and finds it missing is refused.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

PREFIX = "step_"
_COMPLETE = re.compile(rf"{PREFIX}(\d+)")


def folder_for(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step}"


def step_of(checkpoint: Path) -> int:
    return int(_COMPLETE.fullmatch(checkpoint.name).group(1))


def complete(root: Path) -> list[Path]:
    """The complete checkpoints under `root/checkpoints`, oldest first."""
    found = [
        p
        for p in (root / "checkpoints").glob(f"{PREFIX}*")
        if _COMPLETE.fullmatch(p.name) and (p / ".metadata").is_file()
    ]
    return sorted(found, key=step_of)


def latest(path: Path, key: str = "trainer.resume_from") -> Path:
    """`path` itself if it is a complete checkpoint, else the newest complete checkpoint of a run folder.

    `key` names, in the error, where the path came from."""
    if _COMPLETE.fullmatch(path.name) and (path / ".metadata").is_file():
        return path
    found = complete(path)
    if not found:
        raise FileNotFoundError(
            f"{key}={path}: no complete checkpoint (checkpoints/step_N with a .metadata file) there"
        )
    return found[-1]


def resume_point(run_dir: Path, this_run: bool, resume_from: str | None) -> Path | None:
    """Where a run continues: with `this_run`, the run folder's newest complete checkpoint if it has one
    (`trainer.resume=auto`, or a restart), else `resume_from`'s newest; None: from the start."""
    if this_run and complete(run_dir):
        return complete(run_dir)[-1]
    return latest(Path(resume_from).expanduser()) if resume_from else None


def in_folder(checkpoint: Path, run_dir: Path) -> bool:
    """Whether `checkpoint` is one of `run_dir`'s own: a run resuming from it continues the folder's metrics."""
    return checkpoint.resolve().is_relative_to(run_dir.resolve())


DATA_POSITION = "data.json"
KL_COEF = "kl_ctrl.json"
SETTINGS = "config.yaml"  # the run's settings as given (before anything was derived from them)
QUEUED = "queued.json"  # the generation batches queued ahead of the checkpoint's step, generated


def driver_files(
    gen_batches_taken: int, kl_coef: float | None, settings: str = "", queued: list[dict] = ()
) -> dict[str, str]:
    """The driver's part of a checkpoint, by file name: the trainer writes it into the checkpoint before the rename
    that makes it complete. `kl_coef`: the KL controller's coefficient after the step (`algorithm.use_kl_in_reward`);
    `settings`: the run's settings as YAML; `queued`: the generation batches queued ahead, generated."""
    files = {
        DATA_POSITION: json.dumps({"gen_batches_taken": gen_batches_taken}),
        SETTINGS: settings,
        QUEUED: json.dumps(list(queued)),
    }
    if kl_coef is not None:
        files[KL_COEF] = json.dumps({"kl_coef": kl_coef})
    return files


def data_position(checkpoint: Path) -> int:
    """Generation batches taken before this checkpoint."""
    return json.loads(_required(checkpoint, DATA_POSITION, "the data position"))["gen_batches_taken"]


def kl_coef(checkpoint: Path | None) -> float | None:
    """The saved coefficient of a run with `algorithm.use_kl_in_reward`; None: no checkpoint (the run starts)."""
    if checkpoint is None:
        return None
    what = "the KL controller's coefficient, algorithm.use_kl_in_reward"
    return json.loads(_required(checkpoint, KL_COEF, what))["kl_coef"]


def queued_generations(checkpoint: Path) -> list[dict]:
    """The generation batches that were queued ahead of the checkpoint's step, as `driver_files` saved them."""
    return json.loads(_required(checkpoint, QUEUED, "the generations queued ahead"))


def saved_settings(checkpoint: Path) -> dict:
    """The settings of the run that wrote the checkpoint, as a nested dict."""
    return yaml.safe_load(_required(checkpoint, SETTINGS, "the settings of the run that wrote it")) or {}


def changed_settings(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (saved value, current value)} of every setting that differs."""
    changed = {}
    for key in saved.keys() | now.keys():
        old, new = saved.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed.update(changed_settings(old, new, f"{prefix}{key}."))
        elif old != new:
            changed[f"{prefix}{key}"] = (old, new)
    return changed


def _required(checkpoint: Path, name: str, what: str) -> str:
    """A file a resume needs: missing, the checkpoint is refused (its value is never guessed)."""
    path = checkpoint / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint} has no {name} ({what}): written by another version of rl_tpu or changed since, or a run "
            "without that setting; resume from another checkpoint with trainer.resume_from=RUN/checkpoints/step_N"
        )
    return path.read_text()


def check_room(run_dir: Path) -> None:
    """Before a save: refuse it, naming both sizes, when the run folder's filesystem has less room than the last
    checkpoint took (the new one is as large; the oldest is removed only once it is complete)."""
    saved = complete(run_dir)
    if not saved:
        return
    need = sum(f.stat().st_size for f in saved[-1].rglob("*") if f.is_file())
    free = shutil.disk_usage(saved[-1]).free
    if free < need:
        raise OSError(
            f"no room for the next checkpoint in {run_dir / 'checkpoints'}: {free / 2**20:.0f} MiB free on its "
            f"filesystem, and {saved[-1].name} took {need / 2**20:.0f} MiB. The run stops here; free space (or lower "
            f"trainer.keep_last) and continue it with trainer.resume=auto from {saved[-1].name}"
        )


def every(checkpoint_every: int | None, total_steps: int) -> int:
    """Steps between checkpoints: as set, or by default every 10% of the run (0: none during the run)."""
    return max(1, total_steps // 10) if checkpoint_every is None else checkpoint_every


def prune(run_dir: Path, keep_last: int) -> None:
    """After a save: drop interrupted saves (`.partial` and other stray folders) and all but the newest `keep_last`."""
    keep = set(complete(run_dir)[-keep_last:] if keep_last > 0 else complete(run_dir))
    for folder in (run_dir / "checkpoints").glob(f"{PREFIX}*"):
        if folder not in keep:
            log.info("removing checkpoint folder %s", folder)
            shutil.rmtree(folder, ignore_errors=True)
