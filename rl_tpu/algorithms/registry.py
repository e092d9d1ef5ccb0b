"""The policy losses and advantage estimators by name: verl's own, and plug-ins by import path.

`actor.policy_loss.loss_mode` and `algorithm.adv_estimator` take a verl name or an import path,
`my_pkg.losses:my_loss`. A plug-in is registered into verl's own registry under that string (so verl's dispatch,
`get_policy_loss_fn` / `get_adv_estimator_fn`, finds it) in each process that looks it up: the driver at its checks
and for the advantages, and each trainer rank as it builds its loss (Ray's actors import fresh, so a registration in
the driver alone would not reach them).

The trainer must know facts of a loss that its code does not say (`LossFacts`): stated once, here for verl's and as
the `loss_facts` attribute of a plug-in's function. A plug-in that states none is refused, since a guess would
silently change `trainer.skip_zero_advantage_rows`, the loss's scale or which settings a resume may change.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

LOSS_KEY = "actor.policy_loss.loss_mode"
ESTIMATOR_KEY = "algorithm.adv_estimator"
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class LossFacts:
    """What the trainer must know of a policy loss; every field is stated (no default guesses one)."""

    ATTRIBUTE: ClassVar[str] = "loss_facts"  # where a plug-in's function holds its record

    # why a row whose advantages are all zero still changes the update; None: such a row adds exactly zero to the
    # loss and its gradient, so the trainer may leave it out (trainer.skip_zero_advantage_rows)
    zero_advantage_rows_count: str | None
    # its scalar is a plain mean over the micro-batch's rows (not verl's `agg_loss` with the global counts): the
    # trainer rescales it to that micro-batch's share of the global mean
    row_mean: bool
    # it picks tokens by statistics of the micro-batch it sees: the keys that decide which rows share a micro-batch
    # change the loss, so a resume may not change them
    micro_batch_statistics: bool


@dataclass(frozen=True)
class EstimatorFacts:
    """What the checks must know of an advantage estimator."""

    ATTRIBUTE: ClassVar[str] = "estimator_facts"

    compares_group: bool  # it compares the completions of one prompt: it needs sampler.n >= 2


_PLAIN = LossFacts(zero_advantage_rows_count=None, row_mean=False, micro_batch_statistics=False)
# each loss verl 0.9.1 registers (core_algos.POLICY_LOSS_REGISTRY); tests/unit/test_algorithms.py checks every fact
LOSS_FACTS = {
    "vanilla": _PLAIN,  # PPO-clip (dual-clip below with clip_ratio_c)
    "gspo": _PLAIN,  # sequence-level ratio (GSPO)
    "gpg": _PLAIN,  # no ratio: -A * logprob (GPG)
    "clip_cov": LossFacts(  # clip the tokens of highest covariance (Clip-Cov)
        "it picks the tokens it clips by statistics of the rows it sees", row_mean=False, micro_batch_statistics=True
    ),
    "kl_cov": LossFacts(  # a KL term on the tokens of highest covariance (KL-Cov)
        "it picks the tokens it penalises by statistics of the rows it sees",
        row_mean=False,
        micro_batch_statistics=True,
    ),
    "geo_mean": LossFacts(None, row_mean=True, micro_batch_statistics=False),  # geometric mean of ratios (GMPO)
    "cispo": _PLAIN,  # clipped IS weight times the logprob gradient (CISPO)
    "sapo": _PLAIN,  # soft gates instead of hard clipping (SAPO; aggregates seq-mean-token-mean)
    "dppo_kl": _PLAIN,  # divergence-based trust region, KL (DPPO)
    "dppo_tv": _PLAIN,  # divergence-based trust region, total variation (DPPO)
    "dro": LossFacts(  # quadratic log-ratio penalty (needs policy_loss.dro_beta)
        "its penalty on the log-ratio does not scale with the advantage", row_mean=False, micro_batch_statistics=False
    ),
    "bypass_mode": _PLAIN,  # old logprobs are the sampler's; PPO-clip or REINFORCE (rollout_correction)
}

# verl registers these, but each needs an input rl_tpu does not produce: refused at start, with the reason
REFUSED_ESTIMATORS = {
    "gae": "it needs a value model (critic), and rl_tpu trains none",
    "remax": "it needs a greedy rollout of every prompt as its baseline, and rl_tpu does not generate one",
    "optimal_token_baseline": "it needs the actor's sum of squared token probabilities before the advantages "
    "(actor.calculate_sum_pi_squared in verl), and rl_tpu's trainer does not compute it",
    "tir_optimal_token_baseline": "it needs the actor's sum of squared token probabilities (as "
    "optimal_token_baseline) and multi-turn rollouts",
}
# verl's estimators that compare the completions of one prompt: they need sampler.n >= 2
GROUP_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "gdpo",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
)


@functools.lru_cache(maxsize=1)
def core_algos():
    """verl's `core_algos`, imported on first use (`rl-tpu --help` stays quick)."""
    from verl.trainer.ppo import core_algos

    return core_algos


