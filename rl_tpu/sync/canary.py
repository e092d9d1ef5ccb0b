"""The canary: every weight version an engine installs is proved served, not only received.

Checksums prove which bytes arrived; they cannot see an install that kept the old weights, an adapter loaded but
not applied, a tied head left stale or an engine woken from sleep without its weights. So right after an engine
installs version v (and once at start, version 0, before the first evaluation) it scores a fixed canary: a few
short prompts with continuations in the run's own tokenizer, through the adapter request the run's generations
use (`rl_tpu/sampler/scoring.py`). Trainer rank 0 scores the same tokens under the weights it published as v
(`rl_tpu/trainer/canary.py`) and sends them with the bundle (`records.Canary`). `CanaryWatch` compares each
engine's answer with the trainer's: the gap (the largest per-token logprob difference) must stay under a bound set
by the dtype (`sync.canary.max_gap`), and an engine's canary must move when the trainer's moved (a stale engine's
is bit for bit the one it gave for the version before). Either failing stops the run, naming the engine, the
version and the gap. The figures and how the bounds were set: docs/reliability.md.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from rl_tpu.records import Canary, WeightSyncError

# (prompt, continuation): arithmetic as the math recipes ask it, prose and code. Digits after "A:" are where a
# model is least certain, where one update moves a logprob most.
CANARY_TEXTS = (
    ("Q: What is 47 + 38? A:", " 85. Q: What is 12 - 30? A: -18. Q: What is 6 + 9? A: 15."),
    ("Q: What is 99 - 58? A:", " 41. Q: What is 7 + 66? A: 73. Q: What is 50 - 4? A: 46."),
    ("The engine serves", " the weights the trainer published, token for token, after every sync."),
    ("def add(a, b):", "\n    return a + b\n\nprint(add(2, 3))  # 5\nprint(add(40, 2))  # 42\n"),
)
CANARY_TOKENS = 16  # each sequence's length: 4 x 16 tokens, one forward on each side
MAX_PROMPT_TOKENS = 6  # a prompt is cut to this many: the rest of the sequence is continuation, scored

# The largest per-token logprob gap between an engine and the trainer, per dtype, past which the engine does not
# serve the version the trainer published. Between what a correct install shows and what one update moves
# (benchmarks/results/canary.json; docs/reliability.md gives both).
BOUNDS = {"float32": 1e-3, "bfloat16": 0.5}
# An engine whose canary is bit for bit the version before's, while the trainer's moved by more than this share of
# the bound, still serves that version: the check that sees a stale engine where one update moves less than the bound
STILL_FRACTION = 0.1


class CanaryError(WeightSyncError):
    """An engine's canary disagrees with the trainer's: it does not serve the weights it reports."""


def canary_sequences(tokenizer) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The canary's token sequences in `tokenizer`, and where each one's continuation starts."""
    sequences, starts = [], []
    for prompt, continuation in CANARY_TEXTS:
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"][:MAX_PROMPT_TOKENS]
        tail = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        sequences.append(tuple(head + tail)[:CANARY_TOKENS])
        starts.append(len(head))
    return tuple(sequences), tuple(starts)


def bound(dtype: str, max_gap: float | None) -> tuple[float, str]:
    """The gap allowed, and the setting it comes from (for the message that names it)."""
    if max_gap is not None:
        return max_gap, f"sync.canary.max_gap={max_gap:g}"
    if dtype not in BOUNDS:
        raise ValueError(f"no canary bound for model.dtype={dtype}: set sync.canary.max_gap (known: {list(BOUNDS)})")
    return BOUNDS[dtype], f"sync.canary.max_gap={BOUNDS[dtype]:g} (the {dtype} default)"


def gaps(engine: Sequence[float], trainer: Sequence[float]) -> tuple[float, float]:
    """The largest and the mean absolute difference between two canaries' logprobs, token by token."""
    if len(engine) != len(trainer):
        raise CanaryError(f"the engine scored {len(engine)} canary tokens, the trainer {len(trainer)}")
    diffs = [abs(a - b) for a, b in zip(engine, trainer)]
    return max(diffs), statistics.fmean(diffs)


@dataclass
class CanaryWatch:
    """Checks every engine's canary answers against the trainer's, install after install."""

    max_gap: float | None = None  # sync.canary.max_gap; None: BOUNDS by the served dtype
    trainer: Canary | None = None  # the last version's trainer canary
    engines: dict[int, tuple[int, tuple[float, ...]]] = field(default_factory=dict)  # per engine: (version, answer)

    def check(self, canary: Canary, answers: list[Sequence[float] | None], names: list[str]) -> dict[str, float]:
        """The install's canary figures for the step's metrics; raises `CanaryError` naming the first engine whose
        answer is past the bound, or did not move while the trainer's did."""
        limit, setting = bound(canary.dtype, self.max_gap)
        when = "at start, before the first evaluation" if canary.version == 0 else f"after installing v{canary.version}"
        moved = self._trainer_moved(canary)
        largest, means = 0.0, []
        for engine, (name, answer) in enumerate(zip(names, answers, strict=True)):
            if answer is None:
                raise CanaryError(f"{name} returned no canary {when}: it cannot be shown to serve v{canary.version}")
            top, mean = gaps(answer, canary.logprobs)
            if not top <= limit:  # a NaN is past every bound
                raise CanaryError(
                    f"{name} failed the weight canary {when}: its logprobs differ from trainer rank 0's by up to "
                    f"{top:.3g} (mean {mean:.3g}) on {len(answer)} tokens, past {setting}. The engine does not serve "
                    f"the weights published as v{canary.version}; docs/reliability.md (the canary) says what to check"
                )
            if moved is not None:
                self._check_moved(engine, name, answer, moved, limit, when)
            self.engines[engine] = (canary.version, tuple(answer))
            largest, means = max(largest, top), [*means, mean]
        self.trainer = canary
        figures = {"sync/canary_gap": largest, "sync/canary_gap_mean": max(means)}
        return figures | ({} if moved is None else {"sync/canary_moved": moved})

    def _trainer_moved(self, canary: Canary) -> float | None:
        """How far the trainer's canary moved since the version before (None: no version before, or the same)."""
        last = self.trainer
        if last is None or last.version >= canary.version or last.sequences != canary.sequences:
            return None
        return gaps(canary.logprobs, last.logprobs)[0]

    def _check_moved(
        self, engine: int, name: str, answer: Sequence[float], moved: float | None, limit: float, when: str
    ) -> None:
        """An engine that answers bit for bit as it did for the version before, while the trainer's canary moved,
        still serves that version (a gap under the bound cannot show it where one update moves less than the bound)."""
        version, before = self.engines.get(engine, (None, None))
        # a tenth of the bound: far above what rounding alone moves (the figures in docs/reliability.md), so that
        # a change too small to reach an engine's own rounding never reads as a stale engine
        if moved > limit * STILL_FRACTION and version == self.trainer.version and tuple(answer) == before:
            raise CanaryError(
                f"{name} failed the weight canary {when}: its canary is bit for bit the one it gave for v{version}, "
                f"while trainer rank 0's moved by up to {moved:.3g}. The engine still serves v{version}; "
                "docs/reliability.md (the canary) says what to check"
            )
