"""Typed rollout outcomes (issue 49, item 3): each kind is set by the code that produces it (a reward that raises or
times out in the real grader, a tool that raises or times out in real tool workers, a lost instance, a
truncation), and `algorithm.outcomes` decides it: `mask` gives the other rows the advantages of the batch without
the failed ones, `zero` (what main did) does not; `fail_group` leaves the group out; a group with no row that counts
is never trained on; `retry` plays an episode again in fresh instances, or grades a sample again, up to its bound,
then falls back. The episode loop's engine is a scripted stand-in, as in test_tool_failures.py."""

from __future__ import annotations

import dataclasses
import json
import random
import textwrap
from pathlib import Path

import pytest
from conftest import compose_run
from test_evaluation import Identity
from test_tool_failures import Characters, ScriptedTools
from turn_engines import BatchEngine

from rl_tpu.algorithms import outcomes
from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.config import CustomRewardConfig, OutcomesConfig, RewardConfig, RunConfig
from rl_tpu.controller.phases import Phases
from rl_tpu.controller.rollouts import GeneratedRollouts, GradedBatch, dump_rows, next_graded
from rl_tpu.data.datasets import Example
from rl_tpu.episodes.asynchronous import AsyncScheduler
from rl_tpu.episodes.loop import EpisodeLimits, EpisodeRunner, LockstepScheduler, TurnOutput
from rl_tpu.episodes.tool_worker import ToolRelease
from rl_tpu.episodes.tools import ToolBox, ToolResult, ToolSettings
from rl_tpu.grader.grader import Grader, Grades
from rl_tpu.records import EpisodeStats, Outcome, Rollout

GROUPS, N = 16, 8  # the default recipe's step: 16 prompts x 8 samples


def real_shaped(seed: int = 0) -> tuple[list[Rollout], list[float]]:
    """A step's episodes: varied lengths, tool results masked out, 0/1 rewards; none failed yet."""
    rng = random.Random(seed)
    rollouts, scores = [], []
    for group in range(GROUPS):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randint(8, 20))]
        for _ in range(N):
            mask = [1] * rng.randint(3, 12) + [0] * rng.randint(0, 6) + [1] * rng.randint(1, 10)
            ids = [rng.randrange(2, 500) for _ in mask]
            logprobs = [-0.5 if m else 0.0 for m in mask]
            rollouts.append(Rollout(prompt, ids, logprobs, 0, "stop", group, mask, EpisodeStats(turns=2)))
            scores.append(float(rng.random() < 0.4))
    return rollouts, scores


def signal_for(estimator: str = "grpo", **policies: str) -> LearningSignal:
    cfg = RunConfig()
    cfg.episode.enable, cfg.algorithm.adv_estimator = True, estimator
    cfg.algorithm.outcomes = OutcomesConfig(**policies)
    return LearningSignal(cfg)


def train(signal: LearningSignal, rollouts: list[Rollout], scores: list[float]):
    prompts = [Example([g], "src", "1", {}) for g in range(GROUPS)]
    return signal.train_batch(GradedBatch(prompts, rollouts, Grades(scores, {"acc": scores}, {})), lambda b: None)


def flat(rows) -> list[float]:
    return [a for row in rows for a in row]


