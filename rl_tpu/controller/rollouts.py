"""The sampler's side of the loop: generation batches queued ahead, graded, and gathered into a step's batch.

Generation batches are numbered 1, 2, ... in the order the prompt stream yields them. A step takes
one, or several with dynamic sampling (`LearningSignal.select`, rl_tpu/algorithms/learning_signal.py); how many
have been taken is saved with each checkpoint, so that a resumed run draws the same prompts next.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import ActorHandles
from rl_tpu.controller.phases import Phases
from rl_tpu.data.datasets import Example, derived_seed
from rl_tpu.grader.grader import Grader, Grades, Grading, Sample
from rl_tpu.records import Rollout
from rl_tpu.sampler.engine import SamplingSettings
from rl_tpu.sampler.pool import PendingRollouts


@dataclass
class GradedBatch:
    """Prompts, their rollouts (`rollout.group` indexes `prompts`) and the rollouts' grades, in order."""

    prompts: list[Example]
    rollouts: list[Rollout]
    grades: Grades

    def groups(self) -> dict[int, list[int]]:
        """Each group's rollout positions, groups in order of their first rollout."""
        members: dict[int, list[int]] = {}
        for i, rollout in enumerate(self.rollouts):
            members.setdefault(rollout.group, []).append(i)
        return members

    @staticmethod
    def concat(parts: list["GradedBatch"]) -> "GradedBatch":
        """The batches as one: each part's groups renumbered after the previous parts' prompts."""
        prompts, rollouts, offset = [], [], 0
        for part in parts:
            prompts += part.prompts
            rollouts += [dataclasses.replace(r, group=r.group + offset) for r in part.rollouts]
            offset += len(part.prompts)
        return GradedBatch(prompts, rollouts, Grades.concat([p.grades for p in parts]))

    def take_groups(self, groups: list[int]) -> "GradedBatch":
        """These groups only, renumbered 0..len(groups)-1 in the order given."""
        members = self.groups()
        rows = [i for g in groups for i in members[g]]
        renumber = {g: k for k, g in enumerate(groups)}
        rollouts = [dataclasses.replace(self.rollouts[i], group=renumber[self.rollouts[i].group]) for i in rows]
        return GradedBatch([self.prompts[g] for g in groups], rollouts, self.grades.take(rows))


def sampling_seed(seed: int, batch: int, prompt: int) -> int:
    """The seed of one prompt's draws in one generation batch: fixed by the run's seed alone, so a resumed run
    repeats them. Without dynamic sampling the batch number is the step."""
    return derived_seed(seed, batch, prompt)


def generate_batch(actors: ActorHandles, prompts: list[Example], cfg: RunConfig, batch: int) -> PendingRollouts:
    s = cfg.sampler
    settings = SamplingSettings(s.n, s.temperature, s.top_p, s.top_k, s.response_length)
    seeds = [sampling_seed(s.seed, batch, i) for i in range(len(prompts))]
    tools_kwargs = [p.tools_kwargs for p in prompts] if cfg.episode.enable else None
    return actors.samplers.generate([p.prompt_ids for p in prompts], settings, seeds, tools_kwargs)


def grade(rollouts: list[Rollout], prompts: list[Example], tokenizer, grader: Grader) -> Grading:
    """Start grading the rollouts' answers (`Rollout.answer_ids`, decoded); the result is `Grades`, in rollout order.

    An episode's reward reads its final model turn before any tool call as `solution_str`, so that no number or
    tag a tool wrote can score; a plugin finds the whole episode in `extra_info["episode"]` (`episode_view`)."""
    samples = []
    for rollout in rollouts:
        example = prompts[rollout.group]
        text = tokenizer.decode(rollout.answer_ids(), skip_special_tokens=True)
        extra_info = example.extra_info
        if rollout.episode is not None:
            extra_info = {**extra_info, "episode": episode_view(rollout, tokenizer)}
        samples.append(Sample(example.data_source, text, example.ground_truth, extra_info))
    return grader.submit(samples)


def episode_view(rollout: Rollout, tokenizer) -> dict:
    """An episode as a reward plugin reads it: the whole completion's text, its turns in order as {"role": "model"
    or "environment" (tool results and the template's text around them), "text"}, and how it was cut short
    (`truncated`: "max_turns", "max_tokens" or None)."""
    ids = rollout.completion_ids
    return {
        "text": tokenizer.decode(ids, skip_special_tokens=True),
        "turns": [
            {"role": role, "text": tokenizer.decode(ids[start:end], skip_special_tokens=True)}
            for role, start, end in rollout.turn_spans()
        ],
        "truncated": rollout.episode.truncated,
    }


