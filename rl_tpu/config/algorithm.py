"""The `algorithm` section: the advantage estimator, the reward's KL penalty, dynamic sampling, what each rollout
outcome does, and the optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_tpu.config.choices import OutcomePolicy

# kind -> (the policies it may not have, why): a truncation is the model's doing (retrying it until the model stops
# in time would train on its short answers only); a lost instance's reward is unknown (a zero is not what it earned)
REFUSED_POLICIES = {
    "truncated": (
        ("retry",),
        "a truncation is the model's doing: drawing again until it stops in time would train on short answers only",
    ),
    "lost": (("zero",), "a lost instance's reward is unknown: its zero is not what the episode earned"),
}


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
class OutcomesConfig:
    """What the learning signal does with a rollout of each outcome (`rl_tpu.records.Outcome`; a scored one is
    trained on): retry, mask, fail_group or zero (docs/algorithms.md#rollout-outcomes gives each default's reason)."""

    reward_error: OutcomePolicy = OutcomePolicy.mask  # a reward raised, returned a non-number or crashed its worker
    timeout: OutcomePolicy = OutcomePolicy.mask  # a reward or a tool call ran past its deadline
    tool_failure: OutcomePolicy = OutcomePolicy.mask  # a tool raised on well-formed arguments, or its worker was down
    truncated: OutcomePolicy = OutcomePolicy.zero  # cut at a length or turn limit (retry is refused)
    lost: OutcomePolicy = OutcomePolicy.mask  # a per-episode tool instance lost with its worker (zero is refused)
    max_retries: int = 2  # times a rollout of a retried outcome is played or graded again, at most
    fallback: OutcomePolicy = OutcomePolicy.mask  # a retried outcome's policy once its retries ran out (not retry)

    def policy(self, kind: str) -> OutcomePolicy:
        """The policy that decides a rollout of `kind` in a batch: a retried kind's rollout that is still of that kind
        has used its retries, so its fallback decides; a scored rollout is trained on (zero: as graded)."""
        if kind == "scored":
            return OutcomePolicy.zero
        chosen = OutcomePolicy(getattr(self, kind))
        return OutcomePolicy(self.fallback) if chosen == OutcomePolicy.retry else chosen

    def retried(self, kind: str | None) -> bool:
        """Whether a rollout of `kind` is played or graded again (while it has retries left)."""
        return kind not in (None, "scored") and getattr(self, kind) == OutcomePolicy.retry

    def __post_init__(self) -> None:
        kinds = ("reward_error", "timeout", "tool_failure", "truncated", "lost")
        allowed = ", ".join(OutcomePolicy)
        for key in (*kinds, "fallback"):
            if getattr(self, key) not in set(OutcomePolicy):
                raise ValueError(f"algorithm.outcomes.{key}={getattr(self, key)!r}: allowed values are {allowed}")
        for kind, (refused, why) in REFUSED_POLICIES.items():
            if getattr(self, kind) in refused:
                rest = ", ".join(p for p in OutcomePolicy if p not in refused)
                raise ValueError(f"algorithm.outcomes.{kind}={getattr(self, kind)}: {why}; allowed values are {rest}")
        if self.fallback == OutcomePolicy.retry:
            raise ValueError("algorithm.outcomes.fallback=retry: allowed values are mask, fail_group, zero")
        if self.lost == OutcomePolicy.retry and self.fallback == OutcomePolicy.zero:
            raise ValueError(
                f"algorithm.outcomes.fallback=zero with algorithm.outcomes.lost=retry: {REFUSED_POLICIES['lost'][1]}; "
                "set the fallback to mask or fail_group"
            )
        if self.max_retries < 0 or (self.max_retries == 0 and any(self.retried(k) for k in kinds)):
            raise ValueError(
                f"algorithm.outcomes.max_retries={self.max_retries} must be >= 0, and >= 1 where an outcome is set to "
                "retry"
            )


@dataclass
class AlgorithmConfig:
    # verl's estimator: grpo, rloo, opo, gpg, gdpo, grpo_passk, reinforce_plus_plus(_baseline), grpo/rloo_vectorized.
    # verl's others need a critic or inputs rl_tpu does not make (algorithms.registry); rl_tpu's grpo_turn (a
    # baseline per model turn, for episodes: algorithms.turn_baseline); or an import path mod:fn
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide each group's advantages by its reward std (false: Dr. GRPO)
    gamma: float = 1.0  # discount (reinforce_plus_plus)
    lam: float = 1.0
    # gdpo: the reward components normalised one by one (names in reward.combine), and their weights
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    # DAPO's overlong filtering: truncated completions are left out of the loss (kept in their group's statistics)
    overlong_filter: bool = False
    outcomes: OutcomesConfig = field(default_factory=OutcomesConfig)  # what each rollout outcome does
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
