"""Checkpoints of a run: where they go, which one to resume from, and how many to keep.

A checkpoint is `RUN_DIR/checkpoints/step_N`: the trainer ranks' sharded model, optimizer and
scheduler state (torch.distributed.checkpoint). The ranks write into `step_N.partial` and rank 0
renames it once all have finished, so only a folder named exactly `step_N` with a `.metadata`
file is complete; anything else (a crash mid-save) is ignored and removed by the next save.
Next to it, `data.json` holds how many generation batches the steps so far took (the step, unless
dynamic sampling took more): the prompts' order is replayed from the data seed past them, and every
prompt's sampling seed follows from the run's seed and its batch's number.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

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


DATA_POSITION = "data.json"
KL_COEF = "kl_ctrl.json"


def save_data_position(checkpoint: Path, gen_batches_taken: int) -> None:
    (checkpoint / DATA_POSITION).write_text(json.dumps({"gen_batches_taken": gen_batches_taken}))


def data_position(checkpoint: Path) -> int:
    """Generation batches taken before this checkpoint; a checkpoint without the file took one per step."""
    path = checkpoint / DATA_POSITION
    return json.loads(path.read_text())["gen_batches_taken"] if path.is_file() else step_of(checkpoint)


def save_kl_coef(checkpoint: Path, coef: float) -> None:
    """The KL controller's coefficient after the checkpoint's step (`algorithm.use_kl_in_reward`)."""
    (checkpoint / KL_COEF).write_text(json.dumps({"kl_coef": coef}))


def kl_coef(checkpoint: Path | None) -> float | None:
    """The saved coefficient; None: no checkpoint, or one saved without KL in the reward."""
    if checkpoint is None or not (checkpoint / KL_COEF).is_file():
        return None
    return json.loads((checkpoint / KL_COEF).read_text())["kl_coef"]


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
