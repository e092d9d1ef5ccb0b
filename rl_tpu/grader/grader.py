"""The grader: scores completions with reward functions in a pool of worker processes.

Rewards are verl-signature functions (built-ins from `rewards/`, or a plugin file). They run
in `reward.num_workers` processes (`rl_tpu.grader.processes`), so a plugin that hangs, crashes
or leaks cannot take the run down: a sample whose reward runs past `reward.timeout_s` has
its worker killed and replaced; a sample whose reward raised, timed out, killed its worker or
returned something that is not a finite number scores 0.0, is counted, and is logged with
its index and the error; its rollout's outcome is `timeout` or `reward_error` (`Grades.outcomes`), which
`algorithm.outcomes` decides. Where that says retry, the failed samples are graded again, up to
`algorithm.outcomes.max_retries` times (a plugin that fails for a while, as a remote judge may, then scores). Only
when more than `reward.max_failure_rate` of one batch still fails does the run stop, with `RewardError` naming the
plugin and the first traceback.

`Grader.submit` returns a `Grading`, so the controller can grade while the sampler generates; its `result`
waits no longer than the workers may take for that many samples, then names the rewards it waited for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rewards import BUILTIN_REWARDS
from rl_tpu.cluster.worker_pool import WorkerLimits, WorkerPool, worker_environment
from rl_tpu.config import CustomRewardConfig, OutcomesConfig, RewardConfig
from rl_tpu.grader.processes import RewardSource, Sample
from rl_tpu.records import Outcome

log = logging.getLogger(__name__)

CUSTOM = "custom"  # the key of the plugin in reward.combine and in metrics
# a worker's start-up (spawn, imports, loading the plugin), allowed per sample on top of reward.timeout_s
WORKER_START_S = 30.0


class RewardError(RuntimeError):
    """Too many samples of a batch could not be scored, or a reward function could not be loaded."""


def custom_reward(reward: RewardConfig, alias: CustomRewardConfig) -> CustomRewardConfig | None:
    """The plugin set by `reward.custom` or by verl's `custom_reward_function` key (not both)."""
    if reward.custom.path and alias.path and (reward.custom.path, reward.custom.name) != (alias.path, alias.name):
        raise ValueError(
            f"reward.custom ({reward.custom.path}:{reward.custom.name}) and custom_reward_function "
            f"({alias.path}:{alias.name}) name different plugins; set only one of them"
        )
    if alias.path and not reward.custom.path:  # the alias names the file; kwargs and batched stay reward.custom's
        return dataclasses.replace(reward.custom, path=alias.path, name=alias.name)
    return reward.custom if reward.custom.path else None


def reward_sources(reward: RewardConfig, alias: CustomRewardConfig) -> list[RewardSource]:
    """What each worker loads, with weights; the first source is the primary (eval/accuracy) reward."""
    plugin = custom_reward(reward, alias)
    primary = CUSTOM if plugin else reward.name
    weights = dict(reward.combine or {}) or {primary: 1.0}
    allowed = (*BUILTIN_REWARDS, CUSTOM)
    for name in weights:
        if name not in allowed:
            raise ValueError(
                f"reward name {name!r}: allowed values are {', '.join(allowed)}"
                + ("" if name != CUSTOM else " (with reward.custom.path set)")
            )
    if CUSTOM in weights and plugin is None:
        raise ValueError(
            "reward.combine names 'custom' but no plugin is set: set reward.custom.path "
            "(or custom_reward_function.path)"
        )
    if primary not in weights:
        raise ValueError(
            f"reward.combine={dict(weights)} must include the primary reward {primary!r} "
            "(reward.name, or 'custom' when a plugin is set): it defines eval/accuracy"
        )
    names = [primary] + [name for name in weights if name != primary]
    return [_source(name, weights[name], plugin) for name in names]


def _source(name: str, weight: float, plugin: CustomRewardConfig | None) -> RewardSource:
    if name != CUSTOM:
        return RewardSource(name, "compute_score", module=f"rewards.{name}", weight=weight)
    path = Path(plugin.path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"reward plugin file {plugin.path} (reward.custom.path) does not exist")
    return RewardSource(
        CUSTOM,
        plugin.name,
        path=str(path),
        weight=weight,
        kwargs=tuple(sorted(dict(plugin.kwargs).items())),
        batched=plugin.batched,
    )


@dataclass
class Failure:
    index: int  # position of the sample in the graded batch
    reward: str
    kind: str  # exception | invalid | timeout | crash | cancelled (the batch was stopped)
    message: str  # the traceback, or what was wrong

    @property
    def outcome(self) -> Outcome:
        return failure_outcome(self.kind)


