"""The weight canary: every weight version an engine installs is proved served, not only received.

Checksums prove which bytes arrived; they cannot see an install that kept the old weights, an adapter loaded but
not applied, a tied head left stale or an engine woken from sleep without its weights. So right after an engine
installs version v (and once at start, version 0, before the first evaluation) it scores a fixed canary: a few
short prompts with continuations in the run's own tokenizer (`CanaryTokens`, sent with the bundle), through the
adapter request the run's generations use (`rl_tpu/sampler/scoring.py`). Meanwhile the trainer ranks score the same
tokens under the weights they published as v (`rl_tpu/trainer/canary.py`). Once the driver has sent the next batch
(`SamplerPool.settle_canary`), `CanaryWatch` compares each engine's answer with trainer rank 0's: the gap (the
largest per-token logprob difference) must stay under a bound set by the dtype (`sync.canary.max_gap`), and an
engine's canary must move when the trainer's moved (a stale engine's is bit for bit the one it gave for the version
before). Either failing stops the run, naming the engine, the version and the gap. The figures and how the bounds
were set: docs/reliability.md.
Imports records only (the trainer, the sampler and the controller use it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Sequence

from rl_tpu.records import Canary, CanaryTokens, WeightSyncError

# (prompt, continuation): arithmetic as the math recipes ask it (an answer's digits are where such a model is least
# certain, and an update moves their logprobs most), prose and code.
CANARY_TEXTS = (
    ("Q: What is 47 + 38? A:", " 85. Q: What is 12 - 30? A: -18. Q: What is 6 + 9? A: 15."),
    ("Q: What is 99 - 58? A:", " 41. Q: What is 7 + 66? A: 73. Q: What is 50 - 4? A: 46."),
    ("The engine serves", " the weights the trainer published, token for token, after every sync."),
    ("def add(a, b):", "\n    return a + b\n\nprint(add(2, 3))  # 5\nprint(add(40, 2))  # 42\n"),
)
CANARY_TOKENS = 16  # each sequence's length: 4 x 16 tokens, one forward on each side
MAX_PROMPT_TOKENS = 6  # a prompt is cut to this many: the rest of the sequence is continuation, scored

# The largest per-token logprob gap between an engine and the trainer, per dtype, past which the engine does not
# serve the version the trainer published: several times what a correct install shows; in fp32 far under what one
# update moves, in bf16 not, where the still check below sees a stale engine (benchmarks/results/canary.json;
# docs/reliability.md gives the figures).
BOUNDS = {"float32": 2e-4, "bfloat16": 1.0}
# An engine whose canary is bit for bit the last version's, while the trainer's moved by more than this share of the
# bound, still serves that version: how a stale engine is seen where one update moves the canary less than the bound.
# Far above a change too small to reach an engine's own rounding, which must never read as a stale engine.
STILL_FRACTION = 0.05


WHAT_TO_DO = "docs/reliability.md (the weight canary) says what to check"


class CanaryError(WeightSyncError):
    """An engine's canary disagrees with the trainer's: it does not serve the weights it reports."""


def canary_tokens(tokenizer) -> CanaryTokens:
    """The canary's token sequences in `tokenizer`, and where each one's continuation starts."""
    sequences, starts = [], []
    for prompt, continuation in CANARY_TEXTS:
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"][:MAX_PROMPT_TOKENS]
        tail = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        sequences.append(tuple(head + tail)[:CANARY_TOKENS])
        starts.append(len(head))
    return CanaryTokens(tuple(sequences), tuple(starts))


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
    trainer: Canary | None = None  # the trainer's canary of the last version checked
    engines: dict[int, tuple[int, tuple[float, ...]]] = field(default_factory=dict)  # per engine: (version, answer)

    def check(self, canary: Canary, answers: list[Sequence[float] | None], names: list[str]) -> dict[str, float]:
        """The install's canary figures for the step's metrics; raises `CanaryError` naming the first engine whose
        answer is past the bound, or did not move while the trainer's did."""
        limit, setting = bound(canary.dtype, self.max_gap)
        when = "at start, before the first evaluation" if canary.version == 0 else f"after installing v{canary.version}"
        moved = self._trainer_moved(canary)
        figures = []
        for engine, (name, answer) in enumerate(zip(names, answers, strict=True)):
            if answer is None:
                raise CanaryError(f"{name} returned no canary {when}: it cannot be shown to serve v{canary.version}")
            top, mean = gaps(answer, canary.logprobs)
            gap = f"a gap of {top:.3g} (mean {mean:.3g}) to trainer rank 0's logprobs on {len(answer)} tokens"
            if not top <= limit:  # a NaN is past every bound
                why = f"{gap}, past {setting}. It does not serve the weights published as v{canary.version}"
                raise CanaryError(f"{name} failed the weight canary {when}: {why}; {WHAT_TO_DO}")
            if self._still(engine, answer, moved, limit):
                why = (
                    f"its canary is bit for bit the one it gave for v{self.trainer.version} while trainer rank 0's "
                    f"moved by up to {moved:.3g}; {gap}, under {setting}. It still serves v{self.trainer.version}"
                )
                raise CanaryError(f"{name} failed the weight canary {when}: {why}; {WHAT_TO_DO}")
            self.engines[engine] = (canary.version, tuple(answer))
            figures.append((top, mean))
        self.trainer = canary
        gap_figures = {
            "sync/canary_gap": max(f[0] for f in figures),
            "sync/canary_gap_mean": max(f[1] for f in figures),
        }
        return gap_figures | ({} if moved is None else {"sync/canary_moved": moved})

    def _trainer_moved(self, canary: Canary) -> float | None:
        """How far the trainer's canary moved since the last version checked (None: none before, or not older)."""
        last = self.trainer
        if last is None or last.version >= canary.version:
            return None
        return gaps(canary.logprobs, last.logprobs)[0]

    def _still(self, engine: int, answer: Sequence[float], moved: float | None, limit: float) -> bool:
        """Whether the engine answers bit for bit as it did for the last version checked although the trainer's
        canary moved by more than STILL_FRACTION of the bound: a stale engine that a gap under the bound hides."""
        if moved is None or not moved > limit * STILL_FRACTION:
            return False
        return self.engines.get(engine) == (self.trainer.version, tuple(answer))