TURN_ESTIMATOR = "grpo_turn"  # rl_tpu's own: GRPO with a baseline per model turn (turn_baseline)
OWN_ESTIMATORS = {TURN_ESTIMATOR: EstimatorFacts(compares_group=True)}


def is_import_path(name: str) -> bool:
    return IMPORT_PATH.fullmatch(name) is not None


def adv_estimators() -> list[str]:
    """verl's estimators that rl_tpu runs: its registry less plug-ins and those that need what rl_tpu lacks."""
    return sorted(
        k for k in core_algos().ADV_ESTIMATOR_REGISTRY if not is_import_path(k) and k not in REFUSED_ESTIMATORS
    )


def estimator_names() -> list[str]:
    """Every `algorithm.adv_estimator` name rl_tpu runs: verl's and its own."""
    return sorted([*adv_estimators(), *OWN_ESTIMATORS])


def allowed(names: list[str], facts: type) -> str:
    """The refusal's list: the built-in names and the import-path form."""
    return (
        f"allowed values are {', '.join(names)}, or an import path module:function (a function with verl's "
        f"signature whose `{facts.ATTRIBUTE}` attribute is a rl_tpu.algorithms.registry.{facts.__name__})"
    )


def plugin(key: str, path: str, facts: type) -> tuple[Callable, LossFacts | EstimatorFacts]:
    """The function at import path `path`, set at `key`, and the facts it states; refused naming the key."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{key}={path!r}: cannot import {module_name} ({err}). The module must be importable by the driver and "
            "by Ray's workers: on PYTHONPATH, or under the folder the run starts from"
        ) from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}={path!r}: {module_name} has no function {name}")
    stated = getattr(fn, facts.ATTRIBUTE, None)
    if not isinstance(stated, facts):
        fields = ", ".join(f"{f.name}=..." for f in dataclasses.fields(facts))
        raise ValueError(
            f"{key}={path!r} states no facts: set {name}.{facts.ATTRIBUTE} = {facts.__name__}({fields}) "
            "(rl_tpu.algorithms.registry, docs/extending.md). rl_tpu does not guess them: a wrong guess would "
            "change the update without an error"
        )
    return fn, stated


def registered(key: str, path: str, facts: type, registry: dict, register: Callable) -> LossFacts | EstimatorFacts:
    """The plug-in at `path` registered into verl's `registry` (by verl's `register`) in this process; its facts."""
    fn, stated = plugin(key, path, facts)
    if registry.get(path) is not fn:
        register(path)(fn)
    return stated


def loss_facts(mode: str) -> LossFacts:
    """The facts of `actor.policy_loss.loss_mode=mode`; a plug-in's function is registered into verl's registry
    in this process. Refused, naming the key, where `mode` is neither."""
    if mode in LOSS_FACTS:
        return LOSS_FACTS[mode]
    if not is_import_path(mode):
        raise ValueError(f"{LOSS_KEY}={mode!r}: {allowed(list(LOSS_FACTS), LossFacts)}")
    verl = core_algos()
    return registered(LOSS_KEY, mode, LossFacts, verl.POLICY_LOSS_REGISTRY, verl.register_policy_loss)


def policy_loss_fn(mode: str) -> Callable:
    """verl's loss function for `mode`, through verl's own dispatch (a plug-in registered first)."""
    loss_facts(mode)
    return core_algos().get_policy_loss_fn(mode)


def estimator_facts(name: str) -> EstimatorFacts:
    """The facts of `algorithm.adv_estimator=name`; a plug-in's function is registered into verl's registry in
    this process. Refused, naming the key, where rl_tpu cannot run it."""
    if name in REFUSED_ESTIMATORS:
        raise ValueError(
            f"{ESTIMATOR_KEY}={name!r} is not supported: {REFUSED_ESTIMATORS[name]}. "
            f"Allowed values are {', '.join(estimator_names())}"
        )
    if name in OWN_ESTIMATORS:
        return OWN_ESTIMATORS[name]
    if name in adv_estimators():
        return EstimatorFacts(compares_group=name in GROUP_ESTIMATORS)
    if not is_import_path(name):
        raise ValueError(f"{ESTIMATOR_KEY}={name!r}: {allowed(estimator_names(), EstimatorFacts)}")
    verl = core_algos()
    return registered(ESTIMATOR_KEY, name, EstimatorFacts, verl.ADV_ESTIMATOR_REGISTRY, verl.register_adv_est)
