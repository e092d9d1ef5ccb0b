"""Time to a recipe's first step on a cold cache: each run starts from a fresh HOME (so `~/.cache/rl_tpu` is
empty: the model and the data are made or installed from scratch) and is stopped once its first train step is in
metrics.jsonl.

    python benchmarks/first_step.py --recipes grpo_math,tool_math --out benchmarks/results/first_step.json

Figures per recipe: seconds from the process start to metrics.jsonl's first line (the step-0 evaluation) and to
its first train step, the held-out start and the first step's reward, and the cache's model folder (shipped or
built).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import write_record

from rl_tpu.models.shipped import read_manifest

REPO = Path(__file__).resolve().parents[1]


def first_lines(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def stop(process: subprocess.Popen) -> None:
    """SIGTERM twice (the run's second one stops without saving), then its whole process group."""
    for _ in range(2):
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def time_first_step(recipe: str, timeout_s: float) -> dict:
    home = Path(tempfile.mkdtemp(prefix="rl_tpu_first_step_"))
    run_dir = home / "run"
    command = [sys.executable, "-m", "rl_tpu.main", f"+recipe={recipe}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HOME": str(home)}
    start = time.monotonic()
    with open(home / "out.log", "w") as out:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    first_line = first_step = None
    try:
        while first_step is None:
            rows = first_lines(run_dir / "metrics.jsonl")
            now = time.monotonic() - start
            first_line = first_line if first_line is not None or not rows else now
            first_step = now if any(r["step"] >= 1 for r in rows) else None
            load = os.getloadavg()
            if first_step is None and (process.poll() is not None or now > timeout_s):
                raise RuntimeError(f"{recipe}: no first step (rc {process.poll()}); see {home / 'out.log'}")
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            stop(process)
    (model,) = (home / ".cache" / "rl_tpu" / "models").glob("tiny_arith-*")
    return {
        "recipe": recipe,
        "first_line_s": round(first_line, 1),
        "first_step_s": round(first_step, 1),
        "load_average_at_first_step": load,
        "step0_eval_accuracy": rows[0].get("eval/accuracy"),  # the held-out start the recipe's README records
        "step1_reward_mean": next(r["reward/mean"] for r in rows if r["step"] == 1),
        "model_folder": model.name,
        "shipped": model.name in read_manifest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="grpo_math,tool_math")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--out", default="benchmarks/results/first_step.json")
    args = parser.parse_args()
    load = os.getloadavg()
    runs = []
    for recipe in args.recipes.split(","):
        runs.append(time_first_step(recipe, args.timeout_s))
        print(json.dumps(runs[-1]), flush=True)
    write_record(args.out, load, runs=runs)


if __name__ == "__main__":
    main()
