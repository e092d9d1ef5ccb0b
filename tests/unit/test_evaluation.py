"""pass@k: the estimator, the counting of each prompt's solved samples, and the run's summary line."""

from __future__ import annotations

import itertools
from concurrent.futures import Future

import pytest

from rl_tpu.controller.evaluation import PendingEval, describe, pass_at_k, pass_at_k_summary, reported_ks
from rl_tpu.grader.grader import Grades
from rl_tpu.records import Rollout


@pytest.mark.parametrize("n", [1, 3, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
    for correct in range(n + 1):
        samples = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, correct, k) == pytest.approx(sum(map(any, subsets)) / len(subsets), abs=1e-12)


def test_pass_at_k_needs_k_within_the_samples():
    with pytest.raises(ValueError, match=r"pass@9 needs 1 <= k <= n = 8"):
        pass_at_k(8, 3, 9)
    assert reported_ks(8) == [1, 2, 4, 8] and reported_ks(6) == [1, 2, 4, 6] and reported_ks(1) == [1]


class Finished:
    def __init__(self, rollouts):
        self.rollouts = rollouts

    def result(self, timeout_s):
        return self.rollouts


class ScoresByToken:
    """A grader stand-in: a completion `[1]` scores 1, `[0]` scores 0 (the real one decodes and verifies)."""

    primary = "acc"

    def submit(self, samples):
        future = Future()
        scores = [float(s.solution_str == "1") for s in samples]
        future.set_result(Grades(scores, {"acc": scores}, {}))
        return future


class Identity:
    def decode(self, ids, skip_special_tokens):
        return "".join(map(str, ids))


def test_each_prompts_solved_samples_are_counted_by_its_group():
    from rl_tpu.data.datasets import Example

    examples = [Example([7], "arith", "1", {}) for _ in range(3)]
    greedy = [Rollout([7], [c], [0.0], 0, "stop", g) for g, c in enumerate([1, 0, 0])]
    solved = {0: 4, 1: 1, 2: 0}  # of 4 samples each, interleaved so that the group decides, not the order
    sampled = [Rollout([7], [int(i < solved[g])], [0.0], 0, "stop", g) for i in range(4) for g in range(3)]
    metrics = PendingEval(examples, Finished(greedy), Finished(sampled), 4).finish(Identity(), ScoresByToken(), 1.0)
    assert metrics["eval/accuracy"] == pytest.approx(1 / 3)
    assert metrics["eval/pass@1"] == pytest.approx((1 + 0.25 + 0) / 3)
    assert metrics["eval/pass@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert metrics["eval/pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert "eval/pass@3" not in metrics
    only_greedy = PendingEval(examples, Finished(greedy), None, 4).finish(Identity(), ScoresByToken(), 1.0)
    assert not any(key.startswith("eval/pass@") for key in only_greedy)


def test_the_summary_takes_the_first_and_last_sampled_evaluations():
    records = [
        {"step": 0, "eval/accuracy": 0.5, "eval/pass@1": 0.4, "eval/pass@2": 0.6},
        {"step": 1},
        {"step": 2, "eval/accuracy": 0.6},
        {"step": 3, "eval/accuracy": 0.7, "eval/pass@1": 0.7, "eval/pass@2": 0.8},
    ]
    summary = pass_at_k_summary(records)
    assert summary == {
        "eval/pass@1_start": 0.4,
        "eval/pass@2_start": 0.6,
        "eval/pass@1_final": 0.7,
        "eval/pass@2_final": 0.8,
    }
    run = {"eval/accuracy_start": 0.5, "eval/accuracy_final": 0.65, **summary, "steps": 3, "time/wall_s": 12}
    line = describe({**run, "eval/start_step": 0.0})
    assert line == (
        "held-out accuracy: 50.0% -> 65.0% (step 0 -> mean of the last evaluations); pass@1 40.0% -> "
        "70.0%; pass@2 60.0% -> 80.0%; wall time 12 s"
    )
    # resumed into a new folder: its baseline is the checkpoint's policy on this run's held-out set, at its step
    assert "(step 2 -> mean of the last evaluations)" in describe({**run, "eval/start_step": 2.0})
    assert pass_at_k_summary(records[1:3]) == {}
    # resumed with trainer.eval_pass_k=1: pass@2 has no final value, and is left out rather than failing the summary
    fewer = [*records, {"step": 4, "eval/accuracy": 0.7, "eval/pass@1": 0.75}]
    assert pass_at_k_summary(fewer) == {"eval/pass@1_start": 0.4, "eval/pass@1_final": 0.75}
    only = describe(
        {
            "eval/accuracy_start": 0.5,
            "eval/accuracy_final": 0.5,
            "eval/pass@1_start": 0.4,
            "eval/pass@1_final": 0.4,
            "eval/start_step": 0.0,
            "steps": 0,
            "time/wall_s": 3,
        }
    )
    assert only == "held-out accuracy: 50.0% (evaluation only); pass@1 40.0%; wall time 3 s"
