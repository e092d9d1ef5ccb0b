"""A step's phases timed by one context manager, each a trace span (as TorchTitan's RL marks each phase).

    phases = Phases()
    with phases("train"):
        ...
    phases["train"]  # seconds, summed over every time the phase ran in the step

The span is `torch.profiler.record_function`: free without a profiler, and under one (`torch.profiler.profile`
around the loop) each phase shows by name in the trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Phases:
    """Seconds per named phase since the object was made, and the whole time (`elapsed`)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            with torch.profiler.record_function(f"rl_tpu/{name}"):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began

    def __getitem__(self, name: str) -> float:
        """A phase's seconds (0.0 where it did not run)."""
        return self.seconds.get(name, 0.0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
