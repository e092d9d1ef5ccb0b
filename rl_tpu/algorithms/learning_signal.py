"""The learning signal: one owner for what turns a step's graded rollouts into the `TrainBatch` the trainer learns.

`LearningSignal`, built from the config, applies in this order:
- the episodes' reward (`episode.reward`): the reward plugin's grade, the tools' rewards, or their sum;
- DAPO's soft overlong penalty (`reward.overlong_buffer`): completions that reach into the last `len` tokens of
  `sampler.response_length` lose reward in proportion, as verl's DAPO reward manager computes it. An episode's
  length is its model tokens (tool results are not the model's verbosity), against `episode.max_tokens`;
- dynamic sampling (`algorithm.filter_groups`): a group whose rewards are all equal has zero advantage under
  group-normalised estimators and teaches nothing, so it is dropped and more prompts are generated until the batch
  holds `data.train_batch_size` groups that vary;
- the rollouts' outcomes (`algorithm.outcomes`, rl_tpu/algorithms/outcomes.py): a row whose outcome's policy is
  mask, or whose group's is fail_group, does not count: out of the loss and of the statistics of the advantages
  (and of dynamic sampling's judgement of a group's variation);
- overlong filtering (`algorithm.overlong_filter`): truncated completions stay in their group's statistics but are
  left out of the loss;
- the KL in the reward (`algorithm.use_kl_in_reward`, `kl_reward`): the trainer holds the reference model, so the
  controller passes its per-token KL as a callable;
- the advantages (`core.advantages`; an episode's on its model tokens, `core.on_model_tokens`), of the rows that
  count; the others get 0.
The controller grades (it holds the grader) and calls `score`, `select` and `train_batch`
(rl_tpu/controller/step.py). This module reads the graded rollouts through the `Graded` protocol: the grader's
`Grades` and the controller's `GradedBatch` sit above this layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, TypeVar

from rl_tpu.algorithms import core, outcomes
from rl_tpu.algorithms.kl_reward import KLInReward
from rl_tpu.config import AlgorithmConfig, FilterGroupsConfig, RunConfig
from rl_tpu.config.reward import OverlongBufferConfig
from rl_tpu.records import Rollout, TrainBatch


class Scores(Protocol):
    """A batch's grades as the signal reads them (`rl_tpu.grader.grader.Grades`, a dataclass), in rollout order."""

    scores: list[float]
    components: dict[str, list[float]]  # each reward's own score


G = TypeVar("G", bound="Graded")
S = TypeVar("S", bound=Scores)


class Graded(Protocol):
    """Graded rollouts in groups (`rl_tpu.controller.rollouts.GradedBatch`): `rollout.group` numbers the groups."""

    rollouts: list[Rollout]
    grades: Scores

    def groups(self) -> dict[int, list[int]]: ...

    def take_groups(self: G, groups: list[int]) -> G: ...


def with_tool_rewards(grades: S, rollouts: list[Rollout], source: str) -> S:
    """The episodes' scores by `episode.reward`: the plugin's (as graded), the tools' rewards, or their sum."""
    if source == "plugin" or not rollouts or rollouts[0].episode is None:
        return grades
    tools = [r.episode.tool_reward for r in rollouts]
    scores = tools if source == "tools" else [s + t for s, t in zip(grades.scores, tools)]
    return dataclasses.replace(grades, scores=scores, components={**grades.components, "tools": tools})


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


def fill_with_varied_groups(
    generated: G, target: int, metric: str | None, last_try: bool, counts: list[bool] | None = None
) -> tuple[G | None, int]:
    """`target` groups whose values (a named reward component, or the score) vary over their rows that count
    (`counts`, by the rollouts' outcomes; None: all), the earliest first; None while there are fewer and more may
    come.

    On the last try, groups without variation fill what is missing (their group-normalised advantage is
    zero, so they add tokens but no gradient), keeping the batch's size. Returns the batch and how many
    groups in it vary."""
    values = generated.grades.scores if metric is None else generated.grades.components[metric]
    members = generated.groups()
    counts = counts or [True] * len(values)
    varied = [g for g, rows in members.items() if len({values[i] for i in rows if counts[i]}) > 1]
    if len(varied) < target and not last_try:
        return None, len(varied)
    chosen, varying = varied[:target], set(varied)
    chosen += [g for g in members if g not in varying][: target - len(chosen)]
    return generated.take_groups(sorted(chosen)), min(len(varied), target)


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


