"""The weight canary's figures (rl_tpu/sync/canary.py): the gap a correct install shows, how far one update moves
the canary (what a stale engine's gap would be), and what the canary costs against a step.

Tiny recipe: `grpo_math` and `grpo_math_lora`, fp32 and bf16, one CLI run of --steps steps each (the tiny model
the recipe builds, held-out evaluation cut to 32 prompts); per install, `sync/canary_gap`, `sync/canary_gap_mean`,
`sync/canary_moved`, `time/canary_s` (the engine's scoring after its load: what the canary adds to the step's path
in sync mode) and `time/canary_trainer_s` (the trainer's, beside the install and the next generation in sync mode,
on the trainer's path in async mode) against `time/step_s` and against the step's wall time (`time/elapsed_s` from
the line before), read from metrics.jsonl (step 0: the version-0 canary); the first step is left out of the shares.
LoRA's first use: with `grpo_math_lora`'s settings in bf16 (the shipped tiny model, synthetic batches), after each of
--repeats installs the engine's scoring inside the install (`time/canary_s`) and then the same canary scored again:
the first request after an install pays for vLLM making the new adapter active, which the next generation would
pay otherwise.
0.5B shape: `real_size.py`'s Qwen2.5-0.5B-shaped model (random init, 151,936-entry vocabulary), a trainer rank and
an engine started as a run starts them, fp32 and bf16 (fp32 residual, the default); the version-0 canary scored
--repeats times: its gap (a correct install's: both sides hold the same weights) and each side's seconds, seen from
the driver, one after the other (in a run they overlap), against the 0.5B step of benchmarks/results/real_size.json
(world size 1).

    python benchmarks/canary.py                   # about 20 minutes on 2 cores; writes benchmarks/results/canary.json
    python benchmarks/canary.py --shapes tiny     # the tiny recipe only
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
from pathlib import Path

from real_size import build_model_in_subprocess
from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY_RUNS = {  # name: (recipe, dtype)
    "grpo_math fp32": ("grpo_math", "float32"),
    "grpo_math bf16": ("grpo_math", "bfloat16"),
    "grpo_math_lora fp32": ("grpo_math_lora", "float32"),
    "grpo_math_lora bf16": ("grpo_math_lora", "bfloat16"),
}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "max": max(values), "min": min(values)}


def tiny_run(recipe: str, dtype: str, steps: int, folder: Path) -> dict:
    """One CLI run of the recipe; the canary's figures of each install, and their spread."""
    command = [
        sys.executable,
        "-m",
        "rl_tpu.main",
        f"+recipe={recipe}",
        f"model.dtype={dtype}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=100000",
        "data.val_max_samples=32",
        "trainer.plots=false",
        f"hydra.run.dir={folder}",
    ]
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] > 0 and "sync/canary_gap" in r]
    keys = ("sync/canary_gap", "sync/canary_gap_mean", "sync/canary_moved", "time/canary_s", "time/step_s")
    keys += ("time/canary_trainer_s",)
    each = {key: [r[key] for r in steps_rows if key in r] for key in keys}
    # the first step's time holds one-off work (the engine's first generations): the cost is measured without it.
    # A step's wall time: from the line before to its own (time/step_s leaves out what the driver does between steps)
    later = [r for r in steps_rows if r["step"] > 1]
    wall = {r["step"]: r["time/elapsed_s"] - rows[i - 1]["time/elapsed_s"] for i, r in enumerate(rows) if i}
    return {
        "recipe": recipe,
        "dtype": dtype,
        "wall_s": time.perf_counter() - started,
        "gap_at_start": rows[0]["sync/canary_gap"],
        "gap_mean_at_start": rows[0]["sync/canary_gap_mean"],
        "per_install": each,
        **{key.split("/")[1]: spread(values) for key, values in each.items() if values},
        "step_wall_s": spread([wall[r["step"]] for r in later]),
        "canary_share_of_step": statistics.median(r["time/canary_s"] / r["time/step_s"] for r in later),
        "canary_share_of_step_wall": statistics.median(r["time/canary_s"] / wall[r["step"]] for r in later),
        "trainer_canary_share_of_step": statistics.median(r["time/canary_trainer_s"] / r["time/step_s"] for r in later),
        "load_average": os.getloadavg(),
    }


def timed_canary(sampler, tokens) -> float:
    """Run inside the engine: its scoring of the canary, in seconds, as the install times it."""
    start = time.perf_counter()
    sampler.score_canary(tokens)
    return time.perf_counter() - start


