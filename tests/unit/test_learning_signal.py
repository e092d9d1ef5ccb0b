"""The learning signal (rl_tpu/algorithms/learning_signal.py): DAPO's batch shaping (dynamic sampling keeps groups
whose rewards vary, the overlong penalty, the masks), the batch it builds, and the step's phases and metrics."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.algorithms import learning_signal as signal_parts
from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.config import RunConfig
from rl_tpu.config.reward import OverlongBufferConfig
from rl_tpu.controller.phases import Phases
from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.data.datasets import Example
from rl_tpu.grader.grader import Failure, Grades
from rl_tpu.models.logprobs import pad_batch
from rl_tpu.records import Outcome, Rollout, TrainBatch


def graded(rewards_per_group: list[list[float]], first_prompt: int = 0) -> GradedBatch:
    """Prompts numbered from `first_prompt`, one group of completions each, graded with these rewards."""
    prompts = [Example([first_prompt + g], "src", str(first_prompt + g), {}) for g in range(len(rewards_per_group))]
    rollouts, scores = [], []
    for g, rewards in enumerate(rewards_per_group):
        for r in rewards:
            rollouts.append(Rollout([first_prompt + g], [5, 6], [-1.0, -1.0], 0, "stop", group=g))
            scores.append(r)
    return GradedBatch(
        prompts, rollouts, Grades(scores, {"arithmetic": list(scores)}, {}, [Failure(0, "x", "timeout", "")])
    )


def test_dynamic_sampling_fills_the_batch_with_groups_that_vary():
    first = graded([[1, 1, 1], [0, 1, 0], [0, 0, 0]])  # one of three groups varies
    batch, varied = signal_parts.fill_with_varied_groups(first, target=2, metric=None, last_try=False)
    assert batch is None and varied == 1  # not full: generate more
    both = GradedBatch.concat([first, graded([[0, 0, 0], [1, 0, 1], [0, 1, 1]], first_prompt=3)])
    assert [r.group for r in both.rollouts[9:]] == [3, 3, 3, 4, 4, 4, 5, 5, 5]  # renumbered after the first part
    assert [f.index for f in both.grades.failures] == [0, 9]
    batch, varied = signal_parts.fill_with_varied_groups(both, target=2, metric="arithmetic", last_try=False)
    assert varied == 2 and [p.prompt_ids for p in batch.prompts] == [[1], [4]]  # the earliest varied groups
    assert [r.group for r in batch.rollouts] == [0, 0, 0, 1, 1, 1] and batch.grades.scores == [0, 1, 0, 1, 0, 1]
    for group, rows in batch.groups().items():  # no zero-variance group, and each rollout answers its prompt
        assert len({batch.grades.scores[i] for i in rows}) > 1
        assert all(batch.rollouts[i].prompt_ids == batch.prompts[group].prompt_ids for i in rows)


def test_the_last_try_keeps_the_batch_size_with_groups_that_do_not_vary():
    batch, varied = signal_parts.fill_with_varied_groups(
        graded([[1, 1], [0, 1], [0, 0]]), target=3, metric=None, last_try=True
    )
    assert varied == 1 and len(batch.prompts) == 3 and len(batch.rollouts) == 6


def test_overlong_penalty_is_dapos_linear_ramp_into_the_buffer():
    buffer = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    assert signal_parts.overlong_penalties([10, 12, 13, 14, 16], 16, buffer) == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0]
    )
    assert signal_parts.overlong_penalties([16], 16, OverlongBufferConfig()) == [0.0]  # off by default
    assert signal_parts.overlong_penalties([16, 18, 20], 20, OverlongBufferConfig(enable=True)) == pytest.approx(
        [0.0, -0.5, -1.0]
    )  # len unset: a fifth of the response length


def test_a_sequence_out_of_the_loss_adds_no_token_and_no_sequence():
    batch = TrainBatch(
        [[1, 2], [1, 2]], [[3, 4, 5], [3]], [[-1.0] * 3, [-1.0]], [[1.0] * 3, [-1.0]], 1.0, loss_mask=[True, False]
    )
    assert batch.num_tokens() == 3 and batch.num_seqs() == 1
    t = pad_batch(batch, pad_id=0, device=torch.device("cpu"))
    assert t["response_mask"].tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert t["attention_mask"][1].sum() == 3  # still in the forward: its tokens are computed, not trained on
    assert batch.shard(1, 2).loss_mask == [False] and batch.sorted_by_length().loss_mask == [False, True]
    with pytest.raises(ValueError, match="sequence 1 has 1 completion tokens but 2 advantages"):
        TrainBatch([[1], [1]], [[3], [3]], [[-1.0], [-1.0]], [[1.0], [1.0, 1.0]], 1.0)


class SeededSampler:
    """A sampler stand-in: a prompt's completions depend on its draw seed alone (as vLLM's seeded draws do);
    odd seeds give a group that varies, even seeds one that does not. Records every call."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], list[int]]] = []
        self.version = 0  # the weights it serves: the test installs step - 1 before each step

    def generate(self, prompts, settings, seeds, tools_kwargs=None):
        self.calls.append((prompts, seeds))
        rollouts = [
            Rollout(p, [seed % 2 * i % 2], [0.0], self.version, "stop", g)
            for g, (p, seed) in enumerate(zip(prompts, seeds))
            for i in range(settings.n)
        ]
        return type("Done", (), {"result": lambda self, timeout: rollouts, "shares": lambda self: {}})()


