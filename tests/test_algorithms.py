"""Our batching of the GRPO loss equals verl's functions applied to the whole, unpadded batch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rl_tpu import algorithms
from rl_tpu.config import ActorConfig, AlgorithmConfig, LossAggMode
from rl_tpu.models.tiny import build_model
from rl_tpu.rollout import TrainBatch
from rl_tpu.logprobs import pad_batch, token_logprobs
from rl_tpu.trainer import micro_batches


def make_batch(seed: int = 0, size: int = 8, temperature: float = 0.7) -> TrainBatch:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 60) for _ in range(rng.randint(3, 9))] for _ in range(size)]
    completions = [[rng.randrange(2, 60) for _ in range(rng.randint(1, 7))] for _ in range(size)]
    # "sampler" logprobs that differ from the policy's, so PPO clipping is exercised
    sampler = [[-rng.uniform(0.5, 6.0) for _ in c] for c in completions]
    rewards = [float(rng.random() < 0.5) for _ in range(size)]
    advantages = algorithms.group_advantages(rewards, [i // 4 for i in range(size)], AlgorithmConfig())
    return TrainBatch(prompts, completions, sampler, advantages, temperature)


def small_model() -> torch.nn.Module:
    return build_model(vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64,
                       max_positions=64, seed=0)


def test_grpo_advantages_match_group_normalisation():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    advantages = algorithms.group_advantages(rewards, groups, AlgorithmConfig())
    for g in (0, 1):
        scores = torch.tensor([r for r, k in zip(rewards, groups) if k == g])
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)  # verl: unbiased std, eps 1e-6
        got = torch.tensor([a for a, k in zip(advantages, groups) if k == g])
        torch.testing.assert_close(got, expected)
    unscaled = algorithms.group_advantages(rewards, groups, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert unscaled[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])


def reference_loss_and_grads(model, batch: TrainBatch, mode: str):
    """verl's compute_policy_loss_vanilla on logprobs from one unpadded forward per sequence."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig as VerlActorConfig

    model.zero_grad(set_to_none=True)
    resp_len = max(len(c) for c in batch.completion_ids)
    log_prob = torch.zeros(len(batch), resp_len)
    rows = []
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        logits = model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        lp = torch.log_softmax(logits.float() / batch.temperature, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        rows.append(torch.cat([lp, torch.zeros(resp_len - len(c))]))
    log_prob = torch.stack(rows)
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (resp_len - len(c)) for c in batch.completion_ids])
    old = torch.tensor([lp + [0.0] * (resp_len - len(lp)) for lp in batch.sampler_logprobs])
    adv = torch.tensor(batch.advantages)[:, None] * mask
    cfg = VerlActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                          clip_ratio=0.2)
    loss, _ = core_algos.compute_policy_loss_vanilla(old, log_prob, adv, mask, loss_agg_mode=mode, config=cfg)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def our_loss_and_grads(model, batch: TrainBatch, mode: LossAggMode, micro_size: int, dp_size: int = 1,
                       global_batch: TrainBatch | None = None):
    """The trainer's path; `global_batch` is the whole batch when `batch` is one rank's shard of it."""
    global_batch = global_batch or batch
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for micro in micro_batches(batch, micro_size):
        t = pad_batch(micro, pad_id=1, device=torch.device("cpu"))
        log_prob, entropy = token_logprobs(model, t, batch.temperature)
        loss, _ = algorithms.policy_loss(log_prob, t["sampler_logprobs"], t["advantages"], t["response_mask"],
                                         ActorConfig(loss_agg_mode=mode), global_batch.num_tokens(), len(global_batch), dp_size,
                                         entropy=entropy)
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", [LossAggMode.token_mean, LossAggMode.seq_mean_token_mean])
@pytest.mark.parametrize("micro_size", [3, 8])
def test_micro_batched_loss_and_grads_equal_verl_on_full_batch(mode, micro_size):
    model, batch = small_model(), make_batch()
    ref_loss, ref_grads = reference_loss_and_grads(model, batch, mode.value)
    loss, grads = our_loss_and_grads(model, batch, mode, micro_size)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_data_parallel_shards_average_to_the_full_batch_gradient():
    """Each rank normalises by global counts times dp_size; FSDP's gradient average then equals the full batch."""
    model, batch = small_model(), make_batch(seed=3)
    _, full = our_loss_and_grads(model, batch, LossAggMode.token_mean, micro_size=8)
    shard_grads = [our_loss_and_grads(model, batch.shard(r, 2), LossAggMode.token_mean, 8, dp_size=2,
                                      global_batch=batch)[1] for r in range(2)]
    for name, grad in full.items():
        torch.testing.assert_close((shard_grads[0][name] + shard_grads[1][name]) / 2, grad, rtol=1e-4, atol=1e-6)


