"""Advantages and losses, computed with verl's own `core_algos` so results match verl exactly.

This module is the only place that calls verl's algorithms. It adapts our plain tensors and config
dataclasses to verl's function signatures and config objects: every advantage estimator verl
registers that needs no critic, and every policy loss in its registry, by verl's names and keys, and plug-ins by
import path through the same registries (`registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from rl_tpu.algorithms.registry import TURN_ESTIMATOR, core_algos, estimator_facts, loss_facts, policy_loss_fn
from rl_tpu.algorithms.turn_baseline import grpo_turn_advantages
from rl_tpu.config import ActorConfig, AlgorithmConfig, RunConfig

# verl's KL estimators (core_algos.kl_penalty) by the names it accepts; "+": that value, with the k2 gradient
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+")


def validate_kl_estimator(key: str, name: str) -> None:
    """`name`, set at `key`, is one of verl's KL estimators."""
    if name not in KL_PENALTIES:
        raise ValueError(f"{key}={name!r}: allowed values are {', '.join(KL_PENALTIES)}")


def validate_policy_loss(actor: ActorConfig) -> None:
    mode = actor.policy_loss.loss_mode
    loss_facts(mode)  # a known loss, or a plug-in that states its facts (registered into verl's registry)
    if mode == "dro" and not (actor.policy_loss.dro_beta or 0) > 0:
        raise ValueError(
            "actor.policy_loss.loss_mode=dro needs actor.policy_loss.dro_beta > 0 (the penalty's "
            f"coefficient); got {actor.policy_loss.dro_beta}"
        )
    if mode == "bypass_mode" and actor.rollout_is not in ("auto", "off"):
        raise ValueError(
            "actor.policy_loss.loss_mode=bypass_mode computes its own importance weights: set "
            "actor.policy_loss.rollout_correction.rollout_is instead of actor.rollout_is="
            f"{actor.rollout_is}"
        )
    loss_type = actor.policy_loss.rollout_correction.loss_type
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(
            f"actor.policy_loss.rollout_correction.loss_type={loss_type!r}: allowed values are ppo_clip, reinforce"
        )
    if actor.ppo_epochs < 1 or (actor.ppo_mini_batch_size is not None and actor.ppo_mini_batch_size < 1):
        raise ValueError(
            f"actor.ppo_epochs={actor.ppo_epochs} and actor.ppo_mini_batch_size="
            f"{actor.ppo_mini_batch_size} must be at least 1 (ppo_mini_batch_size null: the whole batch)"
        )


def why_zero_advantage_rows_count(actor: ActorConfig) -> str | None:
    """Why, under these settings, a row whose advantages are all zero changes the update (its key and value);
    None: it adds nothing to the loss or the gradient, so the trainer may leave it out."""
    mode = actor.policy_loss.loss_mode
    reason = loss_facts(mode).zero_advantage_rows_count
    if reason:
        return f"actor.policy_loss.loss_mode={mode}: {reason}"
    if actor.use_kl_loss:
        return "actor.use_kl_loss=true: the KL term of every row is in the loss"
    if actor.entropy_coeff != 0.0:
        return f"actor.entropy_coeff={actor.entropy_coeff}: the entropy of every row is in the loss"
    return None


def validate_truncated_sampling(cfg: RunConfig) -> None:
    """`sampler.top_p` < 1 or `sampler.top_k` > 0 only where nothing is trained (`trainer.total_steps=0`): the engine
    samples from the distribution cut to the kept tokens and renormalised, and reports those logprobs, while the
    trainer's are of the whole distribution. An evaluation's samples use no logprob."""
    s = cfg.sampler
    if cfg.trainer.total_steps and (s.top_p < 1.0 or s.top_k > 0):
        raise ValueError(
            f"sampler.top_p={s.top_p} and sampler.top_k={s.top_k}: the engine samples from the distribution "
            "truncated to the kept tokens and renormalised over them, and its logprobs are of that distribution; "
            "the trainer's are of the whole one, so the rollouts are not the trained policy's samples, and the "
            "PPO ratio, the importance weights (actor.rollout_is, bypass_mode) and the KL in the reward would "
            "compare two policies. Train with sampler.top_p=1.0 and sampler.top_k=-1 (sampler.temperature "
            "still applies); top_p and top_k are for evaluation-only runs (trainer.total_steps=0)"
        )


