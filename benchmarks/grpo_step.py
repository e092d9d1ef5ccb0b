"""Seconds per GRPO step on DESIGN.md's reference workload: sync and async, fp32 and bf16, 1 and 2 engine
threads, side by side with Hugging Face TRL's GRPOTrainer (`--peer trl`).

The workload, exactly (shared with the peer, benchmarks/peer_trl.py, so nothing here may drift): the
reference byte-level BPE tokenizer (vocab 512, digits not split) and Qwen3 model (3.28M parameters,
random init with seed 0, no warm start); 1,024 problems drawn with `random.Random(0)`
(`a=randint(0,99); b=randint(0,99); op=choice("+-*")`); 16 prompts x 8 completions, at most 32 new
tokens, temperature 1, top_p 1, top_k off; AdamW at a constant 1e-5, no KL term, grad-norm clip 1.0,
one optimizer step per batch.

Each rl_tpu variant runs the controller's loop through the real parts (vLLM sampler actor, FSDP2
trainer actor, reward worker pool, weight sync over the object store): `sync` is
`trainer.max_staleness=0` with both sides free to use every core in turn, `async` is
`max_staleness=1` with trainer and engine pinned to cores of their own when they fit
(`pin_cores=auto`), the trainer computing on the engine's cores too while the engine is idle
(`trainer.borrow_idle_cores=true`, off in a run's defaults; `no loan` without), the trainer eager or
`compiled` (`trainer.compile`), the engine eager or `compiled` (`sampler.enforce_eager=false`: vLLM
torch.compiles the model); `unshared` runs every completion's prompt again
(`trainer.share_prompts=false`). Figures per variant: s/step (median, min, max of `--steps` after
`--warmup` steps: 10 by default, so that a compiled trainer has compiled each block at both thread
counts; their times are in the JSON record; TRL's runs warm up `--peer-warmup`, DESIGN.md's 1),
generated and trained tokens/s, each side's idle
seconds, the seconds the trainer computed on the engine's cores, the trainer's FLOP/s (6 x
parameters x trained positions per train second) as a fraction of a matmul's peak measured in this
run on its own thread count (a borrowing trainer can pass it), and the load average. With `--peer
trl`, TRL runs the same workload in its own virtual environment (made on request, never in CI) in
fp32 and bf16, and then the best rl_tpu fp32 and bf16 variants and TRL's alternate, A B A B, with
the ratio of each pair printed. bf16 runs only where the
CPU computes it natively (AVX512-BF16 or AMX) unless `--dtypes` asks for it.

    python benchmarks/grpo_step.py                 # rl_tpu's variants, about 15 minutes on 2 cores (fp32 only)
    python benchmarks/grpo_step.py --peer trl      # and TRL side by side (first run builds its venv)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from record import cpu_facts, write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.cluster.memory import peak_rss_mb
from rl_tpu.cluster.placement import start_ray
from rl_tpu.config import DataConfig, RunConfig, TinyModelConfig
from rl_tpu.controller.actors import start_actors
from rl_tpu.controller.checks import validate
from rl_tpu.controller.rollouts import RolloutQueue
from rl_tpu.controller.step import grpo_step
from rl_tpu.data.arithmetic import arithmetic_rows
from rl_tpu.data.datasets import batches, load_examples, write_verl_parquet
from rl_tpu.grader.grader import Grader
from rl_tpu.models.precision import cpu_has_native_bf16
from rl_tpu.models.resolve import build_tiny_arith

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


@dataclass(frozen=True)
class Variant:
    mode: str  # sync | async
    dtype: str  # float32 | bfloat16
    trainer_threads: int
    engine_threads: int
    compile: bool = False
    share_prompts: bool = True  # False: every completion runs its prompt again (before trainer.share_prompts)
    borrow: bool = True  # False: the trainer keeps to its own core (before trainer.borrow_idle_cores)
    engine_compile: bool = False  # True: vLLM torch.compiles the model (sampler.enforce_eager=false)

    @property
    def name(self) -> str:
        return (
            f"{self.mode} {'fp32' if self.dtype == 'float32' else 'bf16'} trainer {self.trainer_threads}t"
            f"{' compiled' if self.compile else ''} engine {self.engine_threads}t"
            f"{' compiled' if self.engine_compile else ''}"
            f"{'' if self.share_prompts else ' unshared'}{'' if self.borrow else ' no loan'}"
        )


# sync: the sides take turns, so each may use both cores; async: one core each (pinned, the trainer borrowing the
# engine's while it is idle), or the engine on two; and the pinned layout in each dtype without the loan (eager and
# compiled) and with every prompt run per completion, the baselines of trainer.borrow_idle_cores and
# trainer.share_prompts
VARIANTS = [
    Variant(mode, dtype, 2 if mode == "sync" else 1, engine, compiled)
    for dtype in ("float32", "bfloat16")
    for mode in ("sync", "async")
    for engine in (1, 2)
    for compiled in (False, True)
    if not compiled or (engine == 1 and mode == "async")
]
VARIANTS += [
    Variant("async", dtype, 1, 1, compiled, borrow=False)
    for dtype in ("float32", "bfloat16")
    for compiled in (False, True)
]
VARIANTS += [Variant("async", dtype, 1, 1, share_prompts=False) for dtype in ("float32", "bfloat16")]
# and the pinned layout with a compiled engine, beside an eager and a compiled trainer
VARIANTS += [
    Variant("async", dtype, 1, 1, compiled, engine_compile=True)
    for dtype in ("float32", "bfloat16")
    for compiled in (False, True)
]


def reference_config(model: Path, data: Path, variant: Variant) -> RunConfig:
    cfg = RunConfig()
    cfg.model.path = str(model)
    cfg.model.dtype = variant.dtype
    cfg.data.train_files = cfg.data.val_files = str(data)
    cfg.data.train_batch_size = 16
    cfg.sampler.n, cfg.sampler.response_length, cfg.sampler.temperature = 8, 32, 1.0
    cfg.sampler.top_p, cfg.sampler.top_k = 1.0, -1
    cfg.sampler.threads = variant.engine_threads
    cfg.sampler.enforce_eager = not variant.engine_compile
    cfg.algorithm.lr, cfg.algorithm.warmup_steps, cfg.algorithm.grad_clip = 1e-5, 0, 1.0
    cfg.actor.use_kl_loss = False
    cfg.trainer.world_size, cfg.trainer.threads_per_rank = 1, variant.trainer_threads
    cfg.trainer.max_staleness = 1 if variant.mode == "async" else 0
    cfg.trainer.compile = variant.compile
    cfg.trainer.share_prompts = variant.share_prompts
    cfg.trainer.borrow_idle_cores = variant.borrow
    # TRL runs every row; at random init nearly every group scores 0 alike, and rl_tpu would run almost none
    cfg.trainer.skip_zero_advantage_rows = False
    cfg.trainer.total_steps = 10**6  # the queue stops at total_steps
    cfg.reward.name = "arithmetic"
    return cfg


def parameter_count(model: Path) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters())


def matmul_peak(threads: int, dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matmuls on `threads` threads, in a process of its own."""
    code = (
        f"import torch, time; torch.set_num_threads({threads}); a = torch.randn({size}, {size}, dtype=torch.{dtype})"
        f"; b = a.clone(); a @ b; best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) "
        f"for _ in range({repeats})); print(2 * {size}**3 / best)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, timeout=600
        ).stdout
    )