class LearningSignal:
    """A run's way from grades to the trained batch (the module's docstring lists its parts, in order). It keeps
    the KL controller's coefficient across steps (`kl_coef`, saved with each checkpoint)."""

    def __init__(self, cfg: RunConfig, kl_coef: float | None = None):
        """`kl_coef`: the KL controller's coefficient a checkpoint saved (None: `algorithm.kl_ctrl.kl_coef`)."""
        self.cfg = cfg
        self.kl = KLInReward(cfg.algorithm, kl_coef) if cfg.algorithm.use_kl_in_reward else None

    @property
    def kl_coef(self) -> float | None:
        """The KL controller's coefficient now (None: the reward holds no KL)."""
        return None if self.kl is None else self.kl.coef

    def score(self, grades: S, rollouts: list[Rollout]) -> S:
        """One generation batch's rewards from its grades: the episodes' reward source, then the overlong penalty."""
        grades = with_tool_rewards(grades, rollouts, self.cfg.episode.reward)
        lengths = [r.model_tokens() for r in rollouts]
        penalties = overlong_penalties(lengths, self.cfg.completion_tokens, self.cfg.reward.overlong_buffer)
        return dataclasses.replace(grades, scores=[s + p for s, p in zip(grades.scores, penalties)])

    def select(self, generated: G, batches: int) -> tuple[G | None, int | None]:
        """What a step trains on of the groups generated so far, in `batches` generation batches: all of them, or with
        dynamic sampling `data.train_batch_size` groups that vary (None while another batch may come), and how
        many of them vary (None without dynamic sampling)."""
        groups = self.cfg.algorithm.filter_groups
        if not groups.enable:
            return generated, None
        last_try = batches >= groups.max_num_gen_batches
        counts = outcomes.counted(generated.rollouts, self.cfg.algorithm.outcomes)
        return fill_with_varied_groups(generated, self.cfg.data.train_batch_size, groups.metric, last_try, counts)

    def train_batch(
        self, graded: Graded, token_kl: Callable[[TrainBatch], list[list[float]]]
    ) -> tuple[TrainBatch, dict[str, float]]:
        """The batch the trainer learns from, advantages in, and the KL in the reward's metrics. `token_kl`: each
        completion token's KL to the reference model (the trainer computes it), called only when the reward holds
        the KL, on the batch before its advantages."""
        rollouts, cfg = graded.rollouts, self.cfg
        counts = outcomes.counted(rollouts, cfg.algorithm.outcomes)
        lengths = [len(r.completion_ids) for r in rollouts]
        masks = [r.model_mask for r in rollouts] if cfg.episode.enable else None  # tool results: out of the loss
        batch = TrainBatch(
            prompt_ids=[r.prompt_ids for r in rollouts],
            completion_ids=[r.completion_ids for r in rollouts],
            sampler_logprobs=[r.logprobs for r in rollouts],
            advantages=[[0.0] * n for n in lengths],
            temperature=cfg.sampler.temperature,
            rollout_is=core.rollout_is_level(cfg.actor, cfg.trainer.is_async),
            rollout_is_threshold=cfg.actor.rollout_is_threshold,
            loss_mask=outcomes.loss_mask(rollouts, counts, cfg.algorithm.overlong_filter),
            model_masks=masks,
        )
        penalties, metrics = self.kl.penalties(token_kl(batch), masks) if self.kl else (None, {})
        advantages = counted_advantages(graded, counts, cfg.algorithm, penalties, masks)
        metrics = {**metrics, **outcomes.batch_metrics(rollouts, counts)}
        return dataclasses.replace(batch, advantages=advantages), metrics


def counted_advantages(
    graded: Graded,
    counts: list[bool],
    algorithm: AlgorithmConfig,
    penalties: list[list[float]] | None,
    masks: list[list[int]] | None,
) -> list[list[float]]:
    """The advantages of the rows that count, computed as if the others had not been generated (every estimator's
    statistics, a group's or the batch's, are of the rows that count); the others get 0."""
    rows = [i for i, c in enumerate(counts) if c]

    def only(values: list | None) -> list | None:
        return None if values is None else [values[i] for i in rows]

    lengths = [len(r.completion_ids) for r in graded.rollouts]
    advantages = [[0.0] * n for n in lengths]
    if not rows:  # no row counts: nothing to normalise, nothing trained on
        return advantages
    components = {name: only(values) for name, values in graded.grades.components.items()}
    groups = [r.group for r in graded.rollouts]
    computed = core.advantages(
        only(graded.grades.scores), only(groups), only(lengths), algorithm, components, only(penalties), only(masks)
    )
    for i, values in zip(rows, computed, strict=True):
        advantages[i] = values
    return advantages
