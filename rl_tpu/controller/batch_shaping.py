"""What becomes of a step's graded rollouts before the advantages: DAPO's batch shaping.

- Dynamic sampling (`algorithm.filter_groups`): a group whose rewards are all equal has zero
  advantage under group-normalised estimators and teaches nothing, so it is dropped and more
  prompts are generated until the batch holds `data.train_batch_size` groups that vary.
- The soft overlong penalty (`reward.overlong_buffer`): completions that reach into the last
  `len` tokens of `sampler.response_length` lose reward in proportion, as verl's DAPO reward
  manager computes it. An episode's length is its model tokens (tool results are not the
  model's verbosity), against `episode.max_tokens`.
- Overlong filtering (`algorithm.overlong_filter`): truncated completions stay in their group's
  statistics but are left out of the loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_tpu.config import FilterGroupsConfig
from rl_tpu.config.reward import OverlongBufferConfig
from rl_tpu.data.datasets import Example
from rl_tpu.grader.grader import Grades
from rl_tpu.records import Rollout


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


def group_values(batch: GradedBatch, metric: str | None) -> list[float]:
    """What must vary within a group: a named reward component, or the (weighted, shaped) score."""
    return batch.grades.scores if metric is None else batch.grades.components[metric]


def fill_with_varied_groups(
    generated: GradedBatch, target: int, metric: str | None, last_try: bool
) -> tuple[GradedBatch | None, int]:
    """`target` groups whose values vary, the earliest first; None while there are fewer and more may come.

    On the last try, groups without variation fill what is missing (their group-normalised advantage is
    zero, so they add tokens but no gradient), keeping the batch's size. Returns the batch and how many
    groups in it vary."""
    values = group_values(generated, metric)
    members = generated.groups()
    varied = [g for g, rows in members.items() if len({values[i] for i in rows}) > 1]
    if len(varied) < target and not last_try:
        return None, len(varied)
    chosen, varying = varied[:target], set(varied)
    chosen += [g for g in members if g not in varying][: target - len(chosen)]
    return generated.take_groups(sorted(chosen)), min(len(varied), target)


def overlong_penalties(lengths: list[int], max_length: int, buffer: OverlongBufferConfig) -> list[float]:
    """DAPO's soft overlong punishment of each completion: 0 up to max_length - buffer.len, then falling
    linearly to -penalty_factor at max_length (verl's DAPO reward manager). `lengths`: the model's tokens
    (`Rollout.model_tokens`)."""
    if not buffer.enable:
        return [0.0] * len(lengths)
    size = buffer_length(buffer, max_length)
    expected = max_length - size
    return [min(-(n - expected) / size * buffer.penalty_factor, 0.0) for n in lengths]


def buffer_length(buffer: OverlongBufferConfig, max_length: int) -> int:
    return buffer.len if buffer.len is not None else max(1, max_length // 5)


def validate(
    groups: FilterGroupsConfig, reward_names: list[str], buffer: OverlongBufferConfig, max_length: int
) -> None:
    if groups.metric is not None and groups.metric not in reward_names:
        raise ValueError(
            f"algorithm.filter_groups.metric={groups.metric!r}: allowed values are null (the "
            f"score) or one of this run's rewards, {', '.join(reward_names)}"
        )
    if groups.max_num_gen_batches < 1:
        raise ValueError(f"algorithm.filter_groups.max_num_gen_batches={groups.max_num_gen_batches} must be >= 1")
    if buffer.enable and not 0 < buffer_length(buffer, max_length) <= max_length:
        raise ValueError(f"reward.overlong_buffer.len={buffer.len} must be in 1..sampler.response_length={max_length}")
