"""Recovering from what goes wrong during a run, beside the controller's loop rather than inside it."""

from __future__ import annotations

import logging

from rl_tpu.data import Example

log = logging.getLogger(__name__)


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
        log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row); the batch's prompts: %s",
                    step, self.in_a_row, rows)
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(f"{self.in_a_row} updates in a row had a non-finite loss or gradient (last at step "
                                     f"{step}, prompts {rows[:16]}); trainer.max_skipped_steps={self.max_in_a_row}. "
                                     "Lower algorithm.lr, check the rewards, or use model.dtype=float32.")
