"""Our batching of the GRPO loss equals verl's functions applied to the whole, unpadded batch."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import REPO, make_batch

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms.registry import LOSS_FACTS, REFUSED_ESTIMATORS, adv_estimators, estimator_facts, is_import_path
from rl_tpu.config import ActorConfig, AlgorithmConfig, LossAggMode, PolicyLossConfig, RunConfig
from rl_tpu.models.logprobs import pad_batch, token_logprobs
from rl_tpu.models.tiny import build_model
from rl_tpu.records import TrainBatch
from rl_tpu.trainer.update import micro_batches, rank_share


def small_model() -> torch.nn.Module:
    return build_model(
        vocab_size=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64, max_positions=64, seed=0
    )


def test_the_menus_are_verls_registries():
    """Every policy loss verl 0.9.1 registers has a facts record; every estimator is exposed or refused with a
    reason (plug-ins other tests registered aside)."""
    from verl.trainer.ppo import core_algos

    assert set(LOSS_FACTS) == {k for k in core_algos.POLICY_LOSS_REGISTRY if not is_import_path(k)}
    verls = {k for k in core_algos.ADV_ESTIMATOR_REGISTRY if not is_import_path(k)}
    assert set(adv_estimators()) | set(REFUSED_ESTIMATORS) == verls
    assert "gae" in REFUSED_ESTIMATORS and len(adv_estimators()) >= 10
    with pytest.raises(ValueError, match="'gae' is not supported: it needs a value model"):
        estimator_facts("gae")
    with pytest.raises(ValueError, match="allowed values are .*grpo.*rloo.*, or an import path module:function"):
        estimator_facts("gaee")


def test_grpo_advantages_match_group_normalisation():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    lengths = [3, 1, 2, 4, 2, 2, 5, 1]
    advantages = algorithms.advantages(rewards, groups, lengths, AlgorithmConfig())
    assert [len(a) for a in advantages] == lengths and all(len(set(a)) == 1 for a in advantages)
    for g in (0, 1):
        scores = torch.tensor([r for r, k in zip(rewards, groups) if k == g])
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)  # verl: unbiased std, eps 1e-6
        got = torch.tensor([a[0] for a, k in zip(advantages, groups) if k == g])
        torch.testing.assert_close(got, expected)
    unscaled = algorithms.advantages(rewards, groups, lengths, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    assert [a[0] for a in unscaled[:4]] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    rloo = algorithms.advantages(rewards, groups, lengths, AlgorithmConfig(adv_estimator="rloo"))
    # leave-one-out baseline: 1 - mean(0, 0, 1) and 0 - mean(1, 0, 1)
    assert [a[0] for a in rloo[:2]] == pytest.approx([2 / 3, -2 / 3])


def verl_advantages(name: str, rewards, groups, lengths, components=None):
    """verl's estimator called directly on a layout built here: each reward on its completion's last token."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos

    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    token_rewards = torch.zeros(len(rewards), width)
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        token_rewards[i, n - 1] = r
    config = AlgoConfig(
        adv_estimator=name, gamma=0.9, gdpo_reward_keys=["arithmetic", "format"], gdpo_reward_weights=[1.0, 0.5]
    )
    kwargs = dict(token_level_rewards=token_rewards, response_mask=mask, index=np.asarray(groups), config=config)
    if name == "gdpo":
        kwargs["non_tensor_batch"] = {k: np.asarray(v) for k, v in components.items()}
        kwargs["batch"] = {
            "prompts": torch.zeros(len(rewards), 3, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(len(rewards), 3), mask], dim=1).long(),
        }
    advantages, _ = core_algos.get_adv_estimator_fn(name)(**kwargs)
    return advantages, mask


