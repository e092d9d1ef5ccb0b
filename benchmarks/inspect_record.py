"""The rollout inspector's costs: the wall time the record adds to a run, and the page of a finished run.

    python benchmarks/inspect_record.py overhead --steps 20 --rounds 2   # grpo_math, record at its default share
                                                                         # against none (0), A B A B
    python benchmarks/inspect_record.py page RUN --name grpo_math_100 [--step 99 --measure adv]
                                                # RUN's page: size, rows, load time, and a screenshot into docs/images/

`overhead` runs the `grpo_math` recipe for `--steps` steps in fresh processes, alternating the default record
(`trainer.rollout_data_every` unset: one prompt group in 8 and the evaluations' samples of as many prompts) with none
(`trainer.rollout_data_every=0`), from a warm cache. The figure is the training loop's wall time: from the step-0
evaluation's metrics line to the last step's (`time/elapsed_s`), which holds every step, the record's writes and the
evaluations; start-up and exit are left out (they do not change). The whole run's wall time is recorded beside it, and
the record's own seconds (`time/record_s`, summed over the steps) as a share of the loop's: what it adds, measured
inside the run and so free of the load's swings between runs.

`page` writes RUN/inspect.html (with `--repeat-to N`: of a copy of RUN whose steps repeat up to step N, what a long run
of the same recipe leaves: past the page's caps), opens it from disk in the headless Chromium of the page tests (tests/browser.py) three
times, and records its size, the rows and steps it holds, the record's size on disk and how long the page took to
draw (the script's own `window.inspectReady`, from navigation start), and saves a screenshot.
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
RESULTS = REPO / "benchmarks" / "results"
SETTINGS = {"default": [], "off": ["trainer.rollout_data_every=0"]}


def loop_seconds(run_dir: Path) -> tuple[float, float]:
    """From the step-0 evaluation's metrics line to the last step's, and the record's own part of it (the steps'
    `time/record_s`: writing the record and taking the trainer's figures)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]["time/elapsed_s"] - rows[0]["time/elapsed_s"], sum(r.get("time/record_s", 0.0) for r in rows)


def one_run(setting: str, steps: int, run_dir: Path) -> dict:
    command = [sys.executable, "-m", "rl_tpu.main", "+recipe=grpo_math", f"trainer.total_steps={steps}"]
    command += ["trainer.checkpoint_final=false", "trainer.export=false", "trainer.plots=false"]
    command += [f"hydra.run.dir={run_dir}", *SETTINGS[setting]]
    load = os.getloadavg()[0]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    record = run_dir / "rollouts"
    size = sum(p.stat().st_size for p in record.rglob("*.jsonl")) if record.is_dir() else 0
    wall = float(done.stdout.split("wall time ")[1].split(" s")[0])
    loop_s, record_s = loop_seconds(run_dir)
    return {
        "setting": setting,
        "loop_s": loop_s,
        "record_s": record_s,
        "wall_s": wall,
        "record_bytes": size,
        "load": load,
    }


def overhead(args) -> None:
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="inspect_record_") as scratch:
        for r in range(args.rounds):
            for setting in ("default", "off"):
                runs.append(one_run(setting, args.steps, Path(scratch) / f"{setting}_{r}"))
                print(runs[-1], flush=True)
    ratios = [on["loop_s"] / off["loop_s"] for on, off in zip(runs[::2], runs[1::2])]
    write_record(
        RESULTS / "inspect_record_overhead.json",
        load_before,
        recipe="grpo_math",
        steps=args.steps,
        runs=runs,
        loop_ratio_per_round=ratios,
        loop_ratio_median=statistics.median(ratios),
        # the record's own seconds over the loop's, in the runs that record: what it adds, free of the load's swings
        record_share_of_loop=[run["record_s"] / run["loop_s"] for run in runs[::2]],
        record_bytes_per_step=runs[0]["record_bytes"] / args.steps,
    )


def repeated(run: Path, steps: int, into: Path) -> Path:
    """A run folder whose metrics and record are RUN's training steps over and over up to `steps`, with RUN's
    evaluations every `eval_every` steps: what a long run of the same recipe leaves for its page."""
    from rl_tpu.outputs import rollout_log

    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    train = rollout_log.read_steps(run / "rollouts")
    evals = rollout_log.read_steps(run / "rollouts" / rollout_log.EVAL_FOLDER)
    into.mkdir(parents=True)
    metrics = []
    for step in range(steps + 1):
        source = (step - 1) % max(train) + 1 if step else 0
        metrics.append({**rows[source], "step": step})
        if step:
            rollout_log.write_step(into / "rollouts", step, train[source])
        if step % min(s for s in evals if s) == 0:
            rollout_log.write_step(into / "rollouts" / "eval", step, evals[0])
    (into / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return into


def page(args) -> None:
    from browser import open_page, set_value, start_browser

    from rl_tpu.outputs.inspect import write_page
    from rl_tpu.outputs.inspect.data import run_data

    load_before = os.getloadavg()
    run = Path(args.run)
    if args.repeat_to:
        run = repeated(run, args.repeat_to, Path(tempfile.mkdtemp(prefix="inspect_long_")) / run.name)
    path = write_page(run)
    made = run_data(run)
    driver = start_browser()
    try:
        driver.set_window_size(1400, 900)
        draw_ms = [open_page(driver, path) for _ in range(3)]
        if args.step is not None:
            driver.execute_script(f"document.querySelector('.step-item[data-step=\"{args.step}\"]').click()")
        set_value(driver, "measure", args.measure)
        driver.execute_script(
            "document.querySelector('#groups .tok') && document.querySelector('#groups .tok').click()"
        )
        screenshot = REPO / "docs" / "images" / f"inspect_{args.name}.png" if args.screenshot else None
        if screenshot:
            driver.save_screenshot(str(screenshot))
    finally:
        driver.quit()
    record = run / "rollouts"
    write_record(
        RESULTS / f"inspect_page_{args.name}.json",
        load_before,
        run=str(args.run),
        repeated_to_steps=args.repeat_to,
        page_bytes=path.stat().st_size,
        steps=len(made["steps"]),
        rows=len(made["samples"]),
        rows_left_out=made["cap"]["left_out"],
        cap=made["cap"],
        record_bytes=sum(p.stat().st_size for p in record.rglob("*.jsonl")),
        draw_ms=draw_ms,
        screenshot=str(screenshot.relative_to(REPO)) if screenshot else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    timed = commands.add_parser("overhead")
    timed.add_argument("--steps", type=int, default=20)
    timed.add_argument("--rounds", type=int, default=2)
    shown = commands.add_parser("page")
    shown.add_argument("run")
    shown.add_argument("--name", required=True)
    shown.add_argument("--step", type=int, help="the step the screenshot shows (default: the page's own choice)")
    shown.add_argument("--measure", default="gap", help="what the tokens are coloured by: gap, adv, ent, lp")
    shown.add_argument("--no-screenshot", dest="screenshot", action="store_false")
    shown.add_argument("--repeat-to", type=int, help="the page of RUN's steps repeated up to this many steps")
    args = parser.parse_args()
    overhead(args) if args.command == "overhead" else page(args)


if __name__ == "__main__":
    main()