def test_a_resumed_run_with_dynamic_sampling_draws_what_an_uninterrupted_one_draws():
    """The generation batches a checkpoint saves (`RolloutQueue.taken`), skipped in the prompt stream as the
    controller does on resume, give the next steps the same prompts and seeds as a run that never stopped."""
    from test_evaluation import Identity, ScoresByToken

    from rl_tpu.controller import rollouts as rollout_queue
    from rl_tpu.data.datasets import batches

    cfg = RunConfig()
    cfg.data.train_batch_size, cfg.sampler.n, cfg.trainer.total_steps = 4, 2, 5
    cfg.algorithm.filter_groups.enable = True
    examples = [Example([i], "src", "1", {}) for i in range(40)]

    def run(steps: range, taken: int) -> tuple[list[list[int]], int]:
        sampler = SeededSampler()
        stream = batches(examples, 4, seed=0)
        for _ in range(taken):
            next(stream)
        queue = rollout_queue.RolloutQueue(type("ActorHandles", (), {"samplers": sampler})(), stream, cfg, taken)
        trained = []
        for step in steps:
            sampler.version = step - 1
            shaped = rollout_queue.collect(step, queue, Identity(), ScoresByToken(), LearningSignal(cfg), Phases())
            trained.append([e.prompt_ids[0] for e in shaped.batch.prompts])
            assert shaped.varied_groups == 4  # dynamic sampling filled each batch with groups that vary
        return trained + [seeds for _, seeds in sampler.calls], queue.taken

    whole, _ = run(range(1, 6), 0)
    first, taken = run(range(1, 3), 0)
    assert taken > 2  # dynamic sampling took more generation batches than steps
    resumed, _ = run(range(3, 6), taken)
    assert resumed[:3] == whole[2:5]  # the prompts each step trains on
    assert resumed[3:] == whole[5 + taken :]  # and the seeds of every draw after the checkpoint


def test_the_signal_scores_then_builds_the_batch_with_the_kl_in_the_reward():
    """`score` adds the overlong penalty to the grades; `train_batch` leaves truncated completions out of the loss,
    asks the trainer's per-token KL once, on the batch before its advantages, and subtracts it from the rewards."""
    cfg = RunConfig()
    cfg.sampler.n, cfg.sampler.response_length = 3, 2
    cfg.reward.overlong_buffer = OverlongBufferConfig(enable=True, len=1, penalty_factor=0.5)
    cfg.algorithm.overlong_filter, cfg.algorithm.use_kl_in_reward = True, True
    cfg.algorithm.kl_ctrl.kl_coef = 1.0
    signal = LearningSignal(cfg)
    rollouts = [
        Rollout([7], [1, 1], [-0.5, -0.5], 0, "length", 0),  # reaches into the buffer: -0.5, out of the loss
        Rollout([7], [0], [-0.5], 0, "stop", 0),
        Rollout([7], [1], [-0.5], 0, "stop", 0),
    ]
    grades = signal.score(Grades([1.5, 0.0, 1.0], {"acc": [1.0, 0.0, 1.0]}, {}), rollouts)
    assert grades.scores == [1.0, 0.0, 1.0] and grades.components == {"acc": [1.0, 0.0, 1.0]}
    asked = []

    def token_kl(batch: TrainBatch) -> list[list[float]]:
        asked.append(batch)
        return [[0.5] * len(c) for c in batch.completion_ids]

    graded = GradedBatch([Example([7], "src", "1", {})], rollouts, grades)
    batch, metrics = signal.train_batch(graded, token_kl)
    [before] = asked
    assert before.advantages == [[0.0, 0.0], [0.0], [0.0]] and before.loss_mask == [False, True, True]
    assert batch.completion_ids == [[1, 1], [0], [1]] and batch.sampler_logprobs == [[-0.5, -0.5], [-0.5], [-0.5]]
    assert (batch.temperature, batch.rollout_is, batch.model_masks) == (cfg.sampler.temperature, None, None)
    # rewards less beta * KL summed over each completion: 1 - 1.0, 0 - 0.5, 1 - 0.5 -> mean 0, std 0.5 (grpo)
    assert [a for row in batch.advantages for a in row] == pytest.approx([0.0, 0.0, -1.0, 1.0], abs=1e-5)
    assert metrics == {
        "actor/reward_kl_penalty": pytest.approx(0.5),
        "actor/reward_kl_penalty_coeff": 1.0,
        "outcome/rows_out": 0.0,  # overlong filtering leaves the truncated row out of the loss, but it counts
        "outcome/groups_out": 0.0,
    }
    assert signal.kl_coef == 1.0 and LearningSignal(RunConfig()).kl_coef is None  # no KL: nothing to save


