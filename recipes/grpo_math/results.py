"""The 3-seed evidence of results.md: the default recipe, each algorithm preset, and the supervised control.

    python recipes/grpo_math/results.py run OUT      # every run not finished yet in OUT, one after another
    python recipes/grpo_math/results.py table OUT    # the tables (markdown) and OUT/results.json

A seed changes `seed`, `sampler.seed` and `data.shuffle_seed` (the trainer, the draws, the prompt order)
and keeps the warm-started model and the held-out set. Every run evaluates greedily at every
evaluation and draws `trainer.eval_pass_k=8` samples a held-out prompt at T=1 at the first and the last
(rl_tpu/controller/evaluation.py). The control trains the same starting model on the warm start's teacher for
GRPO's number of sequences (sft_control.py) and is evaluated by the same code (`trainer.total_steps=0`).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from rl_tpu.controller.evaluation import pass_at_k_summary
from rl_tpu.outputs.metrics import final_accuracy, read_metrics
from rl_tpu.outputs.seed_runs import finished as run_finished
from rl_tpu.outputs.seed_runs import seeded

SEEDS = (0, 1, 2)
PRESETS = ("grpo_math", "dapo_math", "dr_grpo_math", "gspo_math")
CONTROL_LRS = (3e-5, 3e-4)
COMMON = [
    "trainer.eval_pass_k=8",
    "trainer.export=false",
    "trainer.checkpoint_every=0",
    "trainer.checkpoint_final=false",
    "trainer.plots=false",
]
HERE = Path(__file__).resolve().parent
TOTAL_STEPS = 100  # the recipes' trainer.total_steps


def main_command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "rl_tpu.main", *overrides, *COMMON, f"hydra.run.dir={run_dir}"]


def commands(out: Path) -> dict[Path, list[list[str]]]:
    """Each run's folder and the commands that make it."""
    runs = {}
    for recipe in PRESETS:
        for seed in SEEDS:
            run_dir = out / recipe / f"seed{seed}"
            runs[run_dir] = [main_command(run_dir, [f"+recipe={recipe}", *seeded(seed)])]
    for lr in CONTROL_LRS:
        for seed in SEEDS:
            run_dir = out / f"sft_control_lr{lr:g}" / f"seed{seed}"
            runs[run_dir] = [
                [
                    sys.executable,
                    str(HERE / "sft_control.py"),
                    "--seed",
                    str(seed),
                    "--lr",
                    str(lr),
                    "--out",
                    str(run_dir / "model"),
                ],
                main_command(
                    run_dir,
                    ["+recipe=grpo_math", f"model.path={run_dir / 'model'}", "trainer.total_steps=0", *seeded(seed)],
                ),
            ]
    return runs


def run_all(out: Path) -> None:
    for run_dir, steps in commands(out).items():
        if finished(run_dir):
            continue
        for command in steps:
            print("+", " ".join(command), flush=True)
            subprocess.run(command, check=True)


def finished(run_dir: Path) -> bool:
    """The run's last evaluation is in: the one that samples, after the last step (step 0 of a control)."""
    last_step = 0 if run_dir.parent.name.startswith("sft_control") else TOTAL_STEPS
    return run_finished(run_dir, last_step, "eval/pass@1")


def run_result(run_dir: Path) -> dict[str, float]:
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    passes = pass_at_k_summary(records)
    return {
        "greedy_start": evals[0],
        "greedy_final": final_accuracy(evals),
        "pass@1_start": passes["eval/pass@1_start"],
        "pass@1_final": passes["eval/pass@1_final"],
        "pass@8_start": passes["eval/pass@8_start"],
        "pass@8_final": passes["eval/pass@8_final"],
        "wall_s": records[-1]["time/elapsed_s"],
    }


def spread(values: list[float]) -> str:
    """Mean ± sample standard deviation, in points."""
    return f"{100 * statistics.fmean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def table(out: Path) -> str:
    results = {str(run_dir.relative_to(out)): run_result(run_dir) for run_dir in commands(out) if finished(run_dir)}
    for name, result in results.items():  # a control starts where GRPO starts: the step-0 evaluation, same seeds
        start = results.get(f"{PRESETS[0]}/{name.split('/')[1]}")
        if name.startswith("sft_control") and start:
            result.update({key: start[key] for key in result if key.endswith("_start")})
    (out / "results.json").write_text(json.dumps(results, indent=2))
    cases: dict[str, list[dict[str, float]]] = {}
    for name, result in results.items():
        cases.setdefault(name.split("/")[0], []).append(result)
    lines = [
        "| run | seeds | greedy start | greedy final | gain | pass@1 start | pass@1 final | pass@8 start | "
        "pass@8 final | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, rows in cases.items():
        if len(rows) < 2:
            continue
        gain = [r["greedy_final"] - r["greedy_start"] for r in rows]
        cells = [spread([r[key] for r in rows]) for key in ("greedy_start", "greedy_final")]
        cells += [spread(gain)] + [
            spread([r[key] for r in rows]) for key in ("pass@1_start", "pass@1_final", "pass@8_start", "pass@8_final")
        ]
        wall = statistics.median(r["wall_s"] for r in rows)
        lines.append(f"| {case} | {len(rows)} | " + " | ".join(cells) + f" | {wall:.0f} |")
    per_seed = [
        "",
        "| run | " + " | ".join(f"seed {s}: greedy final, pass@1, pass@8" for s in SEEDS) + " |",
        "|---|" + "---|" * len(SEEDS),
    ]
    for case, rows in cases.items():
        per_seed.append(
            f"| {case} | "
            + " | ".join(
                f"{100 * r['greedy_final']:.1f}, {100 * r['pass@1_final']:.1f}, {100 * r['pass@8_final']:.1f}"
                for r in rows
            )
            + " |"
        )
    return "\n".join(lines + per_seed)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("run", "table"):
        sys.exit(__doc__)
    folder = Path(sys.argv[2]).resolve()
    if sys.argv[1] == "run":
        run_all(folder)
    print(table(folder))
