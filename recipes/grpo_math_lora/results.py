"""The 3-seed evidence of README.md: `grpo_math_lora` against `grpo_math` (full fine-tuning), and the LoRA recipe
with merged syncs, one after another on the same machine, so that their wall times compare.

    python recipes/grpo_math_lora/results.py run OUT      # every run not finished yet in OUT, one after another
    python recipes/grpo_math_lora/results.py table OUT    # the table (markdown) and OUT/results.json

A seed changes `seed`, `sampler.seed` and `data.shuffle_seed` and keeps the warm-started model and the held-out set.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rl_tpu.outputs.metrics import final_accuracy, read_metrics
from rl_tpu.outputs.seed_runs import finished as run_finished
from rl_tpu.outputs.seed_runs import seeded

SEEDS = (0, 1, 2)
VARIANTS = {
    "lora": ["+recipe=grpo_math_lora"],
    "full": ["+recipe=grpo_math"],
    "lora_merged": ["+recipe=grpo_math_lora", "actor.lora.sync=merged"],  # full bundles; the engine without LoRA
}
COMMON = ["trainer.export=false", "trainer.checkpoint_every=0", "trainer.checkpoint_final=false"]
TOTAL_STEPS = 100  # both recipes' trainer.total_steps


def finished(run_dir: Path) -> bool:
    """The run's last evaluation, after its last step, is in."""
    return run_finished(run_dir, TOTAL_STEPS)


def run(out: Path) -> None:
    for seed in SEEDS:  # the variants alternate: a slow spell of the machine falls on both
        for variant, overrides in VARIANTS.items():
            run_dir = out / variant / f"seed{seed}"
            if finished(run_dir):
                continue
            command = [sys.executable, "-m", "rl_tpu.main", *overrides, *COMMON, *seeded(seed)]
            print("+", " ".join(command), flush=True)
            subprocess.run([*command, f"hydra.run.dir={run_dir}"], check=True)
            (run_dir / "loadavg.txt").write_text(" ".join(f"{x:.2f}" for x in os.getloadavg()))


def summary(run_dir: Path) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if r["step"] > 0]
    return {
        "start": evals[0],
        "final": final_accuracy(evals),
        "wall_s": rows[-1]["time/elapsed_s"],
        "sync_bytes": steps[-1]["sync/bytes"],
        "sync_s_mean": statistics.mean(r["time/sync_s"] for r in steps),
        "train_s_mean": statistics.mean(r["time/train_s"] for r in steps),
        "trainer_peak_rss_mb": max(r["perf/trainer_peak_rss_mb"] for r in steps),
        "logprob_diff_max": max(r["actor/logprob_diff"] for r in steps),  # engine against trainer, every step
        "load_avg_after": (run_dir / "loadavg.txt").read_text().strip(),
    }


def table(out: Path) -> None:
    results = {v: {f"seed{s}": summary(out / v / f"seed{s}") for s in SEEDS} for v in VARIANTS}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("| variant | start | final (mean of last evals) | gain, points | wall s | sync MB | sync s | train s/step |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, seeds in results.items():
        runs = list(seeds.values())

        def mean(key: str) -> float:
            return statistics.mean(r[key] for r in runs)

        gains = [100 * (r["final"] - r["start"]) for r in runs]
        finals = ", ".join(f"{100 * r['final']:.1f}" for r in runs)
        print(
            f"| {variant} | {100 * mean('start'):.1f}% | {100 * mean('final'):.1f}% "
            f"({finals}) | {statistics.mean(gains):+.1f} | "
            f"{mean('wall_s'):.0f} | {mean('sync_bytes') / 2**20:.2f} | {mean('sync_s_mean'):.3f} | "
            f"{mean('train_s_mean'):.3f} |"
        )


if __name__ == "__main__":
    {"run": run, "table": table}[sys.argv[1]](Path(sys.argv[2]))
