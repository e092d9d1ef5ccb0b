"""Reward scoring throughput: the worker pool against calling the same function in-process.

Scores GSM8K gold solutions (and perturbed ones) with the `gsm8k` reward, and boxed answers
with the `math` reward (math-verify), in batches of `--batch` samples: in-process (the floor
without isolation) and through `rl_tpu.grader.Grader` with 1 and 2 worker processes. Reports
samples/s, the ratio to in-process, and the pool's start-up time. Medians of `--repeats`.

    python benchmarks/reward_pool.py --gsm8k ../shared/data/gsm8k/test.jsonl   # writes results/reward_pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rewards import gsm8k
from rewards import math as math_reward
from rl_tpu.config import RewardConfig
from rl_tpu.grader.grader import Grader, Sample

MATH_ANSWERS = [
    ("\\frac{1}{2}", "0.5"),
    ("\\sqrt{8}", "2\\sqrt{2}"),
    ("(0,1]", "[0,1]"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("\\frac{3}{4}", "0.74"),
    ("2\\pi", "\\pi \\cdot 2"),
    ("3", "3.0"),
]


def gsm8k_samples(path: Path, count: int) -> list[Sample]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    samples = []
    for row in (rows * (count // (2 * len(rows)) + 1))[: count // 2]:
        head, answer = row["answer"].rsplit("#### ", 1)
        truth = answer.replace(",", "")
        samples += [
            Sample("openai/gsm8k", row["answer"], truth, {}),
            Sample("openai/gsm8k", f"{head}#### {int(truth) + 1}", truth, {}),
        ]
    return samples


def math_samples(count: int) -> list[Sample]:
    return [
        Sample("math", f"So the answer is $\\boxed{{{answer}}}$.", truth, {})
        for truth, answer in (MATH_ANSWERS * (count // len(MATH_ANSWERS) + 1))[:count]
    ]


def in_process(fn, samples: list[Sample]) -> float:
    start = time.perf_counter()
    for s in samples:
        fn(s.data_source, s.solution_str, s.ground_truth, s.extra_info)
    return time.perf_counter() - start


def measure(name: str, fn, samples: list[Sample], repeats: int) -> dict:
    floor = statistics.median(in_process(fn, samples) for _ in range(repeats))
    row = {"reward": name, "samples": len(samples), "in_process_s": floor, "in_process_per_s": len(samples) / floor}
    print(f"{name}: {len(samples)} samples, in-process {len(samples) / floor:,.0f}/s")
    for workers in (1, 2):
        start = time.perf_counter()
        grader = Grader(RewardConfig(name=name, num_workers=workers))
        started = time.perf_counter() - start
        grader.grade(samples)  # warm-up: first-call caches in the workers
        seconds = statistics.median(grader.grade(samples).seconds for _ in range(repeats))
        grader.close()
        row[f"pool{workers}_s"] = seconds
        row[f"pool{workers}_per_s"] = len(samples) / seconds
        row[f"pool{workers}_vs_in_process"] = floor / seconds
        row[f"pool{workers}_start_s"] = started
        print(
            f"  pool x{workers}: {len(samples) / seconds:,.0f}/s = {floor / seconds:.2f} of in-process "
            f"(start-up {started:.2f} s)"
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=Path, default=REPO / "tests" / "fixtures" / "gsm8k" / "test.jsonl")
    parser.add_argument("--batch", type=int, default=256, help="samples per graded batch (a GRPO step's rollouts)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "reward_pool.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = [
        measure("gsm8k", gsm8k.compute_score, gsm8k_samples(args.gsm8k, args.batch), args.repeats),
        measure("math", math_reward.compute_score, math_samples(args.batch), args.repeats),
    ]
    write_record(args.out, load_before, repeats=args.repeats, results=rows)


if __name__ == "__main__":
    main()