def validate(cfg: RunConfig, reward_names: list[str]) -> None:
    """The algorithm settings, checked before anything starts; each error names the key and what is allowed."""
    algo, actor = cfg.algorithm, cfg.actor
    estimator = estimator_facts(algo.adv_estimator)
    validate_kl_estimator("actor.kl_loss_type", actor.kl_loss_type)
    validate_policy_loss(actor)
    validate_truncated_sampling(cfg)
    if cfg.sampler.n < 2 and estimator.compares_group:
        raise ValueError(
            f"sampler.n={cfg.sampler.n}: {algo.adv_estimator} compares the completions of a prompt, "
            "so it needs sampler.n >= 2"
        )
    if algo.adv_estimator == "gdpo":
        unknown = set(algo.gdpo_reward_keys or ()) - set(reward_names)
        if not algo.gdpo_reward_keys or unknown:
            raise ValueError(
                f"algorithm.adv_estimator=gdpo normalises each reward component on its own: "
                f"algorithm.gdpo_reward_keys={algo.gdpo_reward_keys} must name some of this run's "
                f"rewards, {', '.join(reward_names)} (reward.combine)"
            )
    why = why_zero_advantage_rows_count(actor)
    if cfg.trainer.skip_zero_advantage_rows and why:
        raise ValueError(
            f"trainer.skip_zero_advantage_rows=true would change the update: {why}. Leave the key "
            "unset (null: rows are left out only where that changes nothing) or set it false"
        )
    mini = actor.ppo_mini_batch_size
    if mini is not None and (cfg.data.train_batch_size % mini or (mini * cfg.sampler.n) % cfg.trainer.world_size):
        raise ValueError(
            f"actor.ppo_mini_batch_size={mini} prompts must divide data.train_batch_size="
            f"{cfg.data.train_batch_size}, and its {mini * cfg.sampler.n} sequences must divide evenly "
            f"over trainer.world_size={cfg.trainer.world_size}"
        )


def _verl_algo_config(cfg: AlgorithmConfig):
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(
        adv_estimator=cfg.adv_estimator,
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
        gdpo_reward_keys=list(cfg.gdpo_reward_keys) if cfg.gdpo_reward_keys else None,
        gdpo_reward_weights=list(cfg.gdpo_reward_weights) if cfg.gdpo_reward_weights else None,
    )