@pytest.mark.parametrize("name", adv_estimators())
def test_every_estimator_equals_verls_own(name):
    rng = random.Random(1)
    lengths = [rng.randint(1, 6) for _ in range(12)]
    groups = [i // 4 for i in range(12)]
    components = {
        "arithmetic": [float(rng.random() < 0.5) for _ in lengths],
        "format": [float(rng.random() < 0.7) for _ in lengths],
    }
    rewards = [a + 0.5 * f for a, f in zip(components["arithmetic"], components["format"])]
    cfg = AlgorithmConfig(
        adv_estimator=name, gamma=0.9, gdpo_reward_keys=["arithmetic", "format"], gdpo_reward_weights=[1.0, 0.5]
    )
    ours = algorithms.advantages(rewards, groups, lengths, cfg, components)
    expected, mask = verl_advantages(name, rewards, groups, lengths, components)
    assert [len(a) for a in ours] == lengths
    got = torch.tensor([a + [0.0] * (max(lengths) - len(a)) for a in ours])
    torch.testing.assert_close(got, expected * mask, rtol=1e-5, atol=1e-6)
    assert got.abs().sum() > 0  # rewards that differ within groups: some advantage is not zero


def episode_batch(cut_after_tool: bool):
    """Two groups of 4 episodes: a first model turn, a tool result, a last model turn (with `cut_after_tool`, one
    episode ends on a tool result instead, as an episode cut at its budget could); the first of each group solved."""
    rng = random.Random(3)
    rows = []
    for i in range(8):
        first, env, last = rng.randint(2, 5), rng.randint(1, 4), rng.randint(1, 3)
        rows.append([1] * first + [0] * env + [1] * last + [0] * (2 if cut_after_tool and i == 0 else 0))
    rewards = [1.0 if i % 4 == 0 else 0.0 for i in range(8)]
    return rewards, [i // 4 for i in range(8)], rows


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("cut_after_tool", [False, True])
@pytest.mark.parametrize("name", adv_estimators())
def test_every_estimator_gives_an_episodes_model_turns_what_they_get_without_the_tool_turn(name, cut_after_tool, gamma):
    """Each model token's advantage is what the same tokens get with the environment's tokens taken out (any KL
    penalty on them too), and a tool result gets none: the first turn of a solved episode gains, under every
    estimator, even where the episode ends on a tool result (a reward verl's REINFORCE++ would drop there)."""
    rewards, groups, masks = episode_batch(cut_after_tool)
    cfg = AlgorithmConfig(adv_estimator=name, gamma=gamma, gdpo_reward_keys=["outcome"])
    components = {"outcome": rewards}
    rng = random.Random(4)
    penalties = [[0.01 * rng.random() * m for m in mask] for mask in masks]
    with_tools = algorithms.advantages(
        rewards, groups, [len(m) for m in masks], cfg, components, penalties, model_masks=masks
    )
    alone = algorithms.advantages(
        rewards,
        groups,
        [sum(m) for m in masks],
        cfg,
        components,
        [[p for p, m in zip(row, mask) if m] for row, mask in zip(penalties, masks)],
    )
    for row, mask, expected in zip(with_tools, masks, alone):
        assert [a for a, m in zip(row, mask) if not m] == [0.0] * (len(mask) - sum(mask))
        assert [a for a, m in zip(row, mask) if m] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    first_turn = with_tools[0][: masks[0].index(0)]
    if gamma == 1.0:
        assert min(first_turn) >= 0.0 and max(first_turn) > 0.0, first_turn


def verl_loss_config(mode: str, agg_mode: str):
    """The same settings as `actor_config(mode)` below, in verl's own config classes."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.config import PolicyLossConfig

    return VerlActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=agg_mode,
        loss_scale_factor=16,
        policy_loss=PolicyLossConfig(
            loss_mode=mode,
            clip_cov_ratio=0.2,
            clip_cov_lb=-5.0,
            clip_cov_ub=5.0,
            kl_cov_ratio=0.2,
            ppo_kl_coef=0.1,
            dro_beta=0.1,
            rollout_correction=RolloutCorrectionConfig(rollout_is="token", loss_type="reinforce"),
        ),
    )


def actor_config(mode: str, agg_mode: str) -> ActorConfig:
    actor = ActorConfig(clip_ratio_high=0.28, loss_agg_mode=LossAggMode(agg_mode), loss_scale_factor=16)
    actor.policy_loss = PolicyLossConfig(
        loss_mode=mode, clip_cov_ratio=0.2, clip_cov_lb=-5.0, kl_cov_ratio=0.2, dro_beta=0.1
    )
    actor.policy_loss.rollout_correction.loss_type = "reinforce"
    return actor


def reference_loss_and_grads(model, batch: TrainBatch, mode: str, agg_mode: str):
    """verl's registered loss on logprobs from one unpadded forward per sequence, the whole batch at once."""
    from verl.trainer.ppo import core_algos

    model.zero_grad(set_to_none=True)
    resp_len = max(len(c) for c in batch.completion_ids)
    rows = []
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        logits = model(input_ids=torch.tensor([p + c]), use_cache=False).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        lp = torch.log_softmax(logits.float() / batch.temperature, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        rows.append(torch.cat([lp, torch.zeros(resp_len - len(c))]))
    log_prob = torch.stack(rows)
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (resp_len - len(c)) for c in batch.completion_ids])
    old = torch.tensor([lp + [0.0] * (resp_len - len(lp)) for lp in batch.sampler_logprobs])
    adv = torch.tensor([a + [0.0] * (resp_len - len(a)) for a in batch.advantages])
    cfg = verl_loss_config(mode, agg_mode)
    cfg.global_batch_info.update(loss_scale_factor=16)
    torch.manual_seed(0)  # clip_cov picks among its candidate tokens at random
    loss, _ = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask, loss_agg_mode=agg_mode, config=cfg
    )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def our_loss_and_grads(
    model,
    batch: TrainBatch,
    actor: ActorConfig,
    micro_size: int,
    dp_size: int = 1,
    global_batch: TrainBatch | None = None,
):
    """The trainer's path; `global_batch` is the whole batch when `batch` is one rank's shard of it."""
    global_batch = global_batch or batch
    policy_loss = algorithms.PolicyLoss(actor, response_length=16)
    model.zero_grad(set_to_none=True)
    total = torch.zeros(())
    torch.manual_seed(0)
    for micro in micro_batches(batch, micro_size):
        t = pad_batch(micro, pad_id=1, device=torch.device("cpu"))
        log_prob, entropy = token_logprobs(model, t, batch.temperature)
        loss, _ = policy_loss(
            log_prob,
            t["sampler_logprobs"],
            t["advantages"],
            t["response_mask"],
            global_batch.num_tokens(),
            len(global_batch),
            dp_size,
            entropy=entropy,
        )
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(ours, reference) -> None:
    (loss, grads), (ref_loss, ref_grads) = ours, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        # rounding scales with the tensor's largest gradient (token-sum's reach 16): 1e-5 of it, over 10x the
        # 1.3e-6 measured across CPU kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_CBWR); 1e-6 at least
        atol = max(1e-6, 1e-5 * grad.abs().max().item())
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("mode", sorted(LOSS_FACTS))
def test_every_loss_mode_equals_verls_own_on_the_whole_batch(mode):
    """Micro-batches of 3 (their gradients summed) against verl's loss of the unpadded batch at once. clip_cov and
    kl_cov choose tokens by the statistics of the micro-batch they see (in verl too): one micro-batch of 8."""
    model, batch = small_model(), make_batch()
    micro = 8 if LOSS_FACTS[mode].micro_batch_statistics else 3
    reference = reference_loss_and_grads(model, batch, mode, "token-mean")
    assert_same(our_loss_and_grads(model, batch, actor_config(mode, "token-mean"), micro), reference)


