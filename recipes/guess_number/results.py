"""The 3-seed evidence of README.md: `guess_number` as it is, and the same model trained without the feedback.

    python recipes/guess_number/results.py run OUT      # every run not finished yet in OUT, one after another
    python recipes/guess_number/results.py table OUT    # the table (markdown), OUT/results.json and OUT/results.png

Run from the repository root (the recipe's data, tools YAML and reward are files of the checkout). A seed changes
`seed`, `sampler.seed` and `data.shuffle_seed` and keeps the warm-started model. The control, `no_feedback`, is
the same warm-started model under the same GRPO with examples/tools/guess_number_no_feedback.yaml: every wrong
guess is answered "wrong", so nothing the environment says tells it where the secret is.
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
VARIANTS = {
    "guess_number": [],
    "no_feedback": ["episode.tools_config_file=examples/tools/guess_number_no_feedback.yaml"],
}
COMMON = [
    "+recipe=guess_number",
    "trainer.export=false",
    "trainer.checkpoint_every=0",
    "trainer.checkpoint_final=false",
]
TOTAL_STEPS = 100  # the recipe's trainer.total_steps
MAX_GUESSES = 3  # the recipe's turn limit: episode.max_turns less the turn after the last guess
WON = "reward/extra/custom/won_at"  # the guess that won, averaged over the step's won games
GUESSES = "reward/extra/custom/guesses"  # guesses per game, over every game of the step


def finished(run_dir: Path) -> bool:
    """The run's last evaluation, after its last step, is in."""
    return run_finished(run_dir, TOTAL_STEPS)


def run(out: Path, extra: list[str]) -> None:
    for variant, overrides in VARIANTS.items():
        for seed in SEEDS:
            run_dir = out / variant / f"seed{seed}"
            if finished(run_dir):
                continue
            command = [sys.executable, "-m", "rl_tpu.main", *COMMON, *overrides, *seeded(seed), *extra]
            print("+", " ".join(command), flush=True)
            subprocess.run([*command, f"hydra.run.dir={run_dir}"], check=True)


def turns_to_win(won: float, won_at: float | None) -> float:
    """Mean guesses to win, a game lost within the limit counted as MAX_GUESSES + 1."""
    return won * (won_at or 0.0) + (1 - won) * (MAX_GUESSES + 1)


def figures(run_dir: Path) -> dict[str, float]:
    """Greedy play over the 7 secrets at the first evaluation and the final one (win rate: the mean of the last
    three evaluations, as every recipe reports it; the rest: the last); the same at the sampling temperature over the
    training games of the first and the last five steps."""
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    steps = [r for r in records if "reward/mean" in r]

    def sampled(key: str, rows: list[dict]) -> float:  # sampled, over the games of 5 steps (won_at: won games only)
        return statistics.fmean(r[key] for r in rows if key in r)

    def greedy_turns(record: dict) -> float:
        return turns_to_win(record["eval/accuracy"], record.get("eval/extra/custom/won_at"))

    return {
        "win_first5": sampled("reward/mean", steps[:5]),
        "win_last5": sampled("reward/mean", steps[-5:]),
        "guesses_first5": sampled(GUESSES, steps[:5]),
        "guesses_last5": sampled(GUESSES, steps[-5:]),
        "won_at_first5": sampled(WON, steps[:5]),
        "won_at_last5": sampled(WON, steps[-5:]),
        "turns_to_win_first5": statistics.fmean(turns_to_win(r["reward/mean"], r.get(WON)) for r in steps[:5]),
        "turns_to_win_last5": statistics.fmean(turns_to_win(r["reward/mean"], r.get(WON)) for r in steps[-5:]),
        "greedy_win_start": first["eval/accuracy"],
        "greedy_win_final": final_accuracy([r["eval/accuracy"] for r in evals]),
        "greedy_turns_to_win_start": greedy_turns(first),
        "greedy_turns_to_win_final": greedy_turns(last),
        "wall_s": records[-1]["time/elapsed_s"],
    }


def plot(out: Path) -> None:
    """Win rate and guesses per game of the training games against the step, each seed a thin line, both arms."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12.8, 4.2), layout="constrained")
    win, turns = figure.subplots(1, 2)
    for variant, color in zip(VARIANTS, ("tab:blue", "tab:gray")):
        for seed in SEEDS:
            path = out / variant / f"seed{seed}" / "metrics.jsonl"
            if not path.is_file():
                continue
            steps = [r for r in read_metrics(path) if "reward/mean" in r]
            label = variant if seed == SEEDS[0] else None
            win.plot([r["step"] for r in steps], [r["reward/mean"] for r in steps], color=color, label=label, lw=1)
            turns.plot([r["step"] for r in steps], [r.get(GUESSES) for r in steps], color=color, label=label, lw=1)
    win.set(xlabel="step", ylabel="games won within 3 guesses (sampled)", ylim=(0, 1))
    turns.set(xlabel="step", ylabel="guesses per game (sampled)", ylim=(1, MAX_GUESSES))
    for axes in (win, turns):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle("guess_number (secrets 1..7, 3 guesses): with feedback, and without (control); 3 seeds each")
    figure.savefig(out / "results.png", dpi=100)


def table(out: Path) -> None:
    results = {v: {s: figures(out / v / f"seed{s}") for s in SEEDS if finished(out / v / f"seed{s}")} for v in VARIANTS}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(out)
    print(markdown_table(results))


if __name__ == "__main__":
    action, folder = sys.argv[1], Path(sys.argv[2])
    if action == "run":
        run(folder, sys.argv[3:])  # further arguments: overrides of every run
    else:
        table(folder)
