"""The rollout record: which samples a run records, and what a recorded row holds beside verl's fields
(`rollouts.dump_rows`). rl_tpu/outputs/rollout_log.py writes the files; rl_tpu/outputs/inspect/ makes the page.

Every run records a share of its samples (`trainer.rollout_data_every`, one prompt group in 8 by default, every group
where `trainer.rollout_data_dir` is set: verl's dump), into `trainer.rollout_data_dir` or `<run folder>/rollouts`:
each step's recorded training samples in `<step>.jsonl`, each evaluation's greedy samples of the same share of held-out
prompts in `eval/<step>.jsonl`. A prompt is recorded when its row in the data file is a multiple of the share, so the
same held-out prompts are recorded at every evaluation, and a training prompt drawn again is recorded again.

A training row adds: `split` ("train"), `group` (the prompt's group in the step), `output_pieces` (each completion
token's text), `loss_mask` (1: the token is in the loss), `logprobs` (the engine's), `trainer_logprobs` and `entropy`
(the trainer's, from the update's first epoch; absent for rows the update skipped, `trainer.skip_zero_advantage_rows`),
`advantages` (per token), `reward_parts` (each reward's own score), `finish_reason`, `truncated` (an episode's cut:
"max_turns" or "max_tokens") and each environment turn's `tools` ({"name", "status"} of its calls). An evaluation row
has `split` "eval" and no loss mask, logprobs, entropy or advantages (greedy, not trained on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rl_tpu.config import TrainerConfig
from rl_tpu.controller.actors import ActorHandles
from rl_tpu.controller.rollouts import GradedBatch, dump_rows
from rl_tpu.data.datasets import Example
from rl_tpu.outputs import rollout_log
from rl_tpu.records import Rollout, TrainBatch

DEFAULT_EVERY = 8  # one prompt group in this many, unless rollout_data_dir asks for verl's whole dump
LOGPROB_DIGITS, FIGURE_DIGITS = 6, 4  # decimals kept: a logprob gap of 1e-6 still shows


def share(trainer: TrainerConfig) -> int:
    """One prompt group in how many is recorded (0: none)."""
    if trainer.rollout_data_every is not None:
        return trainer.rollout_data_every
    return 1 if trainer.rollout_data_dir else DEFAULT_EVERY


def is_recorded(example: Example, every: int) -> bool:
    return every > 0 and example.row % every == 0


def recorded_numbers(graded: GradedBatch, every: int) -> list[int] | None:
    """Per rollout, its number among the recorded ones (-1: not recorded), as `TrainBatch.recorded`; None: none is."""
    numbers, count = [], 0
    for rollout in graded.rollouts:
        recorded = is_recorded(graded.prompts[rollout.group], every)
        numbers.append(count if recorded else -1)
        count += recorded
    return numbers if count else None


@dataclass
class Trained:
    """What a step trained on: the graded groups, the batch the trainer got (advantages, loss mask, recorded rows),
    and the trainer's per-token figures of the recorded rows (`ActorHandles.recorded_figures`)."""

    graded: GradedBatch
    batch: TrainBatch
    figures: dict[int, dict[str, list[float]]]


def rounded(values: list[float], digits: int) -> list[float]:
    return [round(v, digits) for v in values]


def with_tools(turns: list[dict], rollout: Rollout) -> list[dict]:
    """The dumped turns, each environment turn with its tool calls' names and statuses (in order: a tool turn whose
    result did not fit has no environment span, and is the last)."""
    tool_turns = iter(rollout.episode.tool_turns)
    return [{**turn, "tools": next(tool_turns, [])} if turn["role"] == "environment" else turn for turn in turns]


class Recorder:
    """Writes a run's rollout record (the module's docstring says what and where)."""

    def __init__(self, trainer: TrainerConfig, run_dir: Path, tokenizer):
        self.every, self.tokenizer = share(trainer), tokenizer
        self.folder = rollout_log.record_folder(run_dir, trainer.rollout_data_dir)
        self.pieces: dict[int, str] = {}  # a token's text, decoded once
        self.seconds = 0.0  # spent recording since the last `take_seconds`

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        """The seconds the record took since the last call (`time/record_s`: a step's, and its evaluation's)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def mark(self, graded: GradedBatch, batch: TrainBatch) -> TrainBatch:
        """The batch with its recorded rows marked, so that the trainer keeps their figures."""
        return dataclasses.replace(batch, recorded=recorded_numbers(graded, self.every))

    def take_figures(self, actors: ActorHandles, batch: TrainBatch) -> dict[int, dict[str, list[float]]]:
        """The trainer's figures of the batch's recorded rows, after its update (none recorded: no call)."""
        if batch.recorded is None:
            return {}
        with self.timed():
            return actors.recorded_figures()

    def write_train(self, step: int, trained: Trained) -> None:
        if self.every:
            with self.timed():
                self._write_train(step, trained)

    def write_eval(self, step: int, greedy: GradedBatch) -> None:
        """The evaluation's greedy samples of the recorded held-out prompts."""
        if self.every:
            with self.timed():
                self._write_eval(step, greedy)

    def _write_train(self, step: int, trained: Trained) -> None:
        graded, batch = trained.graded, trained.batch
        positions = [i for i, number in enumerate(batch.recorded or []) if number >= 0]
        taken = GradedBatch(graded.prompts, [graded.rollouts[i] for i in positions], graded.grades.take(positions))
        rows = []
        for number, (i, row) in enumerate(zip(positions, self._rows(taken))):
            rollout, figures = graded.rollouts[i], trained.figures.get(number, {})
            mask = rollout.model_mask or [1] * len(rollout.completion_ids)
            row.update(
                split="train",
                loss_mask=[int(m and batch.in_loss(i)) for m in mask],
                logprobs=rounded(rollout.logprobs, LOGPROB_DIGITS),
                advantages=rounded(batch.advantages[i], FIGURE_DIGITS),
            )
            if figures:
                row["trainer_logprobs"] = rounded(figures["logprobs"], LOGPROB_DIGITS)
                row["entropy"] = rounded(figures["entropy"], FIGURE_DIGITS)
            rows.append(row)
        rollout_log.write_step(self.folder, step, rows)

    def _write_eval(self, step: int, greedy: GradedBatch) -> None:
        positions = [i for i, r in enumerate(greedy.rollouts) if is_recorded(greedy.prompts[r.group], self.every)]
        taken = GradedBatch(greedy.prompts, [greedy.rollouts[i] for i in positions], greedy.grades.take(positions))
        rows = [{**row, "split": "eval"} for row in self._rows(taken)]
        rollout_log.write_step(self.folder / rollout_log.EVAL_FOLDER, step, rows)

    def _rows(self, graded: GradedBatch) -> list[dict]:
        """verl's fields and those every recorded row has."""
        rows = dump_rows(graded, self.tokenizer)
        for i, (rollout, row) in enumerate(zip(graded.rollouts, rows)):
            row.update(
                group=rollout.group,
                output_pieces=[self._piece(token) for token in rollout.completion_ids],
                reward_parts={name: values[i] for name, values in graded.grades.components.items()},
                finish_reason=rollout.finish_reason,
            )
            if rollout.episode is not None:
                row.update(truncated=rollout.episode.truncated, turns=with_tools(row["turns"], rollout))
        return rows

    def _piece(self, token: int) -> str:
        if token not in self.pieces:
            self.pieces[token] = self.tokenizer.decode([token])
        return self.pieces[token]
