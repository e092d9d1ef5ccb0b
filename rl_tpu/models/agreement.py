"""How far apart two models' next-token distributions are: the measures of the consistency certificate.

`python -m rl_tpu.consistency` scores fixed token sequences in the engine and in the trainer and
compares the two full log-softmax rows at every position here. The sampled-token logprob gap
(`actor/logprob_diff`) sees one token a position; these measures see the whole vocabulary, so a
disagreement on tokens the sampler rarely draws, or a flipped argmax, shows too. The bounds are the
ones a user can trust per dtype (docs/reliability.md gives the figures they were set from).
"""

from __future__ import annotations

import torch

# Per dtype, the most each measure may reach: past it the engine does not serve what the trainer trains.
# Set from the measured CPU figures (benchmarks/results/consistency_cpu_*.json), about 4x or more above the largest;
# docs/reliability.md gives both. The argmax share is reported, not bounded: a near tie may flip in any dtype.
BOUNDS: dict[str, dict[str, float]] = {
    "float32": {
        "kl_engine_trainer": 1e-8,
        "kl_trainer_engine": 1e-8,
        "tv_mean": 1e-5,
        "tv_max": 1e-4,
        "max_abs_logprob_diff": 1e-3,
    },
    "bfloat16": {
        "kl_engine_trainer": 2e-3,
        "kl_trainer_engine": 2e-3,
        "tv_mean": 0.02,
        "tv_max": 0.2,
        "max_abs_logprob_diff": 1.0,
    },
}


def agreement(engine: torch.Tensor, trainer: torch.Tensor) -> dict[str, float]:
    """The measures between two [positions, vocabulary] tables of log-probabilities (rows each sum to one once
    exponentiated): KL both ways and total variation (means over positions, and the largest TV), the largest
    absolute logprob difference over every entry, and the share of positions whose most likely token differs.
    Each row is renormalised in float64 first, so that rounding in the two sides' own sums cannot make a KL negative."""
    p, q = engine.double().log_softmax(-1), trainer.double().log_softmax(-1)
    kl_pq = (p.exp() * (p - q)).sum(-1)
    kl_qp = (q.exp() * (q - p)).sum(-1)
    tv = 0.5 * (p.exp() - q.exp()).abs().sum(-1)
    return {
        "positions": p.shape[0],
        "kl_engine_trainer": kl_pq.mean().item(),
        "kl_trainer_engine": kl_qp.mean().item(),
        "kl_engine_trainer_max": kl_pq.max().item(),
        "tv_mean": tv.mean().item(),
        "tv_max": tv.max().item(),
        "max_abs_logprob_diff": (p - q).abs().max().item(),
        "argmax_differs": (p.argmax(-1) != q.argmax(-1)).double().mean().item(),
    }


def exceeded(figures: dict[str, float], dtype: str) -> list[str]:
    """Each measure past its bound for `dtype`, as 'measure=value > bound' (empty: the pair agrees)."""
    return [
        f"{measure}={figures[measure]:.3g} > {bound:g}"
        for measure, bound in BOUNDS[dtype].items()
        if figures[measure] > bound
    ]