@pytest.mark.parametrize("agg_mode", [m.value for m in LossAggMode])
@pytest.mark.parametrize("micro_size", [3, 8])
def test_micro_batched_loss_and_grads_equal_verl_for_every_aggregation(agg_mode, micro_size):
    model, batch = small_model(), make_batch()
    reference = reference_loss_and_grads(model, batch, "vanilla", agg_mode)
    assert_same(our_loss_and_grads(model, batch, actor_config("vanilla", agg_mode), micro_size), reference)


def test_data_parallel_shards_average_to_the_full_batch_gradient():
    """Each rank normalises by global counts times dp_size; FSDP's gradient average then equals the full batch."""
    model, batch = small_model(), make_batch(seed=3)
    actor = ActorConfig()
    _, full = our_loss_and_grads(model, batch, actor, micro_size=8)
    shard_grads = [
        our_loss_and_grads(model, batch.shard(r, 2), actor, 8, dp_size=2, global_batch=batch)[1] for r in range(2)
    ]
    for name, grad in full.items():
        torch.testing.assert_close((shard_grads[0][name] + shard_grads[1][name]) / 2, grad, rtol=1e-4, atol=1e-6)


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

    policy_loss = algorithms.PolicyLoss(ActorConfig(), response_length=5)

    def grad(is_weights):
        log_prob.grad = None
        loss, _ = policy_loss(log_prob, log_prob.detach(), advantages, mask, 9, 2, 1, rollout_is_weights=is_weights)
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
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked_entropy, whole_entropy, rtol=1e-5, atol=1e-6)
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
            torch.testing.assert_close(together[i, :n], alone[0, :n], rtol=1e-5, atol=1e-5)


