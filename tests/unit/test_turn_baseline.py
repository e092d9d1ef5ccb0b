"""`algorithm.adv_estimator=grpo_turn`: a turn the environment answered is compared with the same turn of the group's
episodes that got that far; an episode's last turn with the whole group (GRPO); without episodes it is GRPO."""

from __future__ import annotations

import random

import pytest
import torch

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms.registry import estimator_facts
from rl_tpu.algorithms.turn_baseline import turn_spans
from rl_tpu.config import AlgorithmConfig

TURN = AlgorithmConfig(adv_estimator="grpo_turn")
# a model turn (1s), the environment's answer (0s), ...: won at the first call, lost after three, won at the second
WON_FIRST = [1, 1, 0, 1]
LOST = [1, 1, 0, 1, 0, 1, 0, 1]
WON_SECOND = [1, 1, 0, 1, 0, 1]


def approx(values):
    return pytest.approx(values, rel=1e-5, abs=1e-6)  # the std has GRPO's epsilon added


def test_turns_are_the_runs_of_model_tokens():
    assert turn_spans(LOST) == [(0, 2), (3, 4), (5, 6), (7, 8)]
    assert turn_spans([0, 1, 1, 0, 0]) == [(1, 3)]
    assert turn_spans([0, 0]) == []


def test_a_later_call_is_compared_only_with_the_episodes_that_made_it():
    """With GRPO every token of a lost game is below the group's mean, the second and third calls too (they exist
    mostly in lost games); here the second call of the lost games is compared with the second calls alone (the game
    won at its second call is above them), the third with the third alone (all lost: 0)."""
    rewards = [1.0, 0.0, 0.0, 1.0]
    masks = [WON_FIRST, LOST, LOST, WON_SECOND]
    got = algorithms.advantages(rewards, [0] * 4, [len(m) for m in masks], TURN, model_masks=masks)
    whole = 1 / (4 / 3) ** 0.5  # (1 - 0.5) / std([1, 0, 0, 1]) = 0.866: the first call and the last turns
    second = (0 - 1 / 3) / (1 / 3) ** 0.5  # the second calls of [0, 0, 1]: -0.577, and 1.155 for the winner
    assert got[0] == approx([whole, whole, 0.0, whole])
    assert got[1] == approx([-whole, -whole, 0.0, second, 0.0, 0.0, 0.0, -whole])
    assert got[3] == approx([whole, whole, 0.0, -2 * second, 0.0, whole])
    grpo = algorithms.advantages(
        rewards, [0] * 4, [len(m) for m in masks], AlgorithmConfig(adv_estimator="grpo"), model_masks=masks
    )
    assert grpo[1][3] == approx(-whole)  # GRPO: the second call of a lost game, as far below as its first


def test_an_episode_that_ends_on_an_answer_has_every_turn_answered():
    """Cut at its budget after a tool result: its last turn was answered, so it is compared with the calls."""
    masks = [[1, 0, 1, 0], [1, 0, 1, 0]]
    got = algorithms.advantages([1.0, 0.0], [0, 0], [4, 4], TURN, model_masks=masks)
    assert got[0][2] > 0 > got[1][2]


def test_dr_grpo_leaves_the_std_out_and_a_turn_alone_in_its_group_gets_nothing():
    masks = [WON_FIRST, LOST]
    cfg = AlgorithmConfig(adv_estimator="grpo_turn", norm_adv_by_std_in_grpo=False)
    got = algorithms.advantages([1.0, 0.0], [0, 0], [4, 8], cfg, model_masks=masks)
    assert got[0] == approx([0.5, 0.5, 0.0, 0.5]) and got[1][3] == 0.0  # only the lost game made a 2nd call


def test_without_episodes_it_is_grpo():
    rng = random.Random(5)
    lengths = [rng.randint(1, 6) for _ in range(12)]
    rewards = [float(rng.random() < 0.5) for _ in lengths]
    groups = [i // 4 for i in range(12)]
    penalties = [[0.01 * rng.random() for _ in range(n)] for n in lengths]
    got = algorithms.advantages(rewards, groups, lengths, TURN, token_penalties=penalties)
    expected = algorithms.advantages(rewards, groups, lengths, AlgorithmConfig(), token_penalties=penalties)
    for ours, verls in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(verls), rtol=1e-5, atol=1e-6)


def test_it_is_offered_and_compares_a_group():
    assert estimator_facts("grpo_turn").compares_group
    with pytest.raises(ValueError, match="allowed values are .*grpo_turn"):
        estimator_facts("grpo_turns")