def failure_outcome(kind: str) -> Outcome:
    """What a failed grade makes of its rollout's outcome: a deadline is a timeout, the rest the reward's error."""
    return Outcome.timeout if kind == "timeout" else Outcome.reward_error


@dataclass
class Grades:
    """Scores of one batch, in sample order; failed samples score 0.0."""

    scores: list[float]
    components: dict[str, list[float]]  # each reward's own score (before weighting)
    extras: dict[str, list[float]]  # numeric extra fields of dict results, "reward/field"
    failures: list[Failure] = field(default_factory=list)
    seconds: float = 0.0
    retries: int = 0  # samples graded again (algorithm.outcomes: retry), each time counted

    def outcomes(self) -> list[Outcome | None]:
        """Each sample's outcome by its grade: its failure's, or None where it scored."""
        failed = {f.index: f.outcome for f in self.failures}
        return [failed.get(i) for i in range(len(self.scores))]

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {f"{prefix}/{name}": statistics.fmean(values) for name, values in self.components.items()}
        out.update({f"{prefix}/extra/{key}": statistics.fmean(values) for key, values in self.extras.items()})
        out[f"{prefix}/failed"] = float(len(self.failures))
        out[f"{prefix}/timeouts"] = float(sum(f.kind == "timeout" for f in self.failures))
        return out

    @staticmethod
    def concat(parts: list["Grades"]) -> "Grades":
        """Several batches' grades as one, in order (failures renumbered)."""
        failures, offset, extras = [], 0, {}
        for part in parts:
            failures += [dataclasses.replace(f, index=f.index + offset) for f in part.failures]
            offset += len(part.scores)
            for key, values in part.extras.items():
                extras.setdefault(key, []).extend(values)
        components = {name: [v for part in parts for v in part.components[name]] for name in parts[0].components}
        return Grades(
            [v for part in parts for v in part.scores],
            components,
            extras,
            failures,
            sum(part.seconds for part in parts),
            sum(part.retries for part in parts),
        )

    def take(self, rows: list[int]) -> "Grades":
        """The scores and components of these samples (extras and failures stay with the whole batch's)."""
        return Grades(
            [self.scores[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in self.components.items()},
            {},
            [],
            self.seconds,
        )


@dataclass
class Grading:
    """A batch being graded in the background."""

    future: Future
    samples: int
    deadline_s: float  # the longest the workers may take: every sample timing out, every worker replaced
    rewards: str

    def result(self) -> Grades:
        try:
            return self.future.result(timeout=self.deadline_s)
        except TimeoutError:
            raise RewardError(
                f"reward {self.rewards}: grading {self.samples} samples gave no result within {self.deadline_s:.0f} s, "
                "the longest its workers may take (reward.timeout_s per sample over reward.num_workers, each worker "
                "replaced): the grader is stuck"
            ) from None


class Grader:
    def __init__(
        self,
        reward: RewardConfig,
        alias: CustomRewardConfig | None = None,
        log_dir: str | None = None,
        outcomes: OutcomesConfig | None = None,
    ):
        """`log_dir`: where the workers' output goes (`reward_workers.log`, each worker's capped); None: stdout.
        `outcomes`: which failures are graded again, and how often (None: none)."""
        self.outcomes = outcomes or OutcomesConfig()
        self.sources = reward_sources(reward, alias or CustomRewardConfig())
        self.weights = {s.label: s.weight for s in self.sources}
        self.primary = self.sources[0].label
        self.locations = {s.label: f"{s.path or s.module}:{s.function}" for s in self.sources}
        self.max_failure_rate = reward.max_failure_rate
        # the CPU budget matches the wall-clock one: a busy loop is stopped even if this process stalls
        limits = WorkerLimits(reward.worker_memory_mb, math.ceil(reward.timeout_s) + 1)
        self.pool = WorkerPool(
            "rl_tpu.grader.processes",
            (self.sources, limits),
            reward.num_workers or min(4, os.cpu_count() or 1),
            worker_environment(reward.pass_env),
            reward.timeout_s,
            f"reward worker for {self.describe()}",
            RewardError,
            os.path.join(log_dir, "reward_workers.log") if log_dir else None,
        )
        self.batched = self.pool.detail
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grader")  # one batch at a time, off the caller

    def describe(self) -> str:
        """The rewards by name, as logged for failures no single function can be blamed for (timeouts, crashes)."""
        return "+".join(self.weights)

    def submit(self, samples: list[Sample]) -> Grading:
        """Grade in the background; the result is `Grades` (or `RewardError`)."""
        per_worker = math.ceil(len(samples) / self.pool.size)
        deadline = per_worker * (self.pool.timeout_s + WORKER_START_S) + WORKER_START_S
        if any(self.outcomes.retried(kind) for kind in (Outcome.reward_error, Outcome.timeout)):
            deadline *= 1 + self.outcomes.max_retries  # every sample failing, every time
        return Grading(self._thread.submit(self.grade, samples), len(samples), deadline, self.describe())

    def grade(self, samples: list[Sample]) -> Grades:
        start = time.perf_counter()
        outcomes = self.pool.run(samples, self.batched, self._failed, give_up=self._give_up)
        retries = self._grade_again(samples, outcomes)
        grades = self._collect(outcomes)
        grades.seconds, grades.retries = time.perf_counter() - start, retries
        self._report(grades, samples)
        return grades

    def _failed(self, kind: str, message: str) -> tuple:
        return ("fail", self.describe(), kind, message)

    def _grade_again(self, samples: list[Sample], outcomes: list[tuple]) -> int:
        """Grade the failed samples whose outcome is set to retry again, up to `max_retries` times, in place; returns
        how many gradings that took. A batch stopped by the failure-rate stop is not (the plugin fails throughout)."""
        if any(o[0] == "fail" and o[2] == "cancelled" for o in outcomes):
            return 0
        retries = 0
        for _ in range(self.outcomes.max_retries):
            again = [
                i for i, o in enumerate(outcomes) if o[0] == "fail" and self.outcomes.retried(failure_outcome(o[2]))
            ]
            if not again:
                break
            for i, outcome in zip(again, self.pool.run([samples[i] for i in again], self.batched, self._failed)):
                outcomes[i] = outcome
            retries += len(again)
        return retries

    def close(self) -> None:
        """Stop the workers; a batch under way (a second signal while a plugin hangs) is not waited for."""
        self.pool.close()
        self._thread.shutdown(wait=False, cancel_futures=True)

    # -- results ------------------------------------------------------------------------------

    def _collect(self, outcomes: list[tuple]) -> Grades:
        scores, failures = [], []
        components = {label: [] for label in self.weights}
        extras: dict[str, list[float]] = {}
        for index, outcome in enumerate(outcomes):
            if outcome[0] == "fail":
                _, reward, kind, message = outcome
                failures.append(Failure(index, reward, kind, message))
                for values in components.values():
                    values.append(0.0)
                scores.append(0.0)
                continue
            _, scored, fields = outcome
            for label, value in scored.items():
                components[label].append(value)
            for key, value in fields.items():
                extras.setdefault(key, []).append(value)
            scores.append(sum(self.weights[label] * value for label, value in scored.items()))
        return Grades(scores, components, extras, failures)

    def _too_many(self, failures: int, samples: int) -> bool:
        return failures > self.max_failure_rate * samples

    def _give_up(self, outcomes: list) -> bool:
        """Judged as results arrive: more than `reward.max_failure_rate` of the batch failed already, or the first
        samples all failed (at least two per worker, and eight): a plugin that hangs or fails on everything stops the
        run after a few timeouts, not after the whole batch (at 512 samples, a tenth of it)."""
        answered = [o for o in outcomes if o is not None]
        failures = sum(o[0] == "fail" for o in answered)
        first_all_failed = failures == len(answered) >= max(2 * self.pool.size, 8) and self.max_failure_rate < 1.0
        return self._too_many(failures, len(outcomes)) or first_all_failed

    def _report(self, grades: Grades, samples: list[Sample]) -> None:
        cancelled = sum(f.kind == "cancelled" for f in grades.failures)
        failures = [f for f in grades.failures if f.kind != "cancelled"]
        for failure in failures:
            index = samples[failure.index].extra_info.get("index", "?")
            last_line = failure.message.strip().splitlines()[-1] if failure.message.strip() else failure.kind
            log.warning(
                "reward %s: sample %d (extra_info.index=%s) scored 0 (%s): %s",
                failure.reward,
                failure.index,
                index,
                failure.kind,
                last_line,
            )
        if cancelled and not failures:  # the pool was closed under way: the run is stopping
            reason = next(f.message for f in grades.failures if f.kind == "cancelled")
            raise RewardError(f"reward {self.describe()}: {cancelled} of {len(samples)} samples {reason}")
        if failures and (self._too_many(len(failures), len(samples)) or cancelled):
            first = failures[0]
            where = self.locations.get(first.reward, ", ".join(self.locations.values()))
            stopped = f" ({cancelled} more not scored: the batch was stopped there)" if cancelled else ""
            why = (
                f"more than reward.max_failure_rate={self.max_failure_rate:g}"
                if self._too_many(len(failures), len(samples))
                else "and no sample before them scored"
            )
            raise RewardError(
                f"reward {first.reward} ({where}): {len(failures)} of {len(samples)} samples failed to score{stopped}, "
                f"{why}; first failure (sample {first.index}, {first.kind}):\n{first.message}"
            )