def token_level(values: list[float], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, longest) tensors in verl's layout: each value on its row's last completion token, and the mask."""
    width = max(1, max(lengths))
    n = torch.tensor(lengths)
    mask = (torch.arange(width)[None, :] < n[:, None]).float()
    rewards = torch.zeros(len(values), width)
    rewards[torch.arange(len(values)), (n - 1).clamp(min=0)] = torch.tensor(values, dtype=torch.float32)
    return rewards, mask


def advantages(
    rewards: list[float],
    groups: list[int],
    lengths: list[int],
    cfg: AlgorithmConfig,
    components: dict[str, list[float]] | None = None,
    token_penalties: list[list[float]] | None = None,
    model_masks: list[list[int]] | None = None,
) -> list[list[float]]:
    """Each completion token's advantage from the outcome rewards, by `algorithm.adv_estimator`.

    Dispatched as verl's `ray_trainer.compute_advantage` does: the reward sits on each completion's
    last token, less each token's penalty in `token_penalties` (KL in the reward), `groups` is verl's
    `uid` (the prompt each completion answers), and `components` holds the reward's named parts
    (`gdpo` normalises them one by one). With `model_masks` (episodes), see `on_model_tokens`.
    """
    if cfg.adv_estimator == TURN_ESTIMATOR:
        return _grpo_turn(rewards, groups, lengths, cfg, token_penalties, model_masks)
    if model_masks is not None:
        return on_model_tokens(rewards, groups, lengths, cfg, components, token_penalties, model_masks)
    name = cfg.adv_estimator
    estimator_facts(name)  # refuses what rl_tpu cannot run; registers a plug-in in this process
    token_rewards, mask = token_level(rewards, lengths)
    for row, penalty in enumerate(token_penalties or ()):
        token_rewards[row, : len(penalty)] -= torch.tensor(penalty, dtype=torch.float32)
    index = np.asarray(groups)
    if name == "grpo":
        adv, _ = core_algos().compute_grpo_outcome_advantage(
            token_level_rewards=token_rewards,
            response_mask=mask,
            index=index,
            norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
        )
    else:
        kwargs = {
            "token_level_rewards": token_rewards,
            "response_mask": mask,
            "index": index,
            "config": _verl_algo_config(cfg),
        }
        if name == "gdpo":
            kwargs["non_tensor_batch"] = {k: np.asarray(v) for k, v in (components or {}).items()}
            # verl finds each completion's last token from the attention mask after the prompt columns
            kwargs["batch"] = {
                "prompts": torch.zeros(len(rewards), 1, dtype=torch.long),
                "attention_mask": torch.cat([torch.ones(len(rewards), 1, dtype=torch.long), mask.long()], dim=1),
            }
        adv, _ = core_algos().get_adv_estimator_fn(name)(**kwargs)
    return [row[:n].tolist() for row, n in zip(adv, lengths)]


def _grpo_turn(
    rewards: list[float],
    groups: list[int],
    lengths: list[int],
    cfg: AlgorithmConfig,
    token_penalties: list[list[float]] | None,
    model_masks: list[list[int]] | None,
) -> list[list[float]]:
    """`grpo_turn` (`turn_baseline`): the score is the outcome less the penalties of the model's tokens, as GRPO's
    sum of the token-level rewards; without episodes each completion is one turn."""
    masks = model_masks if model_masks is not None else [[1] * n for n in lengths]
    scores = list(rewards)
    for row, penalty in enumerate(token_penalties or ()):
        scores[row] -= sum(p for p, m in zip(penalty, masks[row]) if m)
    return grpo_turn_advantages(scores, groups, masks, cfg.norm_adv_by_std_in_grpo)


def on_model_tokens(
    rewards: list[float],
    groups: list[int],
    lengths: list[int],
    cfg: AlgorithmConfig,
    components: dict[str, list[float]] | None,
    token_penalties: list[list[float]] | None,
    model_masks: list[list[int]],
) -> list[list[float]]:
    """Episodes' advantages: every estimator runs on each episode's model tokens alone, side by side, with the
    outcome reward on the last of them, and the environment's tokens (tool results) get 0.

    So a model token's advantage is what the same tokens get without a tool turn between them, under every
    estimator, rather than whatever the estimator makes of masked tokens inside a row: verl's return loops have
    reset the running return at a masked token (earlier versions) or carried it across (0.9.1), and a reward
    sitting on a masked last token is dropped by the latter (tests/unit/test_algorithms.py checks each estimator).
    """
    kept = [[j for j, m in enumerate(mask) if m] for mask in model_masks]
    penalties = None
    if token_penalties is not None:
        penalties = [[row[j] for j in where] for row, where in zip(token_penalties, kept, strict=True)]
    compact = advantages(rewards, groups, [len(where) for where in kept], cfg, components, penalties)
    spread = [[0.0] * n for n in lengths]
    for row, where, values in zip(spread, kept, compact, strict=True):
        for j, value in zip(where, values, strict=True):
            row[j] = value
    return spread


def _verl_actor_config(actor: ActorConfig, response_length: int):
    """verl's ActorConfig with our `actor` keys (verl reads the losses' settings from it)."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.config import PolicyLossConfig

    p, rc = actor.policy_loss, actor.policy_loss.rollout_correction
    correction = RolloutCorrectionConfig(
        rollout_is=rc.rollout_is, rollout_is_threshold=rc.rollout_is_threshold, bypass_mode=True, loss_type=rc.loss_type
    )
    return VerlActorConfig(
        strategy="fsdp",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=actor.loss_scale_factor or response_length,
        tau_pos=actor.tau_pos,
        tau_neg=actor.tau_neg,
        policy_loss=PolicyLossConfig(
            loss_mode=p.loss_mode,
            clip_cov_ratio=p.clip_cov_ratio,
            clip_cov_lb=p.clip_cov_lb,
            clip_cov_ub=p.clip_cov_ub,
            kl_cov_ratio=p.kl_cov_ratio,
            ppo_kl_coef=p.ppo_kl_coef,
            dro_beta=p.dro_beta,
            rollout_correction=correction,
        ),
    )


def pooled(key: str, value) -> bool:
    """Whether a loss metric is a scalar average, which token-weighting pools over micro-batches (not a max)."""
    ndim = value.dim() if torch.is_tensor(value) else np.ndim(value)
    return ndim == 0 and not key.endswith(("_max", "_min", "_std", "_max_deviation"))