def test_unknown_estimator_names_allowed_values():
    with pytest.raises(ValueError, match="allowed values are grpo, rloo"):
        algorithms.group_advantages([1.0, 0.0], [0, 0], AlgorithmConfig(adv_estimator="gaee"))
    assert np.isfinite(algorithms.group_advantages([1.0, 0.0], [0, 0], AlgorithmConfig(adv_estimator="rloo"))).all()


def test_truncated_importance_weights_reweight_the_policy_gradient():
    """Async mode: the gradient of each token is scaled by min(pi_trainer / pi_sampler, threshold)."""
    torch.manual_seed(0)
    log_prob = torch.log(torch.rand(2, 5) * 0.9 + 0.05).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    advantages = torch.tensor([[1.0] * 5, [-0.5] * 5])
    # the sampler gave tokens 0-1 the trainer's probability, tokens 2-3 a third of it, token 4 twice it
    shift = torch.tensor([0.0, 0.0, -np.log(3.0), -np.log(3.0), np.log(2.0)], dtype=torch.float32)
    sampler = log_prob.detach() + shift
    weights, metrics = algorithms.truncated_is_weights(log_prob, sampler, mask, threshold=2.0)
    expected = torch.tensor([1.0, 1.0, 2.0, 2.0, 0.5]) * mask  # a ratio of 3 is truncated at 2
    assert torch.allclose(weights, expected, atol=1e-6) and not weights.requires_grad
    assert metrics["actor/rollout_is_ratio_fraction_high"] == pytest.approx(4 / 9)

    def grad(is_weights):
        log_prob.grad = None
        loss, _ = algorithms.policy_loss(log_prob, log_prob.detach(), advantages, mask, ActorConfig(), 9, 2, 1,
                                         rollout_is_weights=is_weights)
        loss.backward()
        return log_prob.grad.clone()

    plain = grad(None)
    assert torch.allclose(grad(weights), plain * expected, atol=1e-7)
    assert torch.equal(grad(torch.ones_like(mask) * mask), plain)  # weights of 1: the on-policy gradient


def test_chunked_logprobs_and_entropy_equal_the_whole_computation(tiny_model_dir):
    """Chunks of 3 positions (and their backward, recomputed) against the full fp32 log-softmax in one piece."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = make_batch(seed=3, size=6, temperature=0.7)
    t = pad_batch(batch, pad_id=1, device=torch.device("cpu"))
    chunked, chunked_entropy = token_logprobs(model, t, 0.7, chunk=3)
    (chunked.sum() + chunked_entropy.sum()).backward()
    chunked_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole, whole_entropy = token_logprobs(model, t, 0.7, chunk=t["targets"].shape[1])
    (whole.sum() + whole_entropy.sum()).backward()
    assert t["targets"].shape[1] > 3  # more than one chunk
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked_entropy, whole_entropy, rtol=0, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked_grads[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_left_padded_batch_scores_like_each_sequence_alone(tiny_model_dir):
    """Padding never changes a token's logprob: the batch equals each row run on its own, unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(seed=4, size=5, temperature=1.0)
    with torch.no_grad():
        together, _ = token_logprobs(model, pad_batch(batch, 1, torch.device("cpu")), 1.0)
        for i in range(len(batch)):
            alone, _ = token_logprobs(model, pad_batch(batch.shard(i, len(batch)), 1, torch.device("cpu")), 1.0)
            n = len(batch.completion_ids[i])
            torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=0, atol=1e-5)


def test_length_buckets_pad_to_a_few_shapes_without_changing_any_logprob(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_tpu.logprobs import bucketed

    assert [bucketed(n, (16, 32)) for n in (1, 16, 17, 40)] == [16, 16, 32, 40]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(seed=6, size=4, temperature=1.0)
    plain = pad_batch(batch, 1, torch.device("cpu"))
    padded = pad_batch(batch, 1, torch.device("cpu"), buckets=(16, 32))
    assert padded["input_ids"].shape == (4, 16 + 16) and padded["targets"].shape == (4, 16)
    with torch.no_grad():
        exact, _ = token_logprobs(model, plain, 1.0)
        bucket, _ = token_logprobs(model, padded, 1.0)
    mask = plain["response_mask"].bool()
    torch.testing.assert_close(bucket[:, : exact.shape[1]][mask], exact[mask], rtol=0, atol=1e-5)
