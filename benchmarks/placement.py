"""Seconds per GRPO step on DESIGN.md's reference workload by placement: 1 vs 2 engines, colocated vs disaggregated.

The workload and the measurement are `grpo_step.py`'s (the full synchronous loop through the
real actors, median of `--steps` after `--warmup`), with one trainer thread. The variants,
all in one invocation so that the ratios compare like with like:

- `disaggregated, 1 engine`: the baseline (trainer and engine each hold a CPU of their own in Ray's
  accounting), measured first and last; ratios are to the mean of the two;
- `disaggregated, 2 engines`: each engine generates half of every batch and installs every version;
- `colocated, 1 engine`: trainer and engine share one bundle (one CPU).

On CPU a layout changes Ray's accounting, not which cores the processes run on (no affinity
is set), so colocated and disaggregated should differ by noise only; two engines split the
generation of a batch between two processes on this machine's two cores.

    python benchmarks/placement.py      # about 5 minutes; writes benchmarks/results/placement.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from record import write_record  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import REPO, build_workload, measure, reference_config

from rl_tpu.cluster.placement import start_ray

# the baseline runs first and last, so that a drift in the machine's load shows in its two figures
VARIANTS = [("disaggregated", 1), ("disaggregated", 2), ("colocated", 1), ("disaggregated", 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "placement.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build_workload(Path(tmp))
        for layout, engines in VARIANTS:
            cfg = reference_config(model, data, threads=1)
            cfg.placement, cfg.sampler.num_engines = layout, engines
            start_ray(cfg.ray)
            run_dir = Path(tmp) / f"run-{layout}-{engines}"
            runs.append({**measure(cfg, model, run_dir, args.steps, args.warmup), "load_average": os.getloadavg()})
    baselines = [r for r in runs if (r["layout"], r["engines"]) == VARIANTS[0]]
    base_step = sum(r["step_s"] for r in baselines) / len(baselines)
    base_generate = sum(r["generate_s"] for r in baselines) / len(baselines)
    for run in runs:
        run["step_s_vs_baseline"] = run["step_s"] / base_step
        run["generate_s_vs_baseline"] = run["generate_s"] / base_generate
        print(
            f"{run['layout']}, {run['engines']} engine(s): {run['step_s']:.3f} s/step "
            f"({run['step_s_vs_baseline']:.2f} x baseline; generate {run['generate_s']:.3f} s, "
            f"{run['generate_s_vs_baseline']:.2f} x; train {run['train_s']:.3f}, sync {run['sync_s']:.3f}); "
            f"{run['gen_tokens_per_s']:,.0f} generated tokens/s; sampler peak RSS {run['sampler_peak_rss_mb']:.0f} MiB; "
            f"load average {run['load_average'][0]:.2f}"
        )
    write_record(args.out, load_before, steps=args.steps, warmup=args.warmup, runs=runs)


if __name__ == "__main__":
    main()
