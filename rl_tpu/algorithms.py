"""Advantages and losses, computed with verl's own `core_algos` so results match verl exactly.

This module is the only place that calls verl. It adapts our plain tensors and config
dataclasses to verl's function signatures.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from rl_tpu.config import ActorConfig, AlgorithmConfig, value_of

# Outcome-reward estimators that normalise within a prompt's group and share verl's signature.
GROUP_ADV_ESTIMATORS = ("grpo", "rloo")


def validate_adv_estimator(name: str) -> None:
    if name not in GROUP_ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={name!r}: allowed values are {', '.join(GROUP_ADV_ESTIMATORS)}")


# verl's KL estimators (core_algos.kl_penalty), by the names it accepts
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def validate_kl_loss_type(name: str) -> None:
    if name not in KL_PENALTIES:
        raise ValueError(f"actor.kl_loss_type={name!r}: allowed values are {', '.join(KL_PENALTIES)}")


def group_advantages(rewards: list[float], groups: list[int], cfg: AlgorithmConfig) -> list[float]:
    """One advantage per sequence from its outcome reward, normalised within its prompt group."""
    from verl.trainer.ppo import core_algos

    validate_adv_estimator(cfg.adv_estimator)
    scores = torch.tensor(rewards, dtype=torch.float32)[:, None]
    mask = torch.ones_like(scores)
    kwargs = {"norm_adv_by_std_in_grpo": cfg.norm_adv_by_std_in_grpo} if cfg.adv_estimator == "grpo" else {}
    estimator = core_algos.get_adv_estimator_fn(cfg.adv_estimator)
    advantages, _ = estimator(token_level_rewards=scores, response_mask=mask, index=np.asarray(groups), **kwargs)
    return advantages[:, 0].tolist()


@functools.lru_cache(maxsize=4)
def _verl_actor_config(clip_ratio: float, clip_low: float | None, clip_high: float | None, n: int):
    from verl.workers.config import ActorConfig as VerlActorConfig

    return VerlActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=n,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio if clip_low is None else clip_low,
        clip_ratio_high=clip_ratio if clip_high is None else clip_high,
    )


@functools.lru_cache(maxsize=1)
def _core_algos():
    from verl.trainer.ppo import core_algos

    return core_algos


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ActorConfig,
    global_tokens: int,
    global_seqs: int,
    dp_size: int,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss (+ optional KL and entropy terms) of one micro-batch.

    Normalised by the *global* token / sequence counts, so summing micro-batch gradients and
    averaging over data-parallel ranks gives exactly the loss of the whole batch.
    """
    core_algos = _core_algos()
    agg_mode = value_of(cfg.loss_agg_mode)
    verl_cfg = _verl_actor_config(cfg.clip_ratio, cfg.clip_ratio_low, cfg.clip_ratio_high, 1)
    batch_info = {"dp_size": dp_size, "batch_num_tokens": global_tokens, "global_batch_size": global_seqs}
    verl_cfg.global_batch_info.update(batch_info)
    loss, metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
        loss_agg_mode=agg_mode, config=verl_cfg, rollout_is_weights=rollout_is_weights,
    )
    if cfg.use_kl_loss:
        kl = core_algos.kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=cfg.kl_loss_type)
        kl_loss = core_algos.agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=agg_mode, **batch_info)
        loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["actor/kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
    if cfg.entropy_coeff != 0.0:
        entropy_loss = core_algos.agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=agg_mode, **batch_info)
        loss = loss - cfg.entropy_coeff * entropy_loss
    return loss, metrics


def truncated_is_weights(log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor,
                         threshold: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token truncated importance weights min(pi_trainer / pi_sampler, threshold), via verl.

    Async mode trains on rollouts the sampler made with weights up to `trainer.max_staleness`
    versions old; these weights correct the policy gradient for that (TIS).
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, metrics = compute_rollout_correction_weights(
        log_ratio=(log_prob - sampler_log_prob).detach(), response_mask=mask, rollout_is="token",
        rollout_is_threshold=threshold)
    keep = ("rollout_is_mean", "rollout_is_ratio_fraction_high")  # averages, so micro-batches can be pooled
    return weights, {f"actor/{k}": float(v) for k, v in metrics.items() if k in keep}