def test_length_buckets_pad_to_a_few_shapes_without_changing_any_logprob(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rl_tpu.models.logprobs import bucketed

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
    torch.testing.assert_close(bucket[:, : exact.shape[1]][mask], exact[mask], rtol=1e-5, atol=1e-5)


def test_bucketed_shared_prompts_run_a_power_of_two_of_prompt_rows(tiny_model_dir):
    """With length buckets (compiled shapes), the prompts' forward runs 1, 2, 4 .. rows (at most the batch's):
    the last distinct prompt is repeated, and neither a logprob nor the count of real positions changes."""
    from transformers import AutoModelForCausalLM

    from rl_tpu.models.logprobs import forward_positions

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    batch = make_batch(seed=6, size=12, temperature=1.0)
    grouped = dataclasses.replace(batch, prompt_ids=[batch.prompt_ids[i - i % 4] for i in range(12)])  # 3 prompts
    five = dataclasses.replace(batch.shard(0, 2), prompt_ids=[batch.prompt_ids[max(i, 1)] for i in range(6)])
    cpu = torch.device("cpu")
    for rows, prompts, bucketed_prompts in [(grouped, 3, 4), (five, 5, 6)]:
        plain = pad_batch(rows, 1, cpu)
        shared = pad_batch(rows, 1, cpu, share_prompts=True)
        bucketed = pad_batch(rows, 1, cpu, buckets=(16, 32), share_prompts=True)
        assert (len(shared["prompt_rows"]), len(bucketed["prompt_rows"])) == (prompts, bucketed_prompts)
        # each distinct prompt once, and every completion token (the bucket's last column is padding)
        distinct = {tuple(p) for p in rows.prompt_ids}
        assert forward_positions(bucketed, rows)[0] == sum(map(len, distinct)) + sum(map(len, rows.completion_ids))
        # the host's count is what the attention masks hold: prompts' rows (repeats once) and completions but the last
        mask, prompt_len = shared["attention_mask"], shared["attention_mask"].shape[1] - shared["targets"].shape[1]
        counted = mask[shared["prompt_rows"], :prompt_len].sum() + mask[:, prompt_len:-1].sum()
        assert forward_positions(shared, rows) == (
            int(counted),
            len(shared["prompt_rows"]) * prompt_len + mask[:, prompt_len:-1].numel(),
        )
        assert forward_positions(plain, rows) == (int(plain["attention_mask"].sum()), plain["attention_mask"].numel())
        with torch.no_grad():
            exact, _ = token_logprobs(model, plain, 1.0)
            bucket, _ = token_logprobs(model, bucketed, 1.0)
        mask = plain["response_mask"].bool()
        torch.testing.assert_close(bucket[:, : exact.shape[1]][mask], exact[mask], rtol=1e-5, atol=1e-5)


def test_which_importance_weights_the_trainer_applies():
    """auto: token-level in async mode only; a bf16 synchronous run asks for them; bypass_mode has its own."""
    from rl_tpu.config import RolloutIS

    assert algorithms.rollout_is_level(ActorConfig(), async_mode=False) is None
    assert algorithms.rollout_is_level(ActorConfig(), async_mode=True) == "token"
    assert algorithms.rollout_is_level(ActorConfig(rollout_is=RolloutIS.token), async_mode=False) == "token"
    assert algorithms.rollout_is_level(ActorConfig(rollout_is=RolloutIS.off), async_mode=True) is None
    bypass = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="bypass_mode"))
    assert algorithms.rollout_is_level(bypass, async_mode=True) is None
    log_prob = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    sampler = torch.log(torch.tensor([[0.25, 0.5, 1.0]]))  # token ratios 2, 1, 0.5: the sequence's product is 1
    mask = torch.ones(1, 3)
    tokens, _ = algorithms.truncated_is_weights(log_prob, sampler, mask, 1.5, "token")
    sequence, _ = algorithms.truncated_is_weights(log_prob, sampler, mask, 1.5, "sequence")
    torch.testing.assert_close(tokens, torch.tensor([[1.5, 1.0, 0.5]]))
    torch.testing.assert_close(sequence, torch.tensor([[1.0, 1.0, 1.0]]))