def measure(variant: Variant, model: Path, data: Path, run_dir: Path, steps: int, warmup: int) -> dict:
    """One variant's figures, through the controller's own loop (its rollout queue and step)."""
    cfg = reference_config(model, data, variant)
    run_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    validate(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = load_examples(cfg.data.train_files, tokenizer, cfg.data)
    grader = Grader(cfg.reward)
    load_before = os.getloadavg()
    actors = start_actors(cfg, model, run_dir, "cpu")
    rows = []
    try:
        queue = RolloutQueue(actors, batches(examples, cfg.data.train_batch_size, cfg.data.seed), cfg, taken=0)
        signal = LearningSignal(cfg)
        for step in range(1, warmup + steps + 1):
            rows.append(grpo_step(step, queue, actors, tokenizer, grader, cfg, signal)[0])
            if step < warmup + steps:
                queue.fill_after(step)
        pinned = json.loads((run_dir / "placement.json").read_text())
    finally:
        actors.shutdown()
        grader.close()
    timed = rows[warmup:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in timed)

    step_s = [r["time/step_s"] for r in timed]
    return {
        "variant": variant.name,
        **variant.__dict__,
        "step_s_warmup": [r["time/step_s"] for r in rows[:warmup]],
        "step_s": statistics.median(step_s),
        "step_s_min": min(step_s),
        "step_s_max": max(step_s),
        "step_s_each": step_s,
        "generate_wait_s": median("time/generate_s"),
        "reward_s": median("time/reward_s"),
        "train_s": median("time/train_s"),
        "sync_s": median("time/sync_s"),
        "publish_s": median("time/publish_s"),
        "receive_s": median("sync/receive_s"),
        "trainer_idle_s": median("time/trainer_idle_s"),
        "trainer_borrowed_s": median("time/trainer_borrowed_s"),
        "sampler_idle_s": statistics.median(r.get("time/sampler_idle_s", float("nan")) for r in timed),
        "gen_tokens_per_step": median("perf/train_tokens"),
        "train_positions_per_step": median("perf/train_positions"),
        "padding_frac": median("perf/padding_frac"),
        "trainer_peak_rss_mb": max(r["perf/trainer_peak_rss_mb"] for r in rows),
        "sampler_peak_rss_mb": max(r.get("perf/sampler_peak_rss_mb", 0.0) for r in rows),  # async: from step 2
        "staleness": median("rollout/staleness"),
        "actors": [{k: a.get(k) for k in ("actor", "pid")} for a in pinned["actors"]],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }


def add_rates(run: dict, params: int, peaks: dict) -> None:
    """Tokens/s over the step, and the trainer's FLOP/s against the matmul peak on its thread count."""
    run["gen_tokens_per_s"] = run["gen_tokens_per_step"] / run["step_s"]
    run["train_flop_per_s"] = 6 * params * run["train_positions_per_step"] / run["train_s"]
    peak = peaks[f"{run['dtype']}_{run['trainer_threads']}t"]
    run["train_flop_of_peak"] = run["train_flop_per_s"] / peak


def run_trl(python: Path, model: Path, data: Path, bf16: bool, steps: int, warmup: int, out: Path) -> dict:
    """TRL in its own process, with rl_tpu's Ray cluster stopped: its daemons would take CPU from TRL."""
    import ray

    ray.shutdown()
    command = [
        str(python),
        str(REPO / "benchmarks" / "peer_trl.py"),
        "--model",
        str(model),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--threads",
        "2",
        "--out",
        str(out),
    ]
    subprocess.run(command + (["--bf16"] if bf16 else []), check=True, timeout=3600)
    record = json.loads(out.read_text())
    return {
        **record,
        "step_s_min": record["min"],
        "step_s_max": record["max"],
        "variant": f"TRL {'bf16' if bf16 else 'fp32'} 2t",
        "dtype": "bfloat16" if bf16 else "float32",
    }


def pair_ratios(pairs: list[dict], trl_runs: list[dict]) -> dict[str, float]:
    """rl_tpu's best variant per dtype over TRL's in the same dtype, and bf16 over TRL's fp32 (the issue's targets):
    the medians of the pairs' step times, and, stricter, against TRL's fastest run of the invocation (grid or pair)."""

    def median_step(side: str, dtype: str) -> float | None:
        times = [p[side]["step_s"] for p in pairs if p[side]["dtype"] == dtype]
        return statistics.median(times) if times else None

    ours = {dtype: median_step("rl_tpu", dtype) for dtype in ("float32", "bfloat16")}
    theirs = {dtype: median_step("trl", dtype) for dtype in ("float32", "bfloat16")}
    fastest = {
        dtype: min((r["step_s"] for r in trl_runs if r["dtype"] == dtype), default=None)
        for dtype in ("float32", "bfloat16")
    }
    wanted = {
        "fp32 / TRL fp32": ("float32", "float32"),
        "bf16 / TRL bf16": ("bfloat16", "bfloat16"),
        "bf16 / TRL fp32": ("bfloat16", "float32"),
    }
    ratios = {f"rl_tpu {name}": ours[a] / theirs[b] for name, (a, b) in wanted.items() if ours[a] and theirs[b]}
    ratios |= {
        f"rl_tpu {name}'s fastest run": ours[a] / fastest[b]
        for name, (a, b) in wanted.items()
        if ours[a] and fastest[b]
    }
    return ratios


def show(run: dict) -> None:
    extra = ""
    if "train_s" in run:
        extra = (
            f" | generate wait {run['generate_wait_s']:.3f}, train {run['train_s']:.3f}, sync {run['sync_s']:.3f} "
            f"(publish {run['publish_s']:.3f}, engine receive {run['receive_s']:.3f}); "
            f"idle trainer {run['trainer_idle_s']:.3f} sampler {run['sampler_idle_s']:.3f}; trainer on engine "
            f"cores {run['trainer_borrowed_s']:.3f}; train "
            f"{run['train_flop_per_s'] / 1e9:.0f} GFLOP/s = {run['train_flop_of_peak']:.2f} of peak; padding "
            f"{run['padding_frac']:.1%}"
        )
    print(
        f"{run['variant']:<42} {run['step_s']:.3f} s/step (min {run['step_s_min']:.3f}, max "
        f"{run['step_s_max']:.3f}){extra}; load {run['load_average_after'][0]:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[v.name for v in VARIANTS],
        help="names as printed, e.g. 'async bf16 trainer 1t engine 1t'",
    )
    parser.add_argument("--steps", type=int, default=5)
    # DESIGN.md's reference figure warms up 1 step, as TRL's runs do; a compiled trainer that borrows cores compiles
    # each block once per thread count as each first occurs, which took up to 8 steps here
    parser.add_argument("--warmup", type=int, default=10, help="rl_tpu's warm-up steps")
    parser.add_argument("--peer-warmup", type=int, default=1, help="TRL's warm-up steps")
    parser.add_argument("--peer", choices=["trl"], help="also run Hugging Face TRL's GRPOTrainer (own venv)")
    parser.add_argument("--pairs", type=int, default=2, help="A B rounds of the best variants against TRL")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=["float32", "bfloat16"],
        help="default: float32, and bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "grpo_step.json")
    args = parser.parse_args()
    native_bf16 = cpu_has_native_bf16()
    dtypes = args.dtypes or (["float32", "bfloat16"] if native_bf16 else ["float32"])
    if not native_bf16 and not args.dtypes:
        print(
            f"{cpu_facts().get('cpu')}: no native bf16 (AVX512-BF16 or AMX), where a bf16 matmul runs far below fp32; "
            "bf16 variants left out (--dtypes float32 bfloat16 runs them)",
            flush=True,
        )
    chosen = [v for v in VARIANTS if v.name in args.variants and v.dtype in dtypes]
    unknown = set(args.variants) - {v.name for v in VARIANTS}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    load_before = os.getloadavg()
    trl_python = None
    if args.peer == "trl":
        import peer_trl  # beside this script; imports neither torch nor TRL

        trl_python = peer_trl.make_venv()
    peaks = {f"{dtype}_{t}t": matmul_peak(t, dtype) for dtype in dtypes for t in (1, 2)}
    print("matmul peak GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in peaks.items()), flush=True)
    runs, pairs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build_workload(Path(tmp))
        params = parameter_count(model)

        def rl_tpu(variant: Variant, tag: str) -> dict:
            start_ray(reference_config(model, data, variant).ray)  # again after a TRL run stopped it
            run = measure(variant, model, data, Path(tmp) / f"run-{len(runs) + len(pairs)}", args.steps, args.warmup)
            add_rates(run, params, peaks)
            run["round"] = tag
            show(run)
            return run

        def trl(bf16: bool, tag: str) -> dict:
            run = run_trl(trl_python, model, data, bf16, args.steps, args.peer_warmup, Path(tmp) / "trl.json")
            run["round"] = tag
            show(run)
            return run

        runs = [rl_tpu(v, "grid") for v in chosen]
        if trl_python:
            runs += [trl(dtype == "bfloat16", "grid") for dtype in dtypes]
            for dtype in dtypes:
                best = min((r for r in runs if r["dtype"] == dtype and "mode" in r), key=lambda r: r["step_s"])
                variant = next(v for v in chosen if v.name == best["variant"])
                for i in range(args.pairs):
                    a, b = rl_tpu(variant, f"pair {i + 1}"), trl(dtype == "bfloat16", f"pair {i + 1}")
                    pairs.append({"rl_tpu": a, "trl": b, "ratio": a["step_s"] / b["step_s"]})
                    print(
                        f"pair {i + 1}: {a['variant']} / {b['variant']} = {a['step_s'] / b['step_s']:.2f}", flush=True
                    )
    ratios = pair_ratios(pairs, [r for r in runs + [p["trl"] for p in pairs] if r["variant"].startswith("TRL")])
    print("ratios: the median of rl_tpu's step times in the pairs over TRL's (or over TRL's fastest run)", flush=True)
    for name, ratio in ratios.items():
        print(f"  {name}: {ratio:.2f}", flush=True)
    record = write_record(
        args.out,
        load_before,
        steps=args.steps,
        warmup=args.warmup,
        peer_warmup=args.peer_warmup,
        parameters=params,
        native_bf16=native_bf16,
        matmul_peak_flop_per_s=peaks,
        driver_peak_rss_mb=peak_rss_mb(),
        runs=runs,
        pairs=pairs,
        ratios=ratios,
    )
    print(f"driver peak RSS {record['driver_peak_rss_mb']:.0f} MiB")


if __name__ == "__main__":
    main()
