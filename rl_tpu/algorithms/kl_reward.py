"""KL in the reward (`algorithm.use_kl_in_reward`): each token's reward less beta times its KL to the reference.

As verl's `apply_kl_penalty`: the KL of each completion token between the policy that sampled the
batch (the trainer's weights before the update, or the sampler's logprobs with
`actor.old_logprob_source=sampler`) and the reference model (the initial weights), by verl's
`kl_penalty` estimator; beta comes from verl's KL controller (`algorithm.kl_ctrl`: fixed, or adaptive
toward `target_kl`). The trainer computes the per-token KL (`TrainerWorker.token_kl`), this module
turns it into penalties, and the advantages subtract them from the token-level rewards. The
controller's coefficient is saved with each checkpoint, so a resumed run continues with it.
"""

from __future__ import annotations

import statistics

from rl_tpu.algorithms.core import validate_kl_estimator
from rl_tpu.config import AlgorithmConfig

KL_CONTROLLERS = ("fixed", "adaptive")


def validate(algo: AlgorithmConfig) -> None:
    ctrl = algo.kl_ctrl
    validate_kl_estimator("algorithm.kl_penalty", algo.kl_penalty)
    if ctrl.type not in KL_CONTROLLERS:
        raise ValueError(f"algorithm.kl_ctrl.type={ctrl.type!r}: allowed values are {', '.join(KL_CONTROLLERS)}")
    if ctrl.kl_coef < 0 or (ctrl.type == "adaptive" and not (ctrl.horizon > 0 and ctrl.target_kl > 0)):
        raise ValueError(
            f"algorithm.kl_ctrl.kl_coef={ctrl.kl_coef} must be >= 0, and an adaptive controller needs "
            f"horizon > 0 and target_kl > 0 (got {ctrl.horizon}, {ctrl.target_kl})"
        )


class KLInReward:
    """verl's KL controller and the penalties it sets; `coef` is its current beta."""

    def __init__(self, algo: AlgorithmConfig, coef: float | None = None):
        """`coef`: the coefficient a checkpoint saved (None: `kl_ctrl.kl_coef`)."""
        from verl.trainer.ppo import core_algos

        self.controller = core_algos.get_kl_controller(algo.kl_ctrl)
        if coef is not None:
            self.controller.value = coef

    @property
    def coef(self) -> float:
        return float(self.controller.value)

    def penalties(
        self, token_kl: list[list[float]], masks: list[list[int]] | None = None
    ) -> tuple[list[list[float]], dict[str, float]]:
        """Each token's penalty (beta * KL), then the controller's update from the batch's mean KL, as verl does:
        the mean over sequences of each one's mean over its tokens, counted as one step per sequence. With
        `masks` (episodes), only the model's tokens count and carry a penalty; the environment's get none."""
        beta = self.coef
        if masks is not None:
            token_kl = [[kl if keep else 0.0 for kl, keep in zip(row, mask)] for row, mask in zip(token_kl, masks)]
        counts = [sum(mask) for mask in masks] if masks is not None else [len(row) for row in token_kl]
        current = statistics.fmean(sum(row) / n if n else 0.0 for row, n in zip(token_kl, counts))
        self.controller.update(current_kl=current, n_steps=len(token_kl))
        return [[beta * kl for kl in row] for row in token_kl], {
            "actor/reward_kl_penalty": current,
            "actor/reward_kl_penalty_coeff": beta,
        }