def batch_with_rows_without_signal() -> TrainBatch:
    """Twelve rows; group 1 (rows 4-7) scored alike, so its advantages are zero, and row 9 is out of the loss."""
    batch = make_batch(seed=3, size=12)  # every group of 4 has scores that vary
    advantages = [[0.0] * len(a) if 4 <= i < 8 else a for i, a in enumerate(batch.advantages)]
    loss_mask = [i != 9 for i in range(len(batch))]
    return dataclasses.replace(batch, advantages=advantages, loss_mask=loss_mask)


@pytest.mark.parametrize(
    "mode,agg_mode",
    [(mode, "token-mean") for mode in sorted(LOSS_FACTS)]
    + [("vanilla", m.value) for m in LossAggMode if m.value != "token-mean"],
)
def test_rows_without_advantage_add_nothing_to_loss_and_gradients_under_every_loss_not_listed(mode, agg_mode):
    """The trainer leaves out rows with all-zero advantages, and rows out of the loss, under every loss but those
    whose facts say they count (`LossFacts.zero_advantage_rows_count`): the rest must give the whole batch's loss and gradients (the
    normalisers keep the whole batch's counts), and each listed loss must indeed need those rows."""
    model, batch = small_model(), batch_with_rows_without_signal()
    kept = batch.rows_with_signal(multiple=1)
    assert len(kept) == 7 and all(any(a) for a in kept.advantages) and kept.num_tokens() < batch.num_tokens()
    micro = 12 if LOSS_FACTS[mode].micro_batch_statistics else 3
    actor = actor_config(mode, agg_mode)
    whole = our_loss_and_grads(model, batch, actor, micro)
    trained = our_loss_and_grads(model, kept, actor, micro, global_batch=batch)
    if not LOSS_FACTS[mode].zero_advantage_rows_count:
        assert algorithms.why_zero_advantage_rows_count(actor) is None
        assert_same(trained, whole)
        return
    assert mode in algorithms.why_zero_advantage_rows_count(actor)
    with pytest.raises(AssertionError):
        assert_same(trained, whole)


