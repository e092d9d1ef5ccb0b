"""Recovering from what goes wrong during a run, beside the controller's loop rather than inside it."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Callable, TypeVar

from rl_tpu.cluster.calls import ActorError
from rl_tpu.data.datasets import Example

log = logging.getLogger(__name__)
T = TypeVar("T")


class SkippedStepGuard:
    """Counts updates the trainer skipped for a non-finite loss or gradient; stops the run after too many in a row."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, 0

    def observe(self, step: int, metrics: dict[str, float], prompts: list[Example]) -> None:
        """Adds `actor/skipped_steps` (so far) to the step's metrics; raises past `trainer.max_skipped_steps`."""
        skipped = bool(metrics.get("actor/skipped"))
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += skipped
        metrics["actor/skipped_steps"] = float(self.total)
        if not skipped:
            return
        rows = [p.extra_info.get("index", i) for i, p in enumerate(prompts)]
        log.warning(
            "step %d: non-finite loss or gradient, update skipped (%d in a row); the batch's prompts: %s",
            step,
            self.in_a_row,
            rows,
        )
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.in_a_row} updates in a row had a non-finite loss or gradient (last at step "
                f"{step}, prompts {rows[:16]}); trainer.max_skipped_steps={self.max_in_a_row}. "
                "Lower algorithm.lr, check the rewards, or use model.dtype=float32."
            )


class RunInterrupted(Exception):
    """The run stopped early on a signal, after saving; `checkpoint` is what it continues from."""

    def __init__(self, step: int, signal_name: str, checkpoint: Path | None):
        where = f"checkpoint {checkpoint}" if checkpoint else "nothing to save yet"
        super().__init__(f"{signal_name} after step {step}: stopped ({where})")
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


class StopRequest:
    """While entered, SIGTERM or SIGINT asks the loop to finish its step, save and stop (preemption).

    The handler only records the request: a step is never cut in the middle. A second signal stops
    at once (KeyboardInterrupt), for a user who does not want to wait for the step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None  # the signal's name, once one arrived
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without saving")
        self.requested = signal.Signals(signum).name
        log.warning(
            "%s received: the current step finishes, a checkpoint is saved, then the run stops "
            "(send it again to stop at once)",
            self.requested,
        )

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def with_restarts(attempt: Callable[[int], T], max_restarts: int) -> T:
    """`attempt(n)` for n = 0, 1, ...: again after an actor's process was lost, at most `max_restarts` times.

    Only a lost process is worth a restart (a killed or crashed actor, a lost node); an exception an
    actor raised, or a deadline it missed, would happen again and stops the run.
    """
    restarts = 0
    while True:
        try:
            return attempt(restarts)
        except ActorError as err:
            if not err.lost or restarts >= max_restarts:
                raise
            restarts += 1
            log.warning(
                "%s was lost (%s): restarting every actor from the last checkpoint (restart %d of "
                "trainer.max_restarts=%d)",
                err.actor,
                str(err).splitlines()[0],
                restarts,
                max_restarts,
            )
