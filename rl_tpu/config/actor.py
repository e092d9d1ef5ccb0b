"""The `actor` section: the policy loss and its update settings, named as in verl's `actor_rollout_ref.actor`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_tpu.config.choices import LossAggMode, OldLogprobSource, RolloutIS
from rl_tpu.config.lora import LoraConfig


@dataclass
class RolloutCorrectionConfig:
    """`policy_loss.loss_mode=bypass_mode` only: verl's `rollout_correction` keys."""

    loss_type: str = "ppo_clip"  # ppo_clip (the ratio to the sampler is clipped) or reinforce (IS-weighted)
    rollout_is: Optional[str] = "token"  # token, sequence or null: the IS weights reinforce applies
    rollout_is_threshold: float = 2.0


@dataclass
class PolicyLossConfig:
    """verl's `actor.policy_loss`: which registered loss, and the settings only some losses read."""

    loss_mode: str = "vanilla"  # one of verl's (algorithms.registry.LOSS_FACTS) or an import path module:function
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens clipped
    clip_cov_lb: float = 1.0  # clip_cov: covariance bounds of the clipped tokens
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens given the KL term
    ppo_kl_coef: float = 0.1  # kl_cov: that term's coefficient
    dro_beta: Optional[float] = None  # dro: the penalty's coefficient (required)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class ActorConfig:
    """Policy-loss and update settings, named as in verl's `actor_rollout_ref.actor`."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio: float = 0.2  # PPO clip range, both sides unless the next two are set
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None  # above clip_ratio_low: DAPO's clip-higher
    clip_ratio_c: float = 3.0  # dual-clip PPO: the bound on the loss of negative-advantage tokens
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]  # how token losses become the batch's loss
    # seq-mean-token-sum-norm divides by this; None: sampler.response_length (a constant, as Dr. GRPO wants)
    loss_scale_factor: Optional[int] = None
    tau_pos: float = 1.0  # sapo: gate temperatures for positive and negative advantages
    tau_neg: float = 1.05
    # prompts per optimizer update (x sampler.n sequences); None: the whole batch, one update per epoch
    ppo_mini_batch_size: Optional[int] = None
    ppo_epochs: int = 1  # passes over the batch; each mini-batch of each pass is one optimizer update
    old_logprob_source: OldLogprobSource = OldLogprobSource.trainer  # the PPO ratio's denominator
    use_kl_loss: bool = False  # a KL penalty to the initial policy in the loss
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # verl's KL estimator: k1, k2 (mse), k3 (low_var_kl), abs; "+": k2 gradient
    entropy_coeff: float = 0.0  # entropy bonus
    # importance weights pi_trainer / pi_sampler, truncated (TIS): they correct stale or bf16 rollouts
    rollout_is: RolloutIS = RolloutIS.auto
    rollout_is_threshold: float = 2.0  # importance weights are truncated at this (TIS)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters on a frozen base (off at lora_rank 0)

    def __post_init__(self) -> None:
        if self.rollout_is_threshold <= 1.0:
            raise ValueError(f"actor.rollout_is_threshold={self.rollout_is_threshold} must be > 1")
        self.lora.__post_init__()
