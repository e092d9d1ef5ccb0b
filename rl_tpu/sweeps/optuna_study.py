"""An Optuna search over a sweep's overrides: `-m ... hydra/sweeper=optuna` (the plugin is
hydra_plugins/rl_tpu_launcher/optuna_sweeper.py).

Each batch asks Optuna for `n_jobs` trials, hands their overrides to the configured launcher at once
(so `hydra/launcher=ray` runs them together), and tells Optuna each trial's return value: for
rl_tpu.main, the run's final held-out accuracy. A trial that returned NaN or infinity (rl_tpu's failed
runs return NaN) or that raised is told as failed and the study goes on.

The search space is written as for Hydra's own Optuna sweeper, and parsed by Hydra's override parser:
`interval(LOW, HIGH)`, `tag(log, interval(LOW, HIGH))`, `int(interval(LOW, HIGH))`,
`range(START, STOP[, STEP])` and `choice(A, B, ...)` (or `A,B,...`). One difference: `range` offers the
values Hydra's basic sweeper would run (STOP excluded, as in Python), where Hydra's plugin includes STOP.

Why not Hydra's Optuna sweeper plugin (hydra-optuna-sweeper 1.3.0): it requires optuna>=2.10,<3.0, and
optuna 2 is three major releases old; this module is written against optuna 5.0's ask-and-tell API.

Optuna is imported only when a sweep starts: Hydra imports every plugin module at each start-up.
"""

from __future__ import annotations

import logging
import math
import traceback
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.core.utils import JobReturn, JobStatus

from rl_tpu.outputs.report import FAILED_FILE

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution

log = logging.getLogger(__name__)
RESULTS_FILE = "optimization_results.yaml"
FORMS = (
    "interval(LOW, HIGH), tag(log, interval(LOW, HIGH)), int(interval(LOW, HIGH)), "
    "tag(log, int(interval(LOW, HIGH))), range(START, STOP[, STEP]), choice(A, B, ...) or A,B,..."
)


class Direction(str, Enum):
    maximize = "maximize"
    minimize = "minimize"


class SamplerKind(str, Enum):
    tpe = "tpe"  # Optuna's TPESampler: models the results so far (after n_startup_trials random ones)
    random = "random"  # Optuna's RandomSampler


@dataclass
class OptunaSweeperConf:
    """`hydra.sweeper.*` of `hydra/sweeper=optuna`."""

    _target_: str = "hydra_plugins.rl_tpu_launcher.optuna_sweeper.OptunaSweeper"
    direction: Direction = Direction.maximize  # rl_tpu's trials return the final held-out accuracy
    n_trials: int = 20  # trials run by this sweep (a resumed study keeps its earlier ones besides)
    n_jobs: int = 1  # trials asked for and handed to the launcher at once (hydra/launcher=ray runs them together)
    sampler: SamplerKind = SamplerKind.tpe
    seed: Optional[int] = None  # the sampler's seed: the same seed, space and results give the same trials
    n_startup_trials: int = 10  # tpe: trials sampled at random before TPE models the results (Optuna's default)
    study_name: Optional[str] = None  # required with a storage: the name a later sweep resumes the study by
    storage: Optional[str] = None  # None: in memory; an Optuna storage URL (sqlite:///study.db) keeps and resumes it
    # override key -> search space (or a fixed value); search spaces given as overrides on the command line join these.
    # Any, not dict[str, str], so that `hydra.sweeper.params={...}` works on the command line: Hydra's struct mode
    # refuses new keys in a typed dict, and OmegaConf cannot merge a dict into a typed one left None
    params: Any = None


class SearchSpaceError(ValueError):
    pass


@dataclass
class SearchSpace:
    distributions: dict[str, BaseDistribution]  # override key -> what Optuna samples it from
    fixed: dict[str, str]  # override key -> the override every trial gets as written

    def overrides(self, params: dict[str, Any]) -> list[str]:
        """A trial's command line: the fixed overrides, then its sampled values as Hydra reads them."""
        return [*self.fixed.values(), *(f"{key}={Transformer.str(value)}" for key, value in params.items())]


def settings(**given: Any) -> OptunaSweeperConf:
    """The sweeper's settings as Hydra passes them (enums or their names, `params` a DictConfig), checked."""
    conf = OptunaSweeperConf(**{**given, "params": {str(k): str(v) for k, v in (given.get("params") or {}).items()}})
    conf.direction, conf.sampler = Direction(conf.direction), SamplerKind(conf.sampler)
    if conf.n_trials < 1 or conf.n_jobs < 1:
        raise ValueError(f"hydra.sweeper.n_trials and n_jobs must be at least 1 (got {conf.n_trials}, {conf.n_jobs})")
    if conf.storage and not conf.study_name:
        raise ValueError("hydra.sweeper.storage needs hydra.sweeper.study_name: the name to resume the study by")
    return conf


def search_space(params: dict[str, str], arguments: Sequence[str]) -> SearchSpace:
    """`hydra.sweeper.params`, then the sweep's command-line overrides, which replace a key of the same name."""
    parser = OverridesParser.create()
    overrides = {}
    for line in [*(f"{key}={value}" for key, value in params.items()), *arguments]:
        override = parse(parser, line)
        overrides[override.get_key_element()] = override
    return SearchSpace(
        {key: distribution(o) for key, o in overrides.items() if o.is_sweep_override()},
        {key: str(o.input_line) for key, o in overrides.items() if not o.is_sweep_override()},
    )


