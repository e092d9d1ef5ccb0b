"""Seconds per GRPO step of one `grpo_step.py` variant at a baseline commit and in this checkout, A B A B.

A change that must not slow the single-turn step (the episode machinery, say) is timed against the commit before
it on the same machine in the same session: each round runs the baseline (a `git worktree` of `--baseline`) and
then this checkout, each in a fresh process, and the ratio is taken round by round, so that a drift of the
machine's speed cancels. Records both figures, each round's ratio, and the load average.

    python benchmarks/compare_commits.py --baseline 0e02d8a --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
VARIANT = "sync fp32 trainer 2t engine 1t"


def step_seconds(tree: Path, variant: str, steps: int, warmup: int, out: Path) -> dict:
    """One grpo_step.py run of `variant` in `tree`: its median s/step and the per-step times."""
    command = [sys.executable, "benchmarks/grpo_step.py", "--variants", variant, "--steps", str(steps)]
    command += ["--warmup", str(warmup), "--dtypes", "float32", "--out", str(out)]
    subprocess.run(command, cwd=tree, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    (run,) = json.loads(out.read_text())["runs"]
    return {"step_s": run["step_s"], "step_s_each": run["step_s_each"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare against, e.g. 0e02d8a")
    parser.add_argument("--variant", default=VARIANT)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compare_commits.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as scratch:
        baseline = Path(scratch) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=REPO, check=True)
        try:
            rounds = []
            for i in range(args.rounds):
                before = step_seconds(baseline, args.variant, args.steps, args.warmup, Path(scratch) / "a.json")
                after = step_seconds(REPO, args.variant, args.steps, args.warmup, Path(scratch) / "b.json")
                rounds.append({"baseline": before, "checkout": after, "ratio": after["step_s"] / before["step_s"]})
                print(f"round {i + 1}: {before['step_s']:.3f} -> {after['step_s']:.3f} s/step", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=REPO, check=True)
    ratios = [r["ratio"] for r in rounds]
    write_record(
        args.out,
        load_before,
        variant=args.variant,
        baseline=args.baseline,
        checkout=f"{head.strip()} and the working tree",
        steps=args.steps,
        warmup=args.warmup,
        rounds=rounds,
        ratio_median=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
    )
    print(f"checkout / baseline s/step: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