def test_each_phase_is_timed_and_spanned_once_per_entry():
    phases = Phases()
    with torch.profiler.profile() as trace:
        for _ in range(2):
            with phases("grade"):
                torch.ones(1).add_(1)
    assert phases["grade"] > 0.0 and phases["train"] == 0.0 and phases.elapsed() >= phases["grade"]
    assert sum(e.name == "rl_tpu/grade" for e in trace.events()) == 2


class StandInActors:
    """The roles' side of a step as `grpo_step` calls it: a seeded sampler, a trainer that records its batch."""

    def __init__(self):
        self.samplers, self.calls = SeededSampler(), []

    def release_devices(self) -> None:
        self.calls.append("release")

    def token_kl(self, batch: TrainBatch) -> list[list[float]]:
        self.calls.append("token_kl")
        return [[0.25] * len(c) for c in batch.completion_ids]

    def train(self, batch: TrainBatch) -> dict[str, float]:
        self.calls.append("train")
        return {"actor/pg_loss": 0.0, "time/train_s": 0.5, "perf/train_tokens": float(batch.num_tokens())}

    def publish(self, version: int):
        from rl_tpu.records import WeightBundle

        self.calls.append("publish")
        return WeightBundle(version, "object_store", (), 2**20)

    def install(self, bundle, wait: bool) -> dict[str, float]:
        self.calls.append("install")
        return {"receive_s": 0.1, "install_wait_s": 0.0, "peak_rss_mb": 9.0, "time/sampler_idle_s": 0.2}


# the step's metric keys as main logged them before its phases had one timer (the 35-key dict of grpo_step)
STEP_KEYS = {
    "reward/mean", "reward/std", "reward/acc", "reward/failed", "reward/timeouts", "data/gen_batches",
    "data/groups_generated", "data/varied_groups", "rollout/samples", "response/length_mean",
    "response/truncated_frac", "actor/pg_loss", "time/train_s", "perf/train_tokens", "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff", "time/generate_s", "time/reward_s", "time/train_step_s", "time/sync_s",
    "time/publish_s", "time/step_s", "time/trainer_idle_s", "perf/gen_tokens_per_s", "perf/train_tokens_per_s",
    "rollout/weight_version", "rollout/staleness", "sync/version", "sync/transport", "sync/buckets", "sync/bytes",
    "sync/mb_per_s", "sync/receive_s", "sync/install_wait_s", "perf/sampler_peak_rss_mb", "time/sampler_idle_s",
}  # fmt: skip
# and those typed rollout outcomes added (rl_tpu/algorithms/outcomes.py)
OUTCOME_KEYS = {f"outcome/{kind}" for kind in Outcome} | {"outcome/retries", "outcome/rows_out", "outcome/groups_out"}


def test_a_step_runs_its_phases_in_order_and_keeps_its_metric_keys():
    from test_evaluation import Identity, ScoresByToken

    from rl_tpu.controller.rollouts import RolloutQueue
    from rl_tpu.controller.step import grpo_step
    from rl_tpu.data.datasets import batches

    cfg = RunConfig()
    cfg.data.train_batch_size, cfg.sampler.n, cfg.trainer.total_steps = 4, 2, 2
    cfg.algorithm.filter_groups.enable, cfg.algorithm.use_kl_in_reward = True, True
    actors = StandInActors()
    examples = [Example([i], "src", "1", {}) for i in range(40)]
    queue = RolloutQueue(actors, batches(examples, 4, seed=0), cfg, taken=0)
    metrics, trained = grpo_step(1, queue, actors, Identity(), ScoresByToken(), cfg, LearningSignal(cfg))
    assert set(metrics) == STEP_KEYS | OUTCOME_KEYS
    assert actors.calls == ["release", "token_kl", "train", "publish", "install"]
    assert len(trained.graded.prompts) == 4 and metrics["data/varied_groups"] == 4.0
    timed = ("time/generate_s", "time/reward_s", "time/train_step_s", "time/sync_s")
    assert sum(metrics[k] for k in timed) <= metrics["time/step_s"]
    assert metrics["time/sync_s"] >= metrics["time/publish_s"] > 0.0
    assert metrics["sync/mb_per_s"] == pytest.approx(1 / metrics["time/sync_s"])
