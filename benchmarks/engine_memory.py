"""A vLLM engine's memory on CPU against the memory plan's estimate of it (rl_tpu/controller/memory_plan.py).

For each Qwen2.5 shape (`real_size.build_model`: random bf16 weights, built locally) a fresh process makes rl_tpu's
own `Sampler` (the engine actor's class, run here without Ray) and generates twice; a thread samples its resident
memory every 50 ms: the peak (VmHWM), the weight files' mapped pages at their largest (loading), and the resident
memory after loading and after generating. The plan's phases for the same settings are written beside them.

    python benchmarks/engine_memory.py          # writes benchmarks/results/engine_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from real_size import build_model_in_subprocess
from record import write_record

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GiB = 2**30


def status_gib() -> dict[str, float]:
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    lines = (line.split(":") for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(v.split()[0]) * 1024 / GiB for k, v in lines if k in fields}


def measure_engine(model: str, kv_cache_gb: float, max_model_len: int) -> dict:
    """In this process: rl_tpu's Sampler on `model`, then two generations; its memory as it went."""
    largest_file = [0.0]

    def watch() -> None:
        while True:
            largest_file[0] = max(largest_file[0], status_gib()["RssFile"])
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    from rl_tpu.sampler.engine import Sampler

    imported = status_gib()["VmRSS"]
    sampler = Sampler(model, "bfloat16", max_model_len, kv_cache_gb, seed=0)
    loaded = status_gib()
    from vllm import SamplingParams

    prompts = [f"Question {i}: what is {i} plus {3 * i}? Answer step by step." for i in range(8)]
    for _ in range(2):
        sampler.llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0), use_tqdm=False)
    done = status_gib()
    return {
        "rss_after_imports_gib": imported,
        "rss_after_loading_gib": loaded["VmRSS"],
        "rss_after_generating_gib": done["VmRSS"],
        "peak_rss_gib": done["VmHWM"],
        "mapped_files_largest_gib": largest_file[0],
    }


def planned(model: Path, kv_cache_gb: float) -> tuple[int, dict[str, float]]:
    """The model's parameter count and the plan's engine phases in GiB."""
    from rl_tpu.config import RunConfig
    from rl_tpu.models.families import model_shape
    from rl_tpu.sampler.memory import phases as engine_phases

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.sampler.kv_cache_gb = "cpu", "bfloat16", kv_cache_gb
    shape = model_shape(model)
    phases = engine_phases(cfg, shape, "cpu", None, 0.0)  # on CPU vLLM is given no share
    return shape.parameters, {phase: sum(item.bytes for item in items) / GiB for phase, items in phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=544)  # real_size.py's 512 prompt + 32 new tokens
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/engine_memory.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a model folder: measure it in this process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_engine(args.child, args.kv_cache_gb, args.max_model_len)))
        return
    load_before = os.getloadavg()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            model = build_model_in_subprocess(Path(tmp) / shape, shape)
            command = [sys.executable, __file__, "--child", str(model), "--kv-cache-gb", str(args.kv_cache_gb)]
            done = subprocess.run(
                [*command, "--max-model-len", str(args.max_model_len)], capture_output=True, text=True, check=True
            )
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            parameters, plan = planned(model, args.kv_cache_gb)
            runs[shape] = {
                "parameters": parameters,
                **measured,
                "plan_gib": plan,
                "plan_peak_over_measured_peak": max(plan.values()) / measured["peak_rss_gib"],
                "load_average": os.getloadavg(),
            }
            print(shape, json.dumps(runs[shape]))
    write_record(args.out, load_before, args=vars(args), runs=runs)


if __name__ == "__main__":
    main()