def dump_rows(batch: GradedBatch, tokenizer) -> list[dict]:
    """A step's trained samples as `trainer.rollout_data_dir` records them (rl_tpu/outputs/rollout_log.py)."""
    rows = []
    for rollout, score in zip(batch.rollouts, batch.grades.scores):
        example = batch.prompts[rollout.group]
        row = {
            "index": example.row,
            "input": tokenizer.decode(rollout.prompt_ids, skip_special_tokens=True),
            "output": tokenizer.decode(rollout.completion_ids, skip_special_tokens=True),
            "answer": tokenizer.decode(rollout.answer_ids(), skip_special_tokens=True),
            "gts": example.ground_truth,
            "score": score,
            "weight_version": rollout.weight_version,
            "outcome": str(rollout.outcome),
            "input_ids": rollout.prompt_ids,
            "output_ids": rollout.completion_ids,
        }
        if rollout.episode is not None:
            row["turns"] = [{"role": role, "start": start, "end": end} for role, start, end in rollout.turn_spans()]
        rows.append(row)
    return rows


def episode_metrics(rollouts: list[Rollout], prefix: str) -> dict[str, float]:
    """What the episodes did: turns, tool calls and failures per tool, malformed calls, environment tokens,
    truncations, time waiting for tools; and how many lost their tool instance (left out of the loss) or ended on a
    tool result that did not fit. None for single completions."""
    episodes = [r.episode for r in rollouts if r.episode is not None]
    if not episodes:
        return {}
    mean = statistics.fmean
    tools = sorted({name for e in episodes for name in e.tool_calls})
    calls = [sum(e.tool_calls.values()) for e in episodes]
    return {
        f"{prefix}/turns_mean": mean(e.turns for e in episodes),
        f"{prefix}/tool_calls_mean": mean(calls),
        f"{prefix}/tool_call_rate": mean(c > 0 for c in calls),  # episodes that called a tool at all
        f"{prefix}/malformed_calls_mean": mean(e.malformed_calls for e in episodes),
        f"{prefix}/tool_failures_mean": mean(sum(e.tool_failures.values()) for e in episodes),
        f"{prefix}/env_tokens_mean": mean(e.env_tokens for e in episodes),
        f"{prefix}/length_mean": mean(len(r.completion_ids) for r in rollouts),
        f"{prefix}/truncated_max_turns": mean(e.truncated == "max_turns" for e in episodes),
        f"{prefix}/truncated_max_tokens": mean(e.truncated == "max_tokens" for e in episodes),
        f"{prefix}/tool_wait_s_mean": mean(e.tool_s for e in episodes),
        f"{prefix}/lost_instances": float(sum(e.lost_instance is not None for e in episodes)),
        f"{prefix}/tool_results_dropped": float(sum(e.dropped_result_tokens > 0 for e in episodes)),
        **{f"{prefix}/tool/{name}/calls": float(sum(e.tool_calls.get(name, 0) for e in episodes)) for name in tools},
        **{
            f"{prefix}/tool/{name}/failures": float(sum(e.tool_failures.get(name, 0) for e in episodes))
            for name in tools
        },
    }


@dataclass
class GeneratedRollouts:
    """A generation batch already made: what `PendingRollouts` gives once waited for (a checkpoint saves these)."""

    rollouts: list[Rollout]
    engine_shares: dict[str, float]

    def result(self, timeout_s: float) -> list[Rollout]:
        return self.rollouts

    def shares(self) -> dict[str, float]:
        return self.engine_shares

    def to_dict(self) -> dict:
        return {"rollouts": [dataclasses.asdict(r) for r in self.rollouts], "shares": self.engine_shares}

    @classmethod
    def from_dict(cls, saved: dict) -> GeneratedRollouts:
        return cls([Rollout.from_dict(r) for r in saved["rollouts"]], saved["shares"])


