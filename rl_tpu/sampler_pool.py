"""Several vLLM engines as one sampler: each batch split between them, every weight version installed in all.

Prompts are split into contiguous chunks of nearly equal size, one per engine, and the rollouts
come back in prompt order with each rollout's `group` the prompt's index in the whole batch.
An install reaches every engine (for the collective transport, all engines take part in the
same broadcast), and every engine must report the same version afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_tpu.actor_logs import actor_name
from rl_tpu.rollout import Rollout
from rl_tpu.sampler import SamplingSettings
from rl_tpu.sync import WeightBundle
from rl_tpu.waiting import gather


def split_evenly(count: int, parts: int) -> list[range]:
    """`count` items as `parts` contiguous ranges whose sizes differ by at most one (empty ones dropped)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        ranges.append(range(start, start + size))
        start += size
    return [r for r in ranges if len(r)]


@dataclass
class PendingRollouts:
    """Generations under way on the engines; `result` waits for all of them and merges in prompt order."""

    pool: "SamplerPool"
    chunks: list[tuple[int, range, object]]  # (engine, prompt indices, ObjectRef of its rollouts)

    def result(self, timeout_s: float) -> list[Rollout]:
        calls = [(self.pool.names[engine], ref) for engine, _, ref in self.chunks]
        rollouts = []
        for (_, prompts, _), part in zip(self.chunks, gather(calls, "generate", timeout_s, self.pool.log_dir)):
            for rollout in part:
                rollout.group += prompts.start
            rollouts.extend(part)
        return rollouts

    def shares(self) -> dict[str, float]:
        """Each engine's fraction of the batch's prompts, for the step's metrics."""
        total = sum(len(prompts) for _, prompts, _ in self.chunks)
        shares = {f"sampler/engine_{e}/batch_share": 0.0 for e in range(len(self.pool.engines))}
        for engine, prompts, _ in self.chunks:
            shares[f"sampler/engine_{engine}/batch_share"] = len(prompts) / total
        return shares


class SamplerPool:
    def __init__(self, engines: list, log_dir: str | None = None):
        self.engines, self.log_dir = engines, log_dir

    @property
    def names(self) -> list[str]:
        return [actor_name("sampler", i) for i in range(len(self.engines))]

    def generate(self, prompts: list[list[int]], settings: SamplingSettings,
                 seeds: list[int] | None = None) -> PendingRollouts:
        """Each engine generates its share; `seeds` (one per prompt) travel with their prompts."""
        chunks = []
        for engine, part in enumerate(split_evenly(len(prompts), len(self.engines))):
            part_seeds = [seeds[i] for i in part] if seeds is not None else None
            ref = self.engines[engine].generate.remote([prompts[i] for i in part], settings, part_seeds)
            chunks.append((engine, part, ref))
        return PendingRollouts(self, chunks)

    def call(self, method: str, what: str, timeout_s: float, *args) -> list:
        """The same call on every engine, waited for together."""
        calls = [(name, getattr(engine, method).remote(*args)) for name, engine in zip(self.names, self.engines)]
        return gather(calls, what, timeout_s, self.log_dir)

    def install(self, bundle: WeightBundle, timeout_s: float) -> dict[str, float]:
        """Install in every engine; the first engine's timings and each engine's served version."""
        received = self.call("install", f"installing weights v{bundle.version}", timeout_s, bundle)
        versions = {r["version"] for r in received}
        if versions != {bundle.version}:
            raise RuntimeError(f"after installing v{bundle.version} the engines serve versions "
                               f"{[r['version'] for r in received]}")
        metrics = {f"sampler/engine_{i}/weight_version": float(r["version"]) for i, r in enumerate(received)}
        return {**received[0], "peak_rss_mb": max(r["peak_rss_mb"] for r in received), **metrics}
