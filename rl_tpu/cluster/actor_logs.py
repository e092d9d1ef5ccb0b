"""Actor output into the run folder: every line an actor prints or logs goes to `RUN_DIR/logs/<actor>.log`.

Ray keeps worker output in its session folder on each node, under names made of process ids;
users look for an actor's log next to the run's metrics, so each actor sends its own file
descriptors 1 and 2 (Python's prints, `logging`, and native code such as vLLM's kernels) to a
file named after its role. On several hosts the run folder must be shared storage, which the
controller checks at start.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def actor_name(role: str, index: int) -> str:
    """`trainer_0`, `sampler_1`: how the driver's messages, the log files and placement.json name an actor."""
    return f"{role}_{index}"


def log_path(log_dir: str | Path, actor: str) -> Path:
    return Path(log_dir) / f"{actor}.log"


def send_output_to_file(log_dir: str | None, actor: str) -> None:
    """Redirect this process's stdout and stderr to the actor's log file and log INFO and above there."""
    if not log_dir:
        return
    path = log_path(log_dir, actor)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, format=f"[{actor}] {FORMAT}", stream=sys.stderr, force=True)
    logging.getLogger(__name__).info("%s started, pid %d", actor, os.getpid())