def test_rows_kept_for_the_gradient_split_evenly_over_ranks():
    """Rows with signal, topped up with the shortest others to a multiple (of the ranks, or of ranks times
    micro-batch rows), in batch order."""
    batch = batch_with_rows_without_signal()
    lengths = [len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)]
    signal = [0, 1, 2, 3, 8, 10, 11]
    for multiple, size in [(1, 7), (2, 8), (4, 8), (8, 8), (16, 12)]:
        kept = batch.rows_with_signal(multiple)
        rows = [batch.completion_ids.index(c) for c in kept.completion_ids]
        assert len(kept) == size and rows == sorted(rows) and set(signal) <= set(rows)
        extra = sorted(set(rows) - set(signal), key=lambda i: lengths[i])
        others = sorted(set(range(12)) - set(signal), key=lambda i: lengths[i])
        assert [lengths[i] for i in extra] == [lengths[i] for i in others[: len(extra)]]
    none = dataclasses.replace(batch, advantages=[[0.0] * len(a) for a in batch.advantages])
    assert len(none.rows_with_signal(2)) == 2  # one row per rank: every rank still steps its optimizer


@pytest.mark.parametrize("mode", sorted(LOSS_FACTS))
def test_only_the_listed_losses_depend_on_which_rows_share_a_micro_batch(mode):
    """trainer.micro_batch_size, world_size and sort_by_length decide which rows share a micro-batch. A resume may
    change them (controller/checks.py) under every loss but those whose facts say `micro_batch_statistics`: the loss
    and gradients of any split equal those of the whole batch at once, and under each listed loss they do not."""
    model, batch = small_model(), make_batch()
    actor = actor_config(mode, "token-mean")
    whole = our_loss_and_grads(model, batch, actor, micro_size=8)
    ranks = [our_loss_and_grads(model, batch.shard(r, 2), actor, 8, dp_size=2, global_batch=batch) for r in (0, 1)]
    splits = {
        "micro_batch_size=3": our_loss_and_grads(model, batch, actor, micro_size=3),
        "sort_by_length, micro_batch_size=3": our_loss_and_grads(model, batch.sorted_by_length(), actor, 3),
        "world_size=2": (  # FSDP averages the ranks' gradients
            (ranks[0][0] + ranks[1][0]) / 2,
            {name: (ranks[0][1][name] + ranks[1][1][name]) / 2 for name in whole[1]},
        ),
    }
    differ = []
    for split, result in splits.items():
        try:
            assert_same(result, whole)
        except AssertionError:
            differ.append(split)
    assert differ == (list(splits) if LOSS_FACTS[mode].micro_batch_statistics else [])


def test_a_batch_that_would_give_ranks_unequal_shares_is_refused():
    """Unequal shares would run unequal numbers of forwards, and FSDP's paired collectives would hang the step."""
    batch = make_batch(seed=3, size=6)
    halves = [rank_share(batch, rank, 2).completion_ids for rank in (0, 1)]
    assert halves == [batch.completion_ids[:3], batch.completion_ids[3:]]
    with pytest.raises(ValueError, match="a batch of 6 rows does not divide evenly over 4 ranks"):
        rank_share(batch, 3, 4)


def test_skipping_rows_is_refused_where_they_count():
    cfg = RunConfig()
    cfg.trainer.skip_zero_advantage_rows = True
    algorithms.validate(cfg, ["arithmetic"])
    cfg.actor.use_kl_loss = True
    with pytest.raises(ValueError, match="skip_zero_advantage_rows=true.*actor.use_kl_loss"):
        algorithms.validate(cfg, ["arithmetic"])
    cfg.actor.use_kl_loss, cfg.actor.entropy_coeff = False, 0.01
    assert "actor.entropy_coeff" in algorithms.why_zero_advantage_rows_count(cfg.actor)
    cfg.trainer.skip_zero_advantage_rows = None  # unset: the trainer runs every row, nothing is refused
    algorithms.validate(cfg, ["arithmetic"])


