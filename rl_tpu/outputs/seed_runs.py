"""The recipes' seed studies (`recipes/*/results.py`): the overrides that make a seed, whether a run is finished,
and the markdown table of each variant's mean and seeds."""

from __future__ import annotations

import statistics
from pathlib import Path

from rl_tpu.outputs.metrics import read_metrics


def seeded(seed: int) -> list[str]:
    """The overrides of one seed: the run's, the sampler's and the data order's."""
    return [f"seed={seed}", f"sampler.seed={seed}", f"data.shuffle_seed={seed}"]


def finished(run_dir: Path, last_step: int, key: str = "eval/accuracy") -> bool:
    """The run's last evaluation (its `key`), after its `last_step`, is in its metrics."""
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    return bool(records) and records[-1]["step"] == last_step and key in records[-1]


def markdown_table(results: dict[str, dict[int, dict[str, float]]]) -> str:
    """`results[variant][seed][figure]` as a table: a row of each variant's means, then one per seed."""
    keys = list(next(values for seeds in results.values() for values in seeds.values()))
    lines = ["| run | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for variant, seeds in results.items():
        if not seeds:
            continue
        means = [statistics.fmean(values[k] for values in seeds.values()) for k in keys]
        lines.append(f"| {variant}, mean of {len(seeds)} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
        for seed, values in seeds.items():
            lines.append(f"| {variant}, seed {seed} | " + " | ".join(f"{values[k]:.3f}" for k in keys) + " |")
    return "\n".join(lines)
