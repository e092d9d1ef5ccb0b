"""What a run shows an observer as it goes: its inputs before any engine starts, then each step's metrics and the
batch it trained on. The preflight (rl_tpu/doctor/) reads a short run this way; the run itself does not depend on
what the observer does with them."""

from __future__ import annotations

from typing import Any

from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.data.datasets import Example


class RunWatch:
    """The observer a plain run has: it looks at nothing. A subclass overrides what it reads."""

    def inputs(self, tokenizer: Any, examples: list[Example], tools: list[dict] | None) -> None:
        """Before Ray starts: the run's tokenizer, its training examples (prompts as the model reads them) and the
        tools' schemas (None without episodes)."""

    def step(self, step: int, metrics: dict[str, float], batch: GradedBatch) -> None:
        """After each update, before its metrics are logged: its metrics and the groups it trained on, scored."""