def with_failures(rollouts: list[Rollout], rows: list[int], kind: str) -> list[Rollout]:
    return [dataclasses.replace(r, outcome=kind) if i in rows else r for i, r in enumerate(rollouts)]


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])  # a group's statistics, the batch's
def test_masked_failures_give_the_advantages_of_the_batch_without_them_and_zero_does_not(estimator):
    rollouts, scores = real_shaped()
    failed = sorted(random.Random(1).sample(range(len(rollouts)), len(rollouts) // 10))  # 10%: 12 of 128
    for i in failed:
        scores[i] = 0.0  # what the environment's failure left the reward to judge
    broken = with_failures(rollouts, failed, Outcome.tool_failure)
    kept = [i for i in range(len(rollouts)) if i not in failed]
    clean, _ = train(signal_for(estimator), [rollouts[i] for i in kept], [scores[i] for i in kept])

    masked, metrics = train(signal_for(estimator, tool_failure="mask"), broken, scores)
    assert flat(masked.advantages[i] for i in kept) == pytest.approx(flat(clean.advantages), abs=1e-6)
    assert all(masked.advantages[i] == [0.0] * len(rollouts[i].completion_ids) for i in failed)
    assert masked.loss_mask == [i not in failed for i in range(len(rollouts))]
    assert masked.num_seqs() == len(kept) and metrics["outcome/rows_out"] == len(failed)

    zeroed, _ = train(signal_for(estimator, tool_failure="zero"), broken, scores)  # main's way: failures score 0
    assert zeroed.loss_mask is None
    assert flat(zeroed.advantages[i] for i in kept) != pytest.approx(flat(clean.advantages), abs=1e-6)


def test_fail_group_leaves_the_whole_group_out():
    rollouts, scores = real_shaped()
    broken = with_failures(rollouts, [3 * N + 2], Outcome.reward_error)  # one sample of group 3
    batch, metrics = train(signal_for(reward_error="fail_group"), broken, scores)
    group = range(3 * N, 4 * N)
    assert [batch.in_loss(i) for i in group] == [False] * N and all(batch.in_loss(i) for i in range(3 * N))
    assert all(not any(batch.advantages[i]) for i in group)
    others = [i for i in range(len(rollouts)) if i not in group]
    clean, _ = train(signal_for(), [rollouts[i] for i in others], [scores[i] for i in others])
    assert flat(batch.advantages[i] for i in others) == pytest.approx(flat(clean.advantages), abs=1e-6)
    assert (metrics["outcome/rows_out"], metrics["outcome/groups_out"]) == (N, 1)


@pytest.mark.parametrize("policy", ["mask", "fail_group"])
def test_a_group_whose_every_sample_failed_is_never_trained_on(policy):
    rollouts, scores = real_shaped()
    broken = with_failures(rollouts, list(range(5 * N, 6 * N)), Outcome.timeout)
    batch, metrics = train(signal_for(timeout=policy), broken, scores)
    assert not any(batch.in_loss(i) for i in range(5 * N, 6 * N)) and metrics["outcome/groups_out"] == 1
    assert all(a == a for row in batch.advantages for a in row)  # no NaN from a group with no rows
    assert batch.num_seqs() == len(rollouts) - N
    everything = with_failures(rollouts, list(range(len(rollouts))), Outcome.timeout)
    none, metrics = train(signal_for(timeout=policy), everything, scores)
    assert none.num_seqs() == 0 and none.num_tokens() == 0 and metrics["outcome/groups_out"] == GROUPS
    assert all(a == 0.0 for row in none.advantages for a in row)


def test_dynamic_sampling_judges_a_groups_variation_on_its_rows_that_count():
    rollouts = [Rollout([1], [2], [0.0], 0, "stop", g) for g in range(2) for _ in range(3)]
    rollouts[0] = rollouts[0].with_outcome(Outcome.reward_error)  # group 0 varies only by its failed 0.0
    prompts = [Example([g], "src", "1", {}) for g in range(2)]
    graded = GradedBatch(prompts, rollouts, Grades([0.0, 1, 1, 0, 1, 1], {}, {}))
    cfg = RunConfig()
    cfg.algorithm.filter_groups.enable, cfg.data.train_batch_size = True, 1
    batch, varied = LearningSignal(cfg).select(graded, batches=1)
    assert varied == 1 and batch.prompts == [prompts[1]]


class RecordingEngine(BatchEngine):
    """One episode's turns, in order from a script; records each turn's seed."""

    def __init__(self, script: list[str]):
        super().__init__(self._answer)
        self.script, self.seeds = list(script), []

    def _answer(self, requests):
        [request] = requests
        self.seeds.append(request.seed)
        turn = self.script.pop(0)
        return [TurnOutput([ord(c) for c in turn], [-0.5] * len(turn), "stop", 1)]


def play(tools, script: list[str], scheduler=None, **policies) -> tuple[Rollout, RecordingEngine]:
    limits = EpisodeLimits(max_turns=4, max_tokens=200, turn_tokens=50, max_model_len=512)
    engine = RecordingEngine(script * 4)
    runner = EpisodeRunner(limits, Characters(), tools, Characters(), OutcomesConfig(**policies), scheduler)
    [rollout] = runner.run([[1, 2]], 1, [7], [{}], engine)
    return rollout, engine


FAILED = ToolResult("Error executing tool 'game': the service is down", 0.0, "exception")


@pytest.mark.parametrize("scheduler", [LockstepScheduler(), AsyncScheduler(64)], ids=["lockstep", "async"])
def test_retry_plays_an_episode_again_in_fresh_instances_up_to_its_bound_then_falls_back(scheduler):
    tools = ScriptedTools([FAILED] * 3, release=ToolResult("", 0.0))
    rollout, engine = play(tools, ["call:game", "done"], scheduler, tool_failure="retry", max_retries=2)
    assert (rollout.outcome, rollout.episode.retries) == (Outcome.tool_failure, 2)  # 3 plays, all failed
    calls = [item for item in tools.sent if hasattr(item, "may_create")]
    assert len({call.episode for call in calls}) == 3 and all(call.may_create for call in calls)  # fresh instances
    assert len(set(engine.seeds[0::2])) == 1  # each play's first turn drew with the episode's own seed
    for fallback, counts in (("mask", [False]), ("fail_group", [False]), ("zero", [True])):
        cfg = OutcomesConfig(tool_failure="retry", fallback=fallback)
        assert outcomes.counted([rollout], cfg) == counts
    # a failure that passes: the second play scores
    tools = ScriptedTools([FAILED, ToolResult("3 left", 0.25)], release=ToolResult("", 0.0))
    rollout, _ = play(tools, ["call:game", "done"], scheduler, tool_failure="retry")
    assert (rollout.outcome, rollout.episode.retries, rollout.episode.tool_reward) == (Outcome.scored, 1, 0.25)
    # without retry, the episode is played once
    tools = ScriptedTools([FAILED], release=ToolResult("", 0.0))
    rollout, _ = play(tools, ["call:game", "done"], scheduler)
    assert (rollout.outcome, rollout.episode.retries) == (Outcome.tool_failure, 0)
    assert len([item for item in tools.sent if isinstance(item, ToolRelease)]) == 1  # its instance released, once


TOOLS = """
import asyncio
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Ok(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="ok"), 0.0, {}

class Raises(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the service is down")

class Waits(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(3600)
"""


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outcome_tools")
    (folder / "outcome_tools.py").write_text(TOOLS)
    entries = []
    for name, required in (("ok", []), ("raises", []), ("waits", []), ("needs", ["x"])):
        parameters = {"type": "object", "properties": {"x": {"type": "string"}}, "required": required}
        schema = {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}
        cls = {"needs": "Ok"}.get(name, name.capitalize())
        entries.append({"class_name": f"outcome_tools.{cls}", "config": {"type": "native"}, "tool_schema": schema})
    (folder / "tools.yaml").write_text(json.dumps({"tools": entries}))
    box = ToolBox(ToolSettings(str(folder / "tools.yaml"), None, 1, 1.0, 2048, 64, max_failure_rate=1.0))
    yield box
    box.close()


@pytest.mark.parametrize(
    "turns, kind",
    [
        (["call:raises", "done"], Outcome.tool_failure),  # raised on arguments its schema takes
        (["call:waits", "done"], Outcome.timeout),  # past episode.tool_timeout_s
        (["call:needs", "done"], Outcome.scored),  # no required `x`: the model's mistake, a malformed call
        (["call:ok", "call:ok", "call:ok", "call:ok"], Outcome.truncated),  # still calling at max_turns
        (["call:ok", "done"], Outcome.scored),
    ],
)
def test_each_tool_outcome_is_set_by_the_episode_loop_from_real_tool_workers(toolbox, turns, kind):
    rollout, _ = play(toolbox, turns)
    assert rollout.outcome == kind
    assert rollout.episode.malformed_calls == (turns[0] == "call:needs")


def test_a_lost_instance_decides_before_the_failure_that_lost_it():
    lost = ToolResult("Error executing tool 'game': its state is lost", 0.0, "lost")
    tools = ScriptedTools([ToolResult("3 left", 0.25), ToolResult("Error", 0.0, "crash")], release=lost)
    rollout, _ = play(tools, ["call:game", "call:game", "done"])
    assert rollout.outcome == Outcome.lost and rollout.episode.lost_instance == "game"
    assert outcomes.counted([rollout], OutcomesConfig()) == [False]  # lost: mask by default, never zero


PLUGIN = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise RuntimeError("the judge is down")
    if ground_truth == "sleep":
        time.sleep(60)
    if ground_truth.startswith("flaky:"):  # fails its first call, then scores
        marker = ground_truth[len("flaky:"):]
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("the judge is busy")
        return 1.0
    return float(solution_str == ground_truth)
"""


class OneBatch:
    """A rollout queue holding one generated batch."""

    def __init__(self, prompts: list[Example], rollouts: list[Rollout]):
        self.cfg, self.batch = RunConfig(), (prompts, GeneratedRollouts(rollouts, {}))

    def pop(self, step: int):
        return self.batch


def graded_by(tmp_path: Path, truths: list[str], **policies) -> tuple[GradedBatch, Grades]:
    """The truths' samples (each answered "1") graded by the real grader through the controller's step."""
    plugin = tmp_path / "judge.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    custom = CustomRewardConfig(path=str(plugin))
    reward = RewardConfig(custom=custom, num_workers=1, timeout_s=1.0, max_failure_rate=1.0)
    grader = Grader(reward, outcomes=OutcomesConfig(**policies))
    prompts = [Example([g], "src", truth, {}) for g, truth in enumerate(truths)]
    rollouts = [Rollout([g], [1], [0.0], 0, "stop", g) for g in range(len(truths))]
    signal = LearningSignal(RunConfig())
    try:
        batch, _ = next_graded(1, OneBatch(prompts, rollouts), Identity(), grader, signal, Phases())
    finally:
        grader.close()
    return batch, batch.grades


def test_a_rewards_failures_type_their_rollouts_through_the_real_grader(tmp_path):
    batch, grades = graded_by(tmp_path, ["1", "raise", "sleep", "0"])
    assert [r.outcome for r in batch.rollouts] == ["scored", "reward_error", "timeout", "scored"]
    assert [row["outcome"] for row in dump_rows(batch, Identity())] == [
        "scored",
        "reward_error",
        "timeout",
        "scored",
    ]
    metrics = outcomes.step_metrics(batch.rollouts, grades.retries)
    assert metrics == {**{f"outcome/{k}": 0.0 for k in Outcome}, "outcome/scored": 2.0} | {
        "outcome/reward_error": 1.0,
        "outcome/timeout": 1.0,
        "outcome/retries": 0.0,
    }


def test_retry_grades_a_failed_sample_again_up_to_its_bound_then_falls_back(tmp_path):
    flaky = f"flaky:{tmp_path / 'seen'}"
    batch, grades = graded_by(tmp_path, ["1", flaky, "raise"], reward_error="retry", max_retries=2)
    assert grades.scores == [1.0, 1.0, 0.0] and grades.retries == 3  # both failed once, then "raise" again
    assert [r.outcome for r in batch.rollouts] == ["scored", "scored", "reward_error"]
    assert outcomes.counted(batch.rollouts, OutcomesConfig(reward_error="retry")) == [True, True, False]
    assert outcomes.step_metrics(batch.rollouts, grades.retries)["outcome/retries"] == 3.0


def test_truncation_and_a_lost_instance_are_read_from_the_record():
    assert Rollout([1], [2], [0.0], 0, "length").outcome == Outcome.truncated
    lost = Rollout([1], [2], [0.0], 0, "length", episode=EpisodeStats(1, lost_instance="game"))
    assert lost.outcome == Outcome.lost  # a saved rollout without the field (an older checkpoint) gets it too
    assert lost.with_outcome(Outcome.reward_error).outcome == Outcome.lost  # lost decides first
    assert Rollout.from_dict(dataclasses.asdict(lost)).outcome == Outcome.lost


def test_every_kind_has_a_setting_and_the_settings_that_would_train_wrongly_are_refused():
    settings = {f.name for f in dataclasses.fields(OutcomesConfig)} - {"max_retries", "fallback"}
    assert settings == {kind.value for kind in Outcome} - {"scored"}
    for overrides, message in (
        (["algorithm.outcomes.truncated=retry"], "algorithm.outcomes.truncated=retry: a truncation is the model's"),
        (["algorithm.outcomes.lost=zero"], "algorithm.outcomes.lost=zero: a lost instance's reward is unknown"),
        (["algorithm.outcomes.fallback=retry"], "algorithm.outcomes.fallback=retry: allowed values are mask"),
        (["algorithm.outcomes.lost=retry", "algorithm.outcomes.fallback=zero"], "fallback=zero with algorithm"),
        (["algorithm.outcomes.timeout=retry", "algorithm.outcomes.max_retries=0"], "max_retries=0 must be >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            compose_run(*overrides)
    with pytest.raises(Exception) as refused:
        compose_run("algorithm.outcomes.timeout=skip")  # Hydra names the key and the allowed values
    why = str(refused.value.__cause__)  # Hydra's message: the value, the allowed ones, the key
    assert "expected one of [retry, mask, fail_group, zero]" in why and "full_key: algorithm.outcomes.timeout" in why
    cfg = compose_run("algorithm.overlong_filter=true", "algorithm.outcomes.truncated=mask")
    with pytest.raises(ValueError, match="algorithm.overlong_filter=true with algorithm.outcomes.truncated=mask"):
        outcomes.validate(cfg.algorithm)
