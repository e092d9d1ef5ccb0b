"""Seconds per GRPO step on DESIGN.md's reference workload, with 1 and 2 trainer threads.

The workload, exactly (shared with the peer benchmark, so nothing here may drift): the
reference byte-level BPE tokenizer (vocab 512, digits not split) and Qwen3 model (3.28M
parameters, fp32, random init with seed 0, no warm start); 1,024 problems drawn with
`random.Random(0)` (`a=randint(0,99); b=randint(0,99); op=choice("+-*")`); 16 prompts x 8
completions, at most 32 new tokens, temperature 1, top_p 1, top_k off; AdamW at a constant
1e-5, no KL term, grad-norm clip 1.0, one optimizer step per batch.

Each step is the full synchronous loop through the real parts (vLLM sampler actor, FSDP2
trainer actor, reward worker pool, weight sync over the object store). Figures: median of
`--steps` steps after `--warmup`, generation and training tokens/s, peak RSS of the driver,
trainer and sampler processes, and the load average; the 2-thread figures are also given as
ratios to the 1-thread run measured in the same invocation.

    python benchmarks/grpo_step.py          # about 2 minutes; writes benchmarks/results/grpo_step.json
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu import controller  # noqa: E402
from rl_tpu.config import DataConfig, RunConfig, TinyModelConfig  # noqa: E402
from rl_tpu.data import arithmetic_rows, batches, load_examples, write_verl_parquet  # noqa: E402
from rl_tpu.grader import Grader  # noqa: E402
from rl_tpu.metrics import peak_rss_mb  # noqa: E402
from rl_tpu.models import build_tiny_arith  # noqa: E402
from rl_tpu.workers import start_workers  # noqa: E402

NUM_PROBLEMS = 1024


def reference_problems() -> list[tuple[int, str, int]]:
    rng = random.Random(0)
    problems = []
    for _ in range(NUM_PROBLEMS):
        a = rng.randint(0, 99)
        b = rng.randint(0, 99)
        problems.append((a, rng.choice("+-*"), b))
    return problems


def build_workload(folder: Path) -> tuple[Path, Path]:
    """The reference model folder and the problems as verl-schema parquet."""
    model = folder / "reference-model"
    build_tiny_arith(TinyModelConfig(split_digits=False, warm_start_steps=0), DataConfig(), model)
    data = folder / "reference.parquet"
    write_verl_parquet(arithmetic_rows("+-*", 99, "train", reference_problems()), data)
    return model, data


def reference_config(model: Path, data: Path, threads: int) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(model)
    cfg.data.train_files = cfg.data.val_files = str(data)
    cfg.data.train_batch_size = 16
    cfg.sampler.n, cfg.sampler.response_length, cfg.sampler.temperature = 8, 32, 1.0
    cfg.sampler.top_p, cfg.sampler.top_k = 1.0, -1
    cfg.algorithm.lr, cfg.algorithm.warmup_steps, cfg.algorithm.grad_clip = 1e-5, 0, 1.0
    cfg.actor.use_kl_loss = False
    cfg.trainer.world_size, cfg.trainer.threads_per_rank = 1, threads
    cfg.reward.name = "arithmetic"
    return cfg


def measure(cfg: RunConfig, model: Path, run_dir: Path, steps: int, warmup: int) -> dict:
    """The steps' figures; `run_dir` takes the actors' logs and placement.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    controller.validate(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_examples(cfg.data.train_files, tokenizer, cfg.data)
    grader = Grader(cfg.reward)
    workers = start_workers(cfg, model, run_dir, "cpu")
    layout = workers.reservation.plan.layout
    rows = []
    try:
        prompt_batches = batches(examples, cfg.data.train_batch_size, cfg.data.seed)
        for step in range(1, warmup + steps + 1):
            prompts = next(prompt_batches)
            rows.append(controller.grpo_step(step, prompts, controller.generate_batch(workers, prompts, cfg, step), workers,
                                             tokenizer, grader, cfg))
    finally:
        workers.shutdown()
        grader.close()
    timed = rows[warmup:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    return {
        "threads": cfg.trainer.threads_per_rank,
        "engines": cfg.sampler.num_engines,
        "layout": layout,
        "step_s": median("time/step_s"),
        "generate_s": median("time/generate_s"),
        "reward_s": median("time/reward_s"),
        "train_s": median("time/train_step_s"),
        "sync_s": median("time/sync_s"),
        "gen_tokens_per_s": median("perf/gen_tokens_per_s"),
        "train_tokens_per_s": median("perf/train_tokens_per_s"),
        "trainer_peak_rss_mb": max(r["perf/trainer_peak_rss_mb"] for r in rows),
        "sampler_peak_rss_mb": max(r["perf/sampler_peak_rss_mb"] for r in rows),
        "step_s_each": [r["time/step_s"] for r in timed],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "grpo_step.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build_workload(Path(tmp))
        base = reference_config(model, data, args.threads[0])
        controller.start_ray(base)
        runs = [measure(reference_config(model, data, t), model, Path(tmp) / f"run-{t}-threads", args.steps,
                        args.warmup) for t in args.threads]
    for run in runs:
        run["step_s_vs_first"] = run["step_s"] / runs[0]["step_s"]
        print(f"{run['threads']} thread(s): {run['step_s']:.3f} s/step (generate {run['generate_s']:.3f}, reward "
              f"{run['reward_s']:.3f}, train {run['train_s']:.3f}, sync {run['sync_s']:.3f}); "
              f"{run['gen_tokens_per_s']:,.0f} generated tokens/s, {run['train_tokens_per_s']:,.0f} trained tokens/s; "
              f"peak RSS trainer {run['trainer_peak_rss_mb']:.0f} MiB, sampler {run['sampler_peak_rss_mb']:.0f} MiB; "
              f"{run['step_s_vs_first']:.2f} x the {runs[0]['threads']}-thread step time")
    record = write_record(args.out, load_before, steps=args.steps, warmup=args.warmup,
                          driver_peak_rss_mb=peak_rss_mb(), runs=runs)
    print(f"driver peak RSS {record['driver_peak_rss_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