@pytest.mark.parametrize("mode", sorted(LOSS_FACTS))
def test_every_loss_modes_figures_stay_on_the_device_and_equal_a_plain_call(mode):
    """`DeviceScalars` around verl's loss keeps its `.item()` figures as tensors; read, they are the plain call's."""
    torch.manual_seed(0)
    log_prob = torch.log(torch.rand(4, 6) * 0.9 + 0.05)
    old, advantages = log_prob + 0.1 * torch.randn(4, 6), torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.2).float()
    policy_loss = algorithms.PolicyLoss(actor_config(mode, "token-mean"), response_length=6)
    args = (log_prob, old, advantages, mask, int(mask.sum()), 4, 1)
    torch.manual_seed(1)  # clip_cov picks among its candidate tokens at random
    deferred_loss, deferred = policy_loss(*args)
    torch.manual_seed(1)
    with mock.patch.object(algorithms, "DeviceScalars", contextlib.nullcontext):
        plain_loss, plain = policy_loss(*args)
    assert deferred.keys() == plain.keys()  # gpg reports none
    assert all(torch.is_tensor(v) for v in deferred.values())  # read once a step, not here
    assert {k: float(v) for k, v in deferred.items()} == pytest.approx({k: float(v) for k, v in plain.items()})
    assert torch.equal(deferred_loss, plain_loss)


def test_the_batch_layout_puts_every_token_in_its_place(tiny_model_dir):
    """pad_batch's one vectorised pass against the layout written out row by row: prompts end in column P-1,
    completions start at P, the loss mask holds in-loss sequences' model tokens only."""
    batch = make_batch(seed=9, size=6)
    batch = dataclasses.replace(
        batch,
        completion_ids=[*batch.completion_ids[:5], []],  # an empty completion
        sampler_logprobs=[*batch.sampler_logprobs[:5], []],
        advantages=[*batch.advantages[:5], []],
        loss_mask=[True, False, True, True, True, True],
        model_masks=[[i % 2 for i in range(len(c))] for c in batch.completion_ids[:5]] + [[]],
    )
    t = pad_batch(batch, 7, torch.device("cpu"), buckets=(16,))
    prompt_len, resp_len = 16, 16
    for i, (p, c) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        row = [7] * (prompt_len - len(p)) + p + c + [7] * (resp_len - len(c))
        assert t["input_ids"][i].tolist() == row
        assert t["attention_mask"][i].tolist() == [0] * (prompt_len - len(p)) + [1] * (len(p) + len(c)) + [0] * (
            resp_len - len(c)
        )
        assert t["targets"][i].tolist() == c + [7] * (resp_len - len(c))
        in_loss = [float(batch.loss_mask[i] and m) for m in batch.model_masks[i]]
        assert t["response_mask"][i].tolist() == in_loss + [0.0] * (resp_len - len(c))
        assert t["sampler_logprobs"][i, : len(c)].tolist() == pytest.approx(batch.sampler_logprobs[i], rel=1e-6)
        assert t["advantages"][i, : len(c)].tolist() == pytest.approx(batch.advantages[i], rel=1e-6)
        assert t["position_ids"][i, prompt_len - len(p) : prompt_len + len(c)].tolist() == list(range(len(p) + len(c)))