def parse(parser: OverridesParser, line: str) -> Override:
    try:
        return parser.parse_override(line)
    except Exception as error:  # Hydra's grammar errors: say which key, and what it accepts
        raise SearchSpaceError(f"{line}: {error}; a search space is one of {FORMS}") from error


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override; a form Optuna cannot sample raises, naming the key."""
    value = override.value()
    try:
        if isinstance(value, IntervalSweep):
            return interval(value)
        if isinstance(value, RangeSweep):
            return int_range(value)
        if isinstance(value, ChoiceSweep):
            return categorical(value)
        raise ValueError(f"{type(value).__name__} is not a search space")
    except ValueError as error:
        why = str(error).rstrip(".")
        raise SearchSpaceError(f"{override.input_line}: {why}; a search space is one of {FORMS}") from error


def interval(sweep: IntervalSweep) -> BaseDistribution:
    from optuna.distributions import FloatDistribution, IntDistribution

    if sweep.tags - {"log"}:
        raise ValueError(f"unknown tag(s) {sorted(sweep.tags - {'log'})} (only `log`)")
    log_scale = "log" in sweep.tags
    if isinstance(sweep.start, int) and isinstance(sweep.end, int):  # int(interval(...))
        return IntDistribution(sweep.start, sweep.end, log=log_scale)
    return FloatDistribution(float(sweep.start), float(sweep.end), log=log_scale)


def int_range(sweep: RangeSweep) -> BaseDistribution:
    from optuna.distributions import IntDistribution

    if sweep.shuffle or not all(isinstance(v, int) for v in (sweep.start, sweep.stop, sweep.step)):
        raise ValueError("range takes integers (for floats use interval), and no shuffle")
    values = range(sweep.start, sweep.stop, sweep.step)
    if not values:
        raise ValueError("the range is empty")
    return IntDistribution(min(values), max(values), step=abs(sweep.step))


def categorical(sweep: ChoiceSweep) -> BaseDistribution:
    from optuna.distributions import CategoricalDistribution

    choices = list(sweep.list)
    if not all(isinstance(c, (str, int, float, bool)) for c in choices):
        raise ValueError("the choices must be numbers, strings or booleans")
    return CategoricalDistribution(choices)


def make_study(settings: OptunaSweeperConf) -> optuna.Study:
    import optuna

    if settings.sampler == SamplerKind.tpe:
        sampler = optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=settings.n_startup_trials)
    else:
        sampler = optuna.samplers.RandomSampler(seed=settings.seed)
    return optuna.create_study(
        storage=settings.storage,
        study_name=settings.study_name,
        sampler=sampler,
        direction=settings.direction.value,
        load_if_exists=True,
    )


def tell(study: optuna.Study, trial: optuna.Trial, result: JobReturn) -> None:
    """Tell Optuna the trial's value, or that it failed: it raised, or returned NaN, infinity or no number."""
    record_failure(result)
    value = objective(result)
    if value is None:
        tell_failed(study, trial)
    else:
        study.tell(trial, value)


def tell_failed(study: optuna.Study, trial: optuna.Trial) -> None:
    from optuna.trial import TrialState

    study.tell(trial, state=TrialState.FAIL)


def objective(result: JobReturn) -> Optional[float]:
    if result.status != JobStatus.COMPLETED:
        return None
    try:
        value = float(result.return_value)
    except (TypeError, ValueError):
        value = math.nan
    if math.isfinite(value):
        return value
    log.error("trial %s returned %r: told as failed", " ".join(result.overrides or []), result.return_value)
    return None


def record_failure(result: JobReturn) -> None:
    """A trial that raised: its traceback goes where rl_tpu's failed runs leave theirs, so the sweep's summary
    lists it as failed (the basic sweeper would instead stop the sweep at this trial)."""
    if result.status != JobStatus.FAILED or result.hydra_cfg is None:
        return
    error = result._return_value  # `return_value` re-raises a failed job's exception
    path = Path(result.hydra_cfg.hydra.runtime.output_dir) / FAILED_FILE
    if not path.exists():
        path.write_text("".join(traceback.format_exception(error)))
    log.error("trial %s raised %r: told as failed", " ".join(result.overrides or []), error)


def results(study: optuna.Study, jobs: dict[int, int]) -> dict[str, Any]:
    """What optimization_results.yaml holds: the best trial, and every trial of the study (`job`: its folder
    number in this sweep, absent for the earlier trials of a resumed study)."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])
    best = study.best_trial if complete else None
    trials = [
        {
            "number": t.number,
            **({"job": jobs[t.number]} if t.number in jobs else {}),
            "state": t.state.name,
            "value": t.value,
            "params": dict(t.params),
        }
        for t in study.get_trials(deepcopy=False)
    ]
    return {
        "name": "optuna",
        "study_name": study.study_name,
        "direction": study.direction.name.lower(),
        "best_value": best.value if best else None,
        "best_params": dict(best.params) if best else None,
        "best_trial": best.number if best else None,
        "trials": trials,
    }


def write_results(sweep_dir: Path, summary: dict[str, Any]) -> Path:
    path = sweep_dir / RESULTS_FILE
    path.write_text(yaml.safe_dump(summary, sort_keys=False))
    return path
