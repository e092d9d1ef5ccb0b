"""A reward worker process: loads the reward functions once, then scores the samples it is sent.

Started by `rl_tpu.grader.grader.Grader` as ``python -m rl_tpu.grader.processes READ_FD WRITE_FD``; it
speaks `multiprocessing.connection` messages over two pipes (plugins may print freely to
stdout). Every outcome a plugin can produce is turned into a message here: a score, or a
failure with the plugin's traceback. Timeouts and crashes are the grader's to see.

It speaks `rl_tpu.cluster.worker_pool`'s protocol (bounded memory and CPU seconds, death with its parent): its
setup is the list of `RewardSource`, its ready detail whether it scores a job as one batch, and it answers one
message per sample, or one for the whole job when a function is batched.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rl_tpu.cluster.worker_pool import serve

# A sample's outcome: ("ok", {reward: score}, {extra field: value}) or ("fail", reward, kind, message).
Outcome = tuple


@dataclass(frozen=True)
class RewardSource:
    """Where a worker finds one reward function: a module (built-ins) or a Python file (plugins)."""

    label: str  # its name in metrics and errors
    function: str
    module: str | None = None
    path: str | None = None
    weight: float = 1.0
    kwargs: tuple[tuple[str, Any], ...] = ()
    batched: bool | None = None  # None: batched iff the signature takes `solution_strs` (verl's batch form)


@dataclass(frozen=True)
class Sample:
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict


class RewardFunction:
    def __init__(self, source: RewardSource):
        self.source = source
        self.fn = _load(source)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        params = inspect.signature(self.fn).parameters
        self.batched = source.batched if source.batched is not None else "solution_strs" in params
        self.kwargs = dict(source.kwargs)

    def __call__(self, loop: asyncio.AbstractEventLoop, **arguments) -> Any:
        result = self.fn(**arguments, **self.kwargs)
        return loop.run_until_complete(result) if self.is_async else result


def _load(source: RewardSource) -> Callable:
    if source.path is not None:
        spec = importlib.util.spec_from_file_location(f"reward_plugin_{Path(source.path).stem}", source.path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(source.module)
    fn = getattr(module, source.function, None)
    if not callable(fn):
        where = source.path or source.module
        raise AttributeError(f"{where} has no function {source.function!r} (set reward.custom.name)")
    return fn


class InvalidResult(ValueError):
    """A reward returned something that is not a score."""


def as_number(value: Any) -> float | None:
    """A real number as verl takes one (int, float, bool, a NumPy scalar, a one-element array or tensor), else None."""
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # NumPy and torch scalars; raises for more than one element
        except (ValueError, RuntimeError):
            return None
    return float(value) if isinstance(value, numbers.Real) else None


def _score_value(label: str, result: Any) -> tuple[float, dict[str, float]]:
    """The score of one result (a number, or verl's dict with a `score` key) and its numeric extras."""
    extras: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise InvalidResult(f"reward {label} returned a dict without a 'score' key: keys {sorted(result)}")
        fields = {k: as_number(v) for k, v in result.items() if k != "score"}
        extras = {f"{label}/{k}": v for k, v in fields.items() if v is not None and math.isfinite(v)}
        result = result["score"]
    score = as_number(result)
    if score is None or not math.isfinite(score):
        raise InvalidResult(
            f"reward {label} returned {result!r}; a reward must be a finite number (or a dict with one under 'score')"
        )
    return score, extras


def _failure(label: str, err: BaseException) -> Outcome:
    if isinstance(err, InvalidResult):
        return ("fail", label, "invalid", str(err))
    return ("fail", label, "exception", "".join(traceback.format_exception(err)))


def _checked(fn: RewardFunction, result: Any) -> tuple[float, dict] | Outcome:
    try:
        return _score_value(fn.source.label, result)
    except InvalidResult as err:
        return _failure(fn.source.label, err)


def _call_checked(fn: RewardFunction, loop, sample: Sample) -> tuple[float, dict] | Outcome:
    try:
        result = fn(
            loop,
            data_source=sample.data_source,
            solution_str=sample.solution_str,
            ground_truth=sample.ground_truth,
            extra_info=sample.extra_info,
        )
    except Exception as err:
        return _failure(fn.source.label, err)
    return _checked(fn, result)


def _call_batched(fn: RewardFunction, loop, samples: list[Sample]) -> list[tuple[float, dict] | Outcome]:
    try:
        results = fn(
            loop,
            data_sources=[s.data_source for s in samples],
            solution_strs=[s.solution_str for s in samples],
            ground_truths=[s.ground_truth for s in samples],
            extra_infos=[s.extra_info for s in samples],
        )
        if len(results) != len(samples):
            raise InvalidResult(f"reward {fn.source.label} returned {len(results)} scores for {len(samples)} samples")
    except Exception as err:
        return [_failure(fn.source.label, err)] * len(samples)
    return [_checked(fn, result) for result in results]


def _combine(per_function: list, functions: list[RewardFunction]) -> Outcome:
    """One sample's outcome from each function's: the first failure, or every score and extra field."""
    components, extras = {}, {}
    for fn, outcome in zip(functions, per_function):
        if outcome[0] == "fail":
            return outcome
        components[fn.source.label], fields = outcome
        extras.update(fields)
    return ("ok", components, extras)


def score_one(functions: list[RewardFunction], sample: Sample, loop) -> Outcome:
    return _combine([_call_checked(fn, loop, sample) for fn in functions], functions)


def score_batch(functions: list[RewardFunction], samples: list[Sample], loop) -> list[Outcome]:
    """Batched functions get the whole list in one call; the others are called per sample."""
    columns = [
        _call_batched(fn, loop, samples) if fn.batched else [_call_checked(fn, loop, s) for s in samples]
        for fn in functions
    ]
    return [_combine(list(row), functions) for row in zip(*columns)]


def load(sources: list[RewardSource]) -> tuple[list[RewardFunction], bool]:
    """The reward functions, and whether a job is scored as one batch (any function takes verl's batch form)."""
    functions = [RewardFunction(source) for source in sources]
    return functions, any(fn.batched for fn in functions)


def answer(functions: list[RewardFunction], positions: list[int], samples: list[Sample], loop) -> Iterator[list]:
    if any(fn.batched for fn in functions):
        yield list(zip(positions, score_batch(functions, samples, loop)))
        return
    for position, sample in zip(positions, samples):
        yield [(position, score_one(functions, sample, loop))]


if __name__ == "__main__":
    serve(load, answer)