@pytest.fixture
def plugins(monkeypatch):
    """tests/fixtures on the path: its `custom_losses` module is found by import path, as a user's own module is."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures"))


def test_a_loss_and_an_estimator_by_import_path_go_through_verls_registries(plugins):
    """A plug-in is registered under its import path: verl's own dispatch finds it, the trainer's loss and the
    advantages compute with it, and the checks apply its facts."""
    import custom_losses
    from verl.trainer.ppo import core_algos

    cfg = RunConfig()
    cfg.actor.policy_loss.loss_mode = "custom_losses:halved_vanilla"
    cfg.algorithm.adv_estimator = "custom_losses:doubled_rloo"
    algorithms.validate(cfg, ["arithmetic"])
    assert core_algos.get_policy_loss_fn("custom_losses:halved_vanilla") is custom_losses.halved_vanilla
    assert core_algos.get_adv_estimator_fn("custom_losses:doubled_rloo") is custom_losses.doubled_rloo

    torch.manual_seed(0)
    log_prob = torch.log(torch.rand(4, 6) * 0.9 + 0.05)
    args = (log_prob, log_prob + 0.1 * torch.randn(4, 6), torch.randn(4, 6), torch.ones(4, 6), 24, 4, 1)
    halved, metrics = algorithms.PolicyLoss(cfg.actor, response_length=6)(*args)
    vanilla, _ = algorithms.PolicyLoss(ActorConfig(), response_length=6)(*args)
    torch.testing.assert_close(halved, 0.5 * vanilla)
    assert metrics["actor/halved_vanilla"] == 1.0

    rewards, groups, lengths = [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [3, 1, 2, 4]
    doubled = algorithms.advantages(rewards, groups, lengths, cfg.algorithm)
    rloo = algorithms.advantages(rewards, groups, lengths, AlgorithmConfig(adv_estimator="rloo"))
    assert [a[0] for a in doubled] == pytest.approx([2 * a[0] for a in rloo])
    cfg.sampler.n = 1  # its facts say it compares a prompt's completions
    with pytest.raises(ValueError, match="sampler.n=1: custom_losses:doubled_rloo compares the completions"):
        algorithms.validate(cfg, ["arithmetic"])


def test_a_plugin_losss_facts_decide_what_the_trainer_may_skip_and_how_it_scales(plugins):
    """`counted_vanilla` says rows without advantage count: the trainer keeps them and skipping them is refused.
    `geo_mean_rows` says it is a row mean: micro-batched, it still equals verl's loss of the whole batch."""
    actor = actor_config("custom_losses:counted_vanilla", "token-mean")
    assert "loss_mode=custom_losses:counted_vanilla: its author says so" in algorithms.why_zero_advantage_rows_count(
        actor
    )
    cfg = RunConfig(actor=actor)
    cfg.trainer.skip_zero_advantage_rows = True
    with pytest.raises(ValueError, match="skip_zero_advantage_rows=true would change the update: .*its author"):
        algorithms.validate(cfg, ["arithmetic"])
    assert algorithms.why_zero_advantage_rows_count(actor_config("custom_losses:halved_vanilla", "token-mean")) is None
    model, batch = small_model(), make_batch()
    reference = reference_loss_and_grads(model, batch, "geo_mean", "token-mean")
    assert_same(
        our_loss_and_grads(model, batch, actor_config("custom_losses:geo_mean_rows", "token-mean"), 3), reference
    )


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("loss_mode", "custom_losses:no_facts", r"states no facts: set no_facts.loss_facts = LossFacts\(zero_adv"),
        ("loss_mode", "custom_losses:doubled_rloo", "states no facts: set doubled_rloo.loss_facts"),  # an estimator
        ("loss_mode", "custom_losses:absent", "custom_losses has no function absent"),
        ("loss_mode", "no_such_module:loss", "cannot import no_such_module .*: on PYTHONPATH, or under the folder"),
        ("loss_mode", "custom_losses", "allowed values are vanilla, .*, or an import path module:function"),
        (
            "adv_estimator",
            "custom_losses:halved_vanilla",
            "states no facts: set halved_vanilla.estimator_facts = Estim",
        ),
        ("adv_estimator", "custom_losses:absent", "custom_losses has no function absent"),
    ],
)
def test_a_plugin_that_cannot_be_used_is_refused_naming_the_key(plugins, key, value, message):
    cfg = RunConfig()
    section = cfg.actor.policy_loss if key == "loss_mode" else cfg.algorithm
    setattr(section, key, value)
    full_key = "actor.policy_loss.loss_mode" if key == "loss_mode" else "algorithm.adv_estimator"
    with pytest.raises(ValueError, match=f"{full_key}='{value}'(: | ){message}"):
        algorithms.validate(cfg, ["arithmetic"])