def lora_first_use(repeats: int, folder: Path) -> dict:
    """The engine's canary inside each install against the same canary scored right after, LoRA in bf16."""
    import ray

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_batch

    from rl_tpu.cluster.placement import start_ray
    from rl_tpu.config import RunConfig
    from rl_tpu.controller.actors import start_actors
    from rl_tpu.models.shipped import SHIPPED, read_manifest

    model = SHIPPED / next(key for key, entry in read_manifest().items() if entry["name"] == "grpo_math")
    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.sampler.kv_cache_gb = "cpu", "bfloat16", 0.25
    cfg.actor.lora.lora_rank, cfg.algorithm.lr = 8, 5e-4
    start_ray(cfg.ray, 2**26)
    first, again = [], []
    try:
        actors = start_actors(cfg, model, folder, "cpu")
        engine = actors.samplers.engines[0]
        try:
            for version in range(1, repeats + 1):
                actors.train(make_batch(version))
                actors.install(actors.publish(version))
                first.append(actors.samplers.settle_canary()["time/canary_s"])
                again.append(ray.get(engine.__ray_call__.remote(timed_canary, actors.canary), timeout=600))
        finally:
            actors.shutdown()
    finally:
        ray.shutdown()
    return {"in_install_s": spread(first), "again_s": spread(again), "load_average": os.getloadavg()}


def shape_config(model: Path, dtype: str):
    from rl_tpu.config import RunConfig

    cfg = RunConfig()
    cfg.device, cfg.model.path, cfg.model.dtype = "cpu", str(model), dtype
    cfg.sampler.kv_cache_gb, cfg.data.max_prompt_length, cfg.sampler.response_length = 0.5, 64, 16
    cfg.ray.object_store_mb = 2048
    return cfg


def shape_canary(model: Path, dtype: str, repeats: int, folder: Path) -> dict:
    """The version-0 canary at the model's shape, `repeats` times: the gap and each side's seconds."""
    import ray

    from rl_tpu.cluster.placement import start_ray
    from rl_tpu.controller.actors import start_actors

    cfg = shape_config(model, dtype)
    start_ray(cfg.ray, 2 * 2**30)
    try:
        actors = start_actors(cfg, model, folder, "cpu")
        try:
            gaps, means, trainer_s, engine_s = [], [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                trainer = actors.on_trainers("score_canary", "scoring the canary", 0, actors.canary)
                middle = time.perf_counter()
                calls = [(name, ray.put(canary)) for name, canary in zip(actors.trainer_names, trainer)]
                figures = actors.samplers.check_canary(actors.canary, calls, 600)
                trainer_s.append(middle - start)
                engine_s.append(time.perf_counter() - middle)
                gaps.append(figures["sync/canary_gap"])
                means.append(figures["sync/canary_gap_mean"])
        finally:
            actors.shutdown()
    finally:
        ray.shutdown()
    return {
        "dtype": dtype,
        "tokens": len(trainer[0].logprobs),
        "gap": max(gaps),
        "gap_mean": max(means),
        "trainer_s": spread(trainer_s),
        "engine_s": spread(engine_s),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "lora", "0.5b"], choices=["tiny", "lora", "0.5b"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "canary.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    figures: dict = {"args": vars(args) | {"out": str(args.out)}}
    with tempfile.TemporaryDirectory() as tmp:
        if "tiny" in args.shapes:
            figures["tiny"] = {}
            for name, (recipe, dtype) in TINY_RUNS.items():
                figures["tiny"][name] = tiny_run(recipe, dtype, args.steps, Path(tmp) / name.replace(" ", "_"))
                run = figures["tiny"][name]
                print(
                    f"{name}: gap {run['canary_gap']['max']:.3g} at most (start {run['gap_at_start']:.3g}), one "
                    f"update moved it {run['canary_moved']['min']:.3g} at least; the canary "
                    f"{100 * run['canary_share_of_step']:.2f}% of time/step_s, "
                    f"{100 * run['canary_share_of_step_wall']:.2f}% of a step's wall time",
                    flush=True,
                )
        if "lora" in args.shapes:
            figures["lora_first_use"] = lora_first_use(2 * args.steps, Path(tmp) / "lora_first_use")
            use = figures["lora_first_use"]
            print(
                f"LoRA bf16: the canary inside the install {1000 * use['in_install_s']['median']:.1f} ms, again "
                f"{1000 * use['again_s']['median']:.1f} ms (medians)",
                flush=True,
            )
        if "0.5b" in args.shapes:
            model = build_model_in_subprocess(Path(tmp) / "model")
            step_s = json.loads((REPO / "benchmarks/results/real_size.json").read_text())["runs"][0]["step_s"]
            figures["0.5b"] = {"step_s_of_real_size_json": step_s}
            for dtype in ("float32", "bfloat16"):
                shape = shape_canary(model, dtype, args.repeats, Path(tmp) / f"shape_{dtype}")
                cost = shape["trainer_s"]["median"] + shape["engine_s"]["median"]
                shape["canary_share_of_step"] = cost / step_s
                figures["0.5b"][dtype] = shape
                print(
                    f"0.5b {dtype}: gap {shape['gap']:.3g}; {cost:.2f} s, {100 * cost / step_s:.2f}% of a "
                    f"{step_s:.0f} s step",
                    flush=True,
                )
    write_record(args.out, load_before, **figures)


if __name__ == "__main__":
    main()
