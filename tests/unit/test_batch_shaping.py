"""DAPO's batch shaping: dynamic sampling keeps groups whose rewards vary, the overlong penalty, the masks."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config.reward import OverlongBufferConfig
from rl_tpu.controller import batch_shaping
from rl_tpu.controller.batch_shaping import GradedBatch
from rl_tpu.data.datasets import Example
from rl_tpu.grader.grader import Failure, Grades
from rl_tpu.models.logprobs import pad_batch
from rl_tpu.records import Rollout, TrainBatch


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
    batch, varied = batch_shaping.fill_with_varied_groups(first, target=2, metric=None, last_try=False)
    assert batch is None and varied == 1  # not full: generate more
    both = GradedBatch.concat([first, graded([[0, 0, 0], [1, 0, 1], [0, 1, 1]], first_prompt=3)])
    assert [r.group for r in both.rollouts[9:]] == [3, 3, 3, 4, 4, 4, 5, 5, 5]  # renumbered after the first part
    assert [f.index for f in both.grades.failures] == [0, 9]
    batch, varied = batch_shaping.fill_with_varied_groups(both, target=2, metric="arithmetic", last_try=False)
    assert varied == 2 and [p.prompt_ids for p in batch.prompts] == [[1], [4]]  # the earliest varied groups
    assert [r.group for r in batch.rollouts] == [0, 0, 0, 1, 1, 1] and batch.grades.scores == [0, 1, 0, 1, 0, 1]
    for group, rows in batch.groups().items():  # no zero-variance group, and each rollout answers its prompt
        assert len({batch.grades.scores[i] for i in rows}) > 1
        assert all(batch.rollouts[i].prompt_ids == batch.prompts[group].prompt_ids for i in rows)


def test_the_last_try_keeps_the_batch_size_with_groups_that_do_not_vary():
    batch, varied = batch_shaping.fill_with_varied_groups(
        graded([[1, 1], [0, 1], [0, 0]]), target=3, metric=None, last_try=True
    )
    assert varied == 1 and len(batch.prompts) == 3 and len(batch.rollouts) == 6


def test_overlong_penalty_is_dapos_linear_ramp_into_the_buffer():
    buffer = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    assert batch_shaping.overlong_penalties([10, 12, 13, 14, 16], 16, buffer) == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0]
    )
    assert batch_shaping.overlong_penalties([16], 16, OverlongBufferConfig()) == [0.0]  # off by default
    assert batch_shaping.overlong_penalties([16, 18, 20], 20, OverlongBufferConfig(enable=True)) == pytest.approx(
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

    from rl_tpu.config import RunConfig
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
        queue = rollout_queue.RolloutQueue(type("Workers", (), {"samplers": sampler})(), stream, cfg, taken)
        trained = []
        for step in steps:
            sampler.version = step - 1
            shaped = rollout_queue.collect(step, queue, Identity(), ScoresByToken(), cfg)
            trained.append([e.prompt_ids[0] for e in shaped.batch.prompts])
            assert shaped.varied_groups == 4  # dynamic sampling filled each batch with groups that vary
        return trained + [seeds for _, seeds in sampler.calls], queue.taken

    whole, _ = run(range(1, 6), 0)
    first, taken = run(range(1, 3), 0)
    assert taken > 2  # dynamic sampling took more generation batches than steps
    resumed, _ = run(range(3, 6), taken)
    assert resumed[:3] == whole[2:5]  # the prompts each step trains on
    assert resumed[3:] == whole[5 + taken :]  # and the seeds of every draw after the checkpoint