class RolloutQueue:
    """Generation batches queued on the sampler in order, `trainer.max_staleness` steps ahead at most.

    The sampler runs its calls in order, so a batch queued after new weights arrive is generated with them
    or newer ones. A checkpoint saves the batches queued ahead, generated (`generated_ahead`), and a resumed
    run trains on them as they were: in async mode they came from older weights than the checkpoint's, which a
    run that never stopped used too."""

    def __init__(
        self,
        actors: ActorHandles,
        prompt_batches: Iterator[list[Example]],
        cfg: RunConfig,
        taken: int,
        generated: list[GeneratedRollouts] = (),
    ):
        """`taken`: generation batches the steps before this one used (the prompt stream is past them);
        `generated`: the batches queued after them, already generated (from the checkpoint resumed)."""
        self.actors, self.prompt_batches, self.cfg = actors, prompt_batches, cfg
        self.pending: deque[tuple[list[Example], PendingRollouts | GeneratedRollouts]] = deque()
        self.taken = taken
        for batch in generated:  # their prompts are the stream's next ones, as when they were queued
            self.pending.append((next(self.prompt_batches), batch))

    def generated_ahead(self, timeout_s: float) -> list[GeneratedRollouts]:
        """Wait for every batch queued ahead; they stay queued, generated. Returns them, in order."""
        self.pending = deque(
            (
                prompts,
                batch
                if isinstance(batch, GeneratedRollouts)
                else GeneratedRollouts(batch.result(timeout_s), batch.shares()),
            )
            for prompts, batch in self.pending
        )
        return [batch for _, batch in self.pending]

    def _queue_one(self) -> None:
        number = self.taken + len(self.pending) + 1  # the batches taken, then those waiting, come before it
        prompts = next(self.prompt_batches)
        self.pending.append((prompts, generate_batch(self.actors, prompts, self.cfg, number)))

    def fill_after(self, step: int) -> None:
        """With `step` trained and its weights in the sampler, keep `max_staleness + 1` batches queued (fewer near
        the end: one per step left)."""
        ahead = min(self.cfg.trainer.max_staleness + 1, self.cfg.trainer.total_steps - step)
        while len(self.pending) < ahead:
            self._queue_one()

    def pop(self, step: int) -> tuple[list[Example], PendingRollouts | GeneratedRollouts]:
        """The next batch for `step` (queued now if none is)."""
        self.fill_after(step - 1)
        if not self.pending:
            self._queue_one()
        self.taken += 1
        return self.pending.popleft()


@dataclass
class StepRollouts:
    """What a step trains on, and everything generated for it."""

    batch: GradedBatch  # the groups the update uses
    generated: GradedBatch  # every group generated for the step (the reward metrics describe these)
    gen_batches: int  # generation batches taken for the step
    shares: dict[str, float]  # each engine's share of the first batch
    varied_groups: int | None  # dynamic sampling: groups of the batch whose rewards vary

    def metrics(self) -> dict[str, float]:
        out = {"data/gen_batches": float(self.gen_batches), "data/groups_generated": float(len(self.generated.prompts))}
        if self.varied_groups is not None:
            out["data/varied_groups"] = float(self.varied_groups)
        return out


def check_versions(step: int, rollouts: list[Rollout], cfg: RunConfig) -> None:
    allowed = range(max(step - 1 - cfg.trainer.max_staleness, 0), step)
    outside = {r.weight_version for r in rollouts} - set(allowed)
    if outside:
        raise RuntimeError(
            f"step {step}: rollouts from weight versions {sorted(outside)}, allowed {allowed.start} to "
            f"{step - 1} (trainer.max_staleness={cfg.trainer.max_staleness})"
        )


def next_graded(
    step: int, queue: RolloutQueue, tokenizer, grader: Grader, signal: LearningSignal, phases: Phases
) -> tuple[GradedBatch, dict[str, float]]:
    """One generation batch, waited for (phase `generate`), checked, graded and scored (phase `grade`)."""
    with phases("generate"):
        prompts, pending = queue.pop(step)
        rollouts: list[Rollout] = pending.result(queue.cfg.ray.call_timeout_s)
        check_versions(step, rollouts, queue.cfg)
    with phases("grade"):
        grades = signal.score(grade(rollouts, prompts, tokenizer, grader).result(), rollouts)
        rollouts = [r.with_outcome(kind) for r, kind in zip(rollouts, grades.outcomes(), strict=True)]
    return GradedBatch(prompts, rollouts, grades), pending.shares()


def collect(
    step: int, queue: RolloutQueue, tokenizer, grader: Grader, signal: LearningSignal, phases: Phases
) -> StepRollouts:
    """The step's rollouts: one generation batch, or with `algorithm.filter_groups` as many as it takes (up to
    `max_num_gen_batches`) to fill the batch with groups whose rewards vary (`LearningSignal.select`)."""
    parts, shares = [], None
    while True:
        part, part_shares = next_graded(step, queue, tokenizer, grader, signal, phases)
        parts.append(part)
        shares = shares or part_shares
        generated = GradedBatch.concat(parts)
        batch, varied = signal.select(generated, len(parts))
        if batch is not None:
            return StepRollouts(batch, generated, len(parts), shares, varied)
