"""A short run's fixed cost: wall time to the first metrics line, to the first step and to exit, and the CPU seconds
of its whole process tree (driver, Ray's processes, the actors), at a baseline commit and in this checkout, A B A B.

The run is the end-to-end tests' CLI run (tests/conftest.py's `E2E_OVERRIDES`: the tiny model with random weights,
4 prompts x 4 completions, two FSDP2 ranks) for `trainer.total_steps=2` on a warm cache: what each of the e2e tier's
runs pays before and after its few steps. On a loaded machine wall time drifts with the load, so each round runs the
baseline and then the checkout in fresh processes, and the CPU seconds (read from /proc, polled) are recorded beside
the wall times. The baseline is a `git archive` of `--baseline` in a temporary folder.

    python benchmarks/startup.py --baseline main --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import E2E_OVERRIDES  # noqa: E402  the e2e tier's run, exactly

POLL_S = 0.1
TICKS = os.sysconf("SC_CLK_TCK")


def processes() -> dict[int, tuple[int, float, str]]:
    """Every process now: pid -> (parent pid, CPU seconds so far, what it is)."""
    seen = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seen[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS, title)
    return seen


def kind_of(title: str) -> str:
    """A process's kind: a Ray actor or worker by its title (`ray::Sampler.generate` -> `ray::Sampler`), else its
    program's name."""
    if title.startswith("ray::"):
        return title.split(".")[0].split(" ")[0]
    return Path(title.split(" ")[0]).name or "?"


def one_run(tree: Path, cache_dir: Path, run_dir: Path) -> dict:
    """One 2-step run from `tree`: seconds to the step-0 metrics line, the step-1 line and exit; CPU seconds of
    every process it started (still polled after the driver exits, until they are gone or 30 s have passed)."""
    command = [sys.executable, "-m", "rl_tpu.main", *E2E_OVERRIDES, "trainer.total_steps=2"]
    command += [f"hydra.run.dir={run_dir}", f"cache_dir={cache_dir}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    driver = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ours, cpu, kinds = {driver.pid}, {}, {driver.pid: "driver"}
    lines: list[float] = []
    exited = gone = None
    outlived: list[str] = []
    metrics = run_dir / "metrics.jsonl"
    while gone is None:
        now = processes()
        for pid, (parent, _, title) in sorted(now.items()):
            if parent in ours and pid not in ours:
                ours.add(pid)
                kinds[pid] = kind_of(title)
        for pid in ours & now.keys():
            cpu[pid] = now[pid][1]
            if pid != driver.pid and now[pid][2]:  # a Ray worker takes its actor's title once it holds one
                kinds[pid] = kind_of(now[pid][2])
        if metrics.exists():
            lines += [time.monotonic() - start] * (metrics.read_text().count("\n") - len(lines))
        if exited is None and driver.poll() is not None:
            exited = time.monotonic() - start
            outlived = sorted({kinds[pid] for pid in ours & now.keys() if pid != driver.pid})
        if exited is not None and (not ours & now.keys() or time.monotonic() - start > exited + 30):
            gone = time.monotonic() - start
        time.sleep(POLL_S)
    if driver.returncode != 0:
        raise RuntimeError(f"the run failed ({driver.returncode}): {driver.stderr.read().decode()[-3000:]}")
    by_kind = defaultdict(float)
    for pid, seconds in cpu.items():
        by_kind[kinds[pid]] += seconds
    return {
        "first_metrics_s": lines[0],
        "first_step_s": lines[1],
        "exit_s": exited,
        "all_gone_s": gone,
        "outlived_the_driver": outlived,  # processes still there when the driver exited, by kind
        "cpu_s": sum(cpu.values()),
        "cpu_s_by_kind": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a commit to compare against (A B A B); none: this checkout alone")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "rl_tpu-startup-cache")
    parser.add_argument("--no-warm-up", action="store_true", help="the cache holds the tiny model and data already")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "startup.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"checkout": REPO}
        if args.baseline:
            trees = {"baseline": Path(scratch) / "baseline", **trees}
            trees["baseline"].mkdir()
            archive = subprocess.run(["git", "archive", args.baseline], cwd=REPO, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", str(trees["baseline"])], input=archive.stdout, check=True)
        if not args.no_warm_up:  # the cache: the tiny model and its data
            one_run(REPO, args.cache_dir, Path(scratch) / "warm-up")
        rounds = []
        for i in range(args.rounds):
            runs = {}
            for name, tree in trees.items():
                runs[name] = {**one_run(tree, args.cache_dir, Path(scratch) / f"{name}-{i}"), "load": os.getloadavg()}
                print(f"round {i + 1} {name}: {json.dumps(runs[name])}", flush=True)
            rounds.append(runs)
    summary = {
        name: {
            key: statistics.median(r[name][key] for r in rounds)
            for key in ("first_metrics_s", "first_step_s", "exit_s", "cpu_s")
        }
        for name in trees
    }
    write_record(
        args.out,
        load_before,
        run=" ".join([*E2E_OVERRIDES, "trainer.total_steps=2"]),
        baseline=args.baseline,
        checkout=f"{head.strip()} and the working tree",
        rounds=rounds,
        median=summary,
    )
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
