"""The environment's tokens of an episode are context, never trained on: the FSDP2 trainer's loss and gradients
on two-turn episodes equal those of the model's turns alone (each turn a row of its own, everything before it
its prompt), to 1e-6 in fp32; an environment token's advantage or sampler logprob changes nothing; and every
turn's model tokens do count."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import one_step

from rl_tpu.algorithms import core as algorithms
from rl_tpu.config import AlgorithmConfig
from rl_tpu.records import TrainBatch

ROWS = 8


@pytest.fixture(scope="module")
def episodes():
    """Eight episodes in groups of 4: prompt, model turn, tool result, model turn; GRPO advantages."""
    rng = random.Random(5)
    tokens = lambda low, high: [rng.randrange(2, 60) for _ in range(rng.randint(low, high))]  # noqa: E731
    prompts, turns = [], []
    for i in range(ROWS):
        prompts.append(prompts[-1] if i % 4 else tokens(3, 8))
        turns.append((tokens(1, 5), tokens(2, 6), tokens(1, 5)))
    completions = [first + env + second for first, env, second in turns]
    masks = [[1] * len(first) + [0] * len(env) + [1] * len(second) for first, env, second in turns]
    sampler = [[-rng.uniform(0.5, 6.0) if m else 0.0 for m in mask] for mask in masks]
    rewards = [float(rng.random() < 0.5) for _ in range(ROWS)]
    advantages = algorithms.advantages(
        rewards, [i // 4 for i in range(ROWS)], list(map(len, completions)), AlgorithmConfig(), model_masks=masks
    )
    batch = TrainBatch(prompts, completions, sampler, advantages, 1.0, model_masks=masks)
    return batch, turns


def turns_alone(batch: TrainBatch, turns) -> TrainBatch:
    """Each model turn as a row of its own: its prompt is everything before it; no environment token is trained."""
    rows = []
    for i, (first, env, second) in enumerate(turns):
        for start, ids in ((0, first), (len(first) + len(env), second)):
            end = start + len(ids)
            prompt = batch.prompt_ids[i] + batch.completion_ids[i][:start]
            rows.append((prompt, ids, batch.sampler_logprobs[i][start:end], batch.advantages[i][start:end]))
    prompts, completions, sampler, advantages = map(list, zip(*rows))
    return TrainBatch(prompts, completions, sampler, advantages, batch.temperature)


@pytest.fixture(scope="module")
def episode_step(tiny_model_dir, episodes):
    return one_step(tiny_model_dir, episodes[0])


def assert_same(step_a, step_b, rel: float = 1e-6) -> None:
    (metrics_a, grads_a), (metrics_b, grads_b) = step_a, step_b
    assert metrics_a["actor/loss"] == pytest.approx(metrics_b["actor/loss"], rel=rel, abs=1e-7)
    assert metrics_a["perf/train_tokens"] == metrics_b["perf/train_tokens"]
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=rel, atol=1e-6, msg=name)


def test_the_loss_and_gradients_are_those_of_the_models_turns_alone(tiny_model_dir, episodes, episode_step):
    batch, turns = episodes
    assert episode_step[0]["perf/train_tokens"] == sum(len(a) + len(b) for a, _, b in turns)
    assert_same(episode_step, one_step(tiny_model_dir, turns_alone(batch, turns)))


def test_an_environment_tokens_advantage_and_sampler_logprob_change_nothing(tiny_model_dir, episodes, episode_step):
    batch, _ = episodes
    rng = random.Random(0)

    def garbled(rows: list[list[float]]) -> list[list[float]]:
        return [
            [v if m else rng.uniform(-50, 50) for v, m in zip(row, mask)] for row, mask in zip(rows, batch.model_masks)
        ]

    changed = dataclasses.replace(
        batch, advantages=garbled(batch.advantages), sampler_logprobs=garbled(batch.sampler_logprobs)
    )
    assert_same(episode_step, one_step(tiny_model_dir, changed), rel=1e-7)


@pytest.mark.parametrize("turn", [0, 1])
def test_every_turns_model_tokens_count(tiny_model_dir, episodes, episode_step, turn):
    batch, turns = episodes
    masks = []
    for mask, (first, env, _) in zip(batch.model_masks, turns):
        start, end = (0, len(first)) if turn == 0 else (len(first) + len(env), len(mask))
        masks.append([0 if start <= j < end else m for j, m in enumerate(mask)])
    _, grads = one_step(tiny_model_dir, dataclasses.replace(batch, model_masks=masks))
    differences = [(grads[name] - grad).abs().max().item() for name, grad in episode_step[1].items()]
    assert max(differences) > 1e-4
