"""The 3-seed evidence of results.md: `tool_math` as it is, and the same model trained without the tool.

    python recipes/tool_math/results.py run OUT      # every run not finished yet in OUT, one after another
    python recipes/tool_math/results.py table OUT    # the table (markdown) and OUT/results.json

Run from the repository root (the recipe's tool is examples/tools/calc_function.py). A seed changes `seed`,
`sampler.seed` and `data.shuffle_seed` and keeps the warm-started model and the held-out set. The control,
`no_tool`, is the same warm-started model under the same GRPO with `episode.enable=false`: its calls are never
answered, so it can only learn to answer in its head.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from rl_tpu.outputs.metrics import final_accuracy, read_metrics
from rl_tpu.outputs.seed_runs import finished as run_finished
from rl_tpu.outputs.seed_runs import markdown_table, seeded

SEEDS = (0, 1, 2)
VARIANTS = {"tool_math": [], "no_tool": ["episode.enable=false"]}
COMMON = ["+recipe=tool_math", "trainer.export=false", "trainer.checkpoint_every=0", "trainer.checkpoint_final=false"]


TOTAL_STEPS = 50  # the recipe's trainer.total_steps


def finished(run_dir: Path) -> bool:
    """The run's last evaluation, after its last step, is in."""
    return run_finished(run_dir, TOTAL_STEPS)


def run(out: Path) -> None:
    for variant, overrides in VARIANTS.items():
        for seed in SEEDS:
            run_dir = out / variant / f"seed{seed}"
            if finished(run_dir):
                continue
            command = [sys.executable, "-m", "rl_tpu.main", *COMMON, *overrides, *seeded(seed)]
            print("+", " ".join(command), flush=True)
            subprocess.run([*command, f"hydra.run.dir={run_dir}"], check=True)


def figures(run_dir: Path) -> dict[str, float]:
    """Greedy held-out accuracy, share of episodes that called the tool and malformed calls per episode, at the
    first evaluation and the final (accuracy: the mean of the last three, as every recipe reports it); the same
    at T=1 over the training episodes of the first and the last five steps."""
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    steps = [r for r in records if "reward/mean" in r]

    def sampled(key: str, rows: list[dict]) -> float:  # at T=1, over the episodes of 5 steps
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    return {
        "reward_first5": sampled("reward/mean", steps[:5]),
        "reward_last5": sampled("reward/mean", steps[-5:]),
        "sampled_tool_call_rate_first5": sampled("episode/tool_call_rate", steps[:5]),
        "sampled_tool_call_rate_last5": sampled("episode/tool_call_rate", steps[-5:]),
        "sampled_malformed_first5": sampled("episode/malformed_calls_mean", steps[:5]),
        "sampled_malformed_last5": sampled("episode/malformed_calls_mean", steps[-5:]),
        "accuracy_start": first["eval/accuracy"],
        "accuracy_final": final_accuracy([r["eval/accuracy"] for r in evals]),
        "tool_call_rate_start": first.get("eval/episode/tool_call_rate", 0.0),
        "tool_call_rate_final": last.get("eval/episode/tool_call_rate", 0.0),
        "malformed_calls_start": first.get("eval/episode/malformed_calls_mean", 0.0),
        "malformed_calls_final": last.get("eval/episode/malformed_calls_mean", 0.0),
        "wall_s": records[-1]["time/elapsed_s"],
    }


def table(out: Path) -> None:
    results = {v: {s: figures(out / v / f"seed{s}") for s in SEEDS if finished(out / v / f"seed{s}")} for v in VARIANTS}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(markdown_table(results))


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    {"run": run, "table": table}[action](folder)
