"""The `algorithm` section: the advantage estimator, the reward's KL penalty, dynamic sampling and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class KLControlConfig:
    """verl's `algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`)."""

    type: str = "fixed"  # fixed, or adaptive (Ziegler et al., 2019): the coefficient steers the KL toward target_kl
    kl_coef: float = 0.001  # the coefficient (adaptive: its first value)
    horizon: int = 10000  # adaptive: sequences over which a 20% KL error changes the coefficient by 20%
    target_kl: float = 0.1  # adaptive: the per-token KL aimed at


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling, by verl's `algorithm.filter_groups` keys (rl_tpu/algorithms/learning_signal.py)."""

    enable: bool = False  # drop groups whose rewards are all equal and generate more until the batch is full
    metric: Optional[str] = None  # what must vary within a group: a reward's name (reward.combine); None: the score
    # generation batches per step at most; past it, groups without variation fill the rest (zero advantage)
    max_num_gen_batches: int = 10


@dataclass
class AlgorithmConfig:
    # verl's estimator: grpo, rloo, opo, gpg, gdpo, grpo_passk, reinforce_plus_plus(_baseline), grpo/rloo_vectorized.
    # verl's others need a critic or inputs rl_tpu does not make (algorithms.registry); or an import path mod:fn
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide each group's advantages by its reward std (false: Dr. GRPO)
    gamma: float = 1.0  # discount (reinforce_plus_plus)
    lam: float = 1.0
    # gdpo: the reward components normalised one by one (names in reward.combine), and their weights
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_filter: bool = False  # DAPO's overlong filtering: truncated completions are left out of the loss
    # each token's reward less kl_ctrl's coefficient times its KL to the reference model (the initial weights),
    # before the advantages, as verl's apply_kl_penalty (rl_tpu/algorithms/kl_reward.py)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # verl's estimator of that KL: kl (k1), abs, mse (k2), low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0  # linear learning-rate warm-up, in steps
    grad_clip: float = 1.0  # gradient norm clip
