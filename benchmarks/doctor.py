"""How long the preflight takes: `rl-tpu doctor +recipe=NAME` from the command to its exit, on a cold cache (a fresh
HOME: the shipped model installed and the data made, as the README's first run) and then on the warm one; and what
`trainer.preflight=true` adds to a short run (the same run with and without it, warm cache), with the preflight's own
time, and the run's step-0 held-out accuracy and step-1 figures, which the preflight must leave as they were.

    python benchmarks/doctor.py --out benchmarks/results/doctor.json

Figures per run: seconds from the process start to its exit, its exit status, the load average at its end; for the
doctor also the report's own wall time (from its settings read to its report), the part of it the checks of the inputs
took, and each check's status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import write_record

REPO = Path(__file__).resolve().parents[1]
UNTOUCHED = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy")
SHORT_RUN = ("trainer.total_steps=2", "trainer.checkpoint_final=false", "trainer.export=false", "trainer.plots=false")


def timed(command: list[str], home: Path, timeout_s: float) -> tuple[float, int, str]:
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=REPO, env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=timeout_s
    )
    return time.monotonic() - start, result.returncode, result.stdout + result.stderr


def doctor(recipe: str, home: Path, name: str, timeout_s: float) -> dict:
    out = home / name
    command = [sys.executable, "-m", "rl_tpu.main", "doctor", f"+recipe={recipe}", f"hydra.run.dir={out}"]
    seconds, status, text = timed(command, home, timeout_s)
    if status not in (0, 1):
        raise RuntimeError(f"the doctor stopped with status {status}:\n{text[-3000:]}")
    report = json.loads((out / "doctor.json").read_text())
    return {
        "what": f"rl-tpu doctor +recipe={recipe} ({name})",
        "seconds": round(seconds, 1),
        "exit_status": status,
        "report_wall_s": report["wall_s"],
        "inputs_checks_s": report["inputs_s"],  # the doctor's own checks before the engines start
        "checks": {c["name"]: c["status"] for c in report["checks"]},
        "load_average_at_end": os.getloadavg(),
    }


def short_run(recipe: str, home: Path, preflight: bool, timeout_s: float) -> dict:
    name = f"run_preflight_{str(preflight).lower()}"
    command = [sys.executable, "-m", "rl_tpu.main", f"+recipe={recipe}", f"hydra.run.dir={home / name}", *SHORT_RUN]
    seconds, status, text = timed([*command, f"trainer.preflight={str(preflight).lower()}"], home, timeout_s)
    if status != 0:
        raise RuntimeError(f"the run stopped with status {status}:\n{text[-3000:]}")
    lines = [json.loads(line) for line in (home / name / "metrics.jsonl").read_text().splitlines()]
    record = {
        "what": f"a 2-step +recipe={recipe} run, trainer.preflight={str(preflight).lower()}",
        "seconds": round(seconds, 1),
        "load_average_at_end": os.getloadavg(),
        # the same with and without the preflight: the run starts from the same weights, untouched by it
        "step0_eval_accuracy": lines[0]["eval/accuracy"],
        "step1": {key: lines[1][key] for key in UNTOUCHED},
    }
    if preflight:  # the preflight's own time, from its report
        record["preflight_wall_s"] = json.loads((home / name / "preflight" / "doctor.json").read_text())["wall_s"]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="grpo_math")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--no-preflight-runs", action="store_true", help="time the doctor alone")
    parser.add_argument("--out", default="benchmarks/results/doctor.json")
    args = parser.parse_args()
    load = os.getloadavg()
    home = Path(tempfile.mkdtemp(prefix="rl_tpu_doctor_"))
    runs = [doctor(args.recipe, home, "cold", args.timeout_s), doctor(args.recipe, home, "warm", args.timeout_s)]
    if not args.no_preflight_runs:
        runs += [short_run(args.recipe, home, preflight, args.timeout_s) for preflight in (False, True)]
    for run in runs:
        print(json.dumps(run), flush=True)
    write_record(args.out, load, runs=runs)


if __name__ == "__main__":
    main()