class DeviceScalars(TorchFunctionMode):
    """While entered, `Tensor.item()` gives the 0-d tensor itself, still on the device. verl's loss and correction
    functions read each metric with `.item()`, a host sync (three a micro-batch for the vanilla loss); this way a
    step reads every figure at once (rl_tpu/trainer/update.py). Only around verl's calls, which put the values in
    their metrics dict (every loss mode is checked against a plain call: tests/unit/test_algorithms.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item:
            return args[0].detach()
        return func(*args, **(kwargs or {}))


def on_device(metrics: dict, keep: Callable[[str, Any], bool]) -> dict[str, torch.Tensor | float]:
    """The kept metrics, 0-d tensors left on their device (detached) and numbers as they are."""
    return {k: v.detach() if torch.is_tensor(v) else float(v) for k, v in metrics.items() if keep(k, v)}


class PolicyLoss:
    """`actor.policy_loss.loss_mode` (+ the optional KL and entropy terms) of one micro-batch, via verl.

    Normalised by the *global* token / sequence counts of the update's mini-batch, so that summing
    micro-batch gradients and averaging over data-parallel ranks gives exactly the loss of the whole.
    """

    def __init__(self, actor: ActorConfig, response_length: int):
        validate_policy_loss(actor)
        self.actor = actor
        self.mode = actor.policy_loss.loss_mode
        self.agg_mode = actor.loss_agg_mode
        self.verl_cfg = _verl_actor_config(actor, response_length)
        self.facts = loss_facts(self.mode)
        self.loss_fn = policy_loss_fn(self.mode)  # in a trainer rank: a plug-in is registered here, at its start

    def __call__(
        self,
        log_prob: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        global_tokens: int,
        global_seqs: int,
        dp_size: int,
        ref_log_prob: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """The loss and its figures; the figures stay on the device (`DeviceScalars`)."""
        batch_info = {
            "dp_size": dp_size,
            "batch_num_tokens": global_tokens,
            "global_batch_size": global_seqs,
            "loss_scale_factor": self.verl_cfg.loss_scale_factor,
        }
        self.verl_cfg.global_batch_info.update(batch_info)
        with DeviceScalars():
            loss, metrics = self.loss_fn(
                old_log_prob=old_log_prob,
                log_prob=log_prob,
                advantages=advantages,
                response_mask=mask,
                loss_agg_mode=self.agg_mode,
                config=self.verl_cfg,
                rollout_is_weights=rollout_is_weights,
            )
        if self.facts.row_mean:  # a mean over this micro-batch's rows, made a share of the global mean
            loss = loss * (log_prob.shape[0] / global_seqs) * dp_size
        metrics = on_device(metrics, pooled)
        if self.actor.use_kl_loss:
            kl = core_algos().kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=self.actor.kl_loss_type)
            kl_loss = core_algos().agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=self.agg_mode, **batch_info)
            loss = loss + self.actor.kl_loss_coef * kl_loss
            metrics["actor/kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
        if self.actor.entropy_coeff != 0.0:
            entropy_loss = core_algos().agg_loss(
                loss_mat=entropy, loss_mask=mask, loss_agg_mode=self.agg_mode, **batch_info
            )
            loss = loss - self.actor.entropy_coeff * entropy_loss
        return loss, metrics


def rollout_is_level(actor: ActorConfig, async_mode: bool) -> str | None:
    """The importance weights the trainer applies: token, sequence, or None (bypass_mode computes its own)."""
    if actor.policy_loss.loss_mode == "bypass_mode":
        return None
    level = actor.rollout_is
    if level == "auto":
        return "token" if async_mode else None
    return None if level == "off" else level


def truncated_is_weights(
    log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor, threshold: float, level: str = "token"
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Truncated importance weights min(pi_trainer / pi_sampler, threshold), per token or per sequence, via verl.

    Async mode trains on rollouts the sampler made with weights up to `trainer.max_staleness`
    versions old, and a bf16 sampler's probabilities differ from the trainer's; these weights
    correct the policy gradient for either (TIS).
    """
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    with DeviceScalars():
        weights, metrics = compute_rollout_correction_weights(
            log_ratio=(log_prob - sampler_log_prob).detach(),
            response_mask=mask,
            rollout_is=level,
            rollout_is_threshold=threshold,
        )
    keep = ("rollout_is_mean", "rollout_is_ratio_fraction_high")  # averages, so micro-batches can be pooled
    return weights, {f"actor/{k}": v for k, v in on_device(metrics, lambda k, v: k in keep).items()}
