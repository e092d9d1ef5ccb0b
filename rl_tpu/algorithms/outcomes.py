"""Typed rollout outcomes: which rows of a batch count, by how each rollout ended (`Rollout.outcome`).

Every rollout carries one `Outcome` (rl_tpu/records.py), set where it arises: the episode loop sets `lost`,
`timeout` and `tool_failure` (rl_tpu/episodes/loop.py), the controller sets `reward_error` and `timeout` from the
grader's failures (`Grades.outcomes`), and a completion or episode cut at a limit is `truncated`. A rollout that met
several carries the first in `Outcome`'s order. `algorithm.outcomes.<kind>` (`OutcomesConfig`) decides:

- `retry` happens before the batch is built: the episode loop plays an episode again in fresh tool instances (its
  own seed, so the same draws where the engine is deterministic), the grader grades a sample again; a rollout still
  of a retried kind here has used its retries, and `algorithm.outcomes.fallback` decides it;
- `mask`: the row is out of the loss and out of the statistics its advantage is computed with (its group's mean and
  standard deviation, a batch-wide whitening): the other rows get what they would without it;
- `fail_group`: every row of its group is, as if the group had not been generated;
- `zero`: the row is trained on with the reward it got (a failed reward scores 0.0).

A row that does not count gets advantage 0 and is out of the loss, so a group none of whose rows count is never
trained on. `algorithm.overlong_filter` (DAPO) is the one other way out of the loss: truncated rows stay in their
group's statistics, so it is refused beside any `algorithm.outcomes.truncated` but zero.
"""

from __future__ import annotations

from collections import Counter

from rl_tpu.config import AlgorithmConfig, OutcomePolicy, OutcomesConfig
from rl_tpu.records import Outcome, Rollout


def validate(algorithm: AlgorithmConfig) -> None:
    truncated = algorithm.outcomes.truncated
    if algorithm.overlong_filter and truncated != OutcomePolicy.zero:
        raise ValueError(
            f"algorithm.overlong_filter=true with algorithm.outcomes.truncated={truncated}: overlong filtering "
            "already decides truncated rollouts (out of the loss, in their group's statistics, as DAPO does); set "
            "one of them: algorithm.overlong_filter=false, or algorithm.outcomes.truncated=zero"
        )


def counted(rollouts: list[Rollout], cfg: OutcomesConfig) -> list[bool]:
    """Per row, whether it counts: in the loss and in the statistics of its advantage. `mask` leaves its row out,
    `fail_group` every row of its group."""
    policies = [cfg.policy(r.outcome) for r in rollouts]
    failed = {r.group for r, p in zip(rollouts, policies) if p == OutcomePolicy.fail_group}
    return [p != OutcomePolicy.mask and r.group not in failed for r, p in zip(rollouts, policies)]


def loss_mask(rollouts: list[Rollout], counts: list[bool], overlong_filter: bool) -> list[bool] | None:
    """Per sequence, whether it is in the loss (None: all are): the rows that count, less the truncated ones under
    overlong filtering."""
    keep = [c and not (overlong_filter and r.finish_reason == "length") for r, c in zip(rollouts, counts)]
    return keep if overlong_filter or not all(keep) else None


def batch_metrics(rollouts: list[Rollout], counts: list[bool]) -> dict[str, float]:
    """The trained batch's rows that do not count by their outcome's policy, and its groups none of whose rows
    count (never trained on)."""
    groups = {r.group for r in rollouts}
    counting = {r.group for r, c in zip(rollouts, counts) if c}
    return {"outcome/rows_out": float(counts.count(False)), "outcome/groups_out": float(len(groups - counting))}


def step_metrics(rollouts: list[Rollout], regraded: int) -> dict[str, float]:
    """How many of everything generated for a step ended each way, and the retries it took: episodes played again
    and samples graded again (`regraded`)."""
    kinds = Counter(r.outcome for r in rollouts)
    replayed = sum(r.episode.retries for r in rollouts if r.episode is not None)
    return {
        **{f"outcome/{kind}": float(kinds[kind]) for kind in Outcome},
        "outcome/retries": float(replayed + regraded),
    }
