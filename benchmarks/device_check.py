"""The device check: a few GRPO steps on the device this host has, with the figures that tell it works well.

One script, meant to finish in under 5 minutes on a GPU. It runs

1. the tiny recipe (`model=tiny_arith`, fp32) for `--steps` steps on `--device`: the whole loop
   (placement, FSDP2 ranks, vLLM engine, weight sync) on real hardware, and
2. unless `--no-real-size`, the real-size benchmark (`benchmarks/real_size.py`: Qwen2.5-0.5B's
   shape and vocabulary, bf16, GSM8K) at trainer world size 1,

and reports for each: trainer MFU (6 x parameters x trained tokens per second of the train
step, against the bf16 dense peak of the GPU it finds; on CPU the achieved FLOP/s only),
generated tokens/s, and weight-sync GB/s next to a device-to-device copy of the same number of
bytes measured in the same run.

    python benchmarks/device_check.py --device cuda     # writes benchmarks/results/device_check_cuda.json
    python benchmarks/device_check.py --device cpu --no-real-size --steps 2    # what the test suite runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu import controller  # noqa: E402
from rl_tpu.config import RunConfig  # noqa: E402
from rl_tpu.metrics import read_metrics  # noqa: E402

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from the vendors' data sheets, by a name
# fragment of torch.cuda.get_device_name(); the first fragment that matches wins.
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0,
                    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0}


def bf16_peak_tflops(device: str) -> tuple[str, float | None]:
    """The accelerator's name and its bf16 dense peak (None when unknown, or on CPU)."""
    if device != "cuda":
        return "cpu", None
    import torch

    name = torch.cuda.get_device_name(0)
    return name, next((peak for fragment, peak in BF16_PEAK_TFLOPS.items() if fragment in name), None)


def copy_gb_per_s(num_bytes: int, device: str, repeats: int = 5) -> float:
    """A device-to-device copy of `num_bytes` (host memory on CPU): the ceiling a weight sync is compared with."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):  # the first warms caches and allocators
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times[1:]) / 1e9


def parameter_count(model_path: Path) -> int:
    """Parameters of the model folder, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def figures(run_dir: Path, model_path: Path, device: str, peak_tflops: float | None) -> dict:
    """Medians over the measured steps (after the first) of one run's metrics."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "actor/loss" in r]
    measured = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    params = parameter_count(model_path)
    train_flops = 6 * params * median("perf/train_tokens") / median("time/train_s")  # forward 2, backward 4
    sync_bytes = median("sync/bytes")
    sync_gb_per_s = sync_bytes / median("time/sync_s") / 1e9
    copy = copy_gb_per_s(int(sync_bytes), device)
    return {
        "parameters": params, "steps_measured": len(measured),
        "train_tflops_per_s": train_flops / 1e12,
        "mfu": train_flops / 1e12 / peak_tflops if peak_tflops else None,
        "gen_tokens_per_s": median("perf/gen_tokens_per_s"), "train_tokens_per_s": median("perf/train_tokens_per_s"),
        "step_s": median("time/step_s"), "logprob_diff": median("actor/logprob_diff"),
        "sync_bytes": sync_bytes, "sync_gb_per_s": sync_gb_per_s, "device_copy_gb_per_s": copy,
        "sync_vs_copy": sync_gb_per_s / copy,
    }


def tiny_config(device: str, steps: int, warm_start_steps: int, cache_dir: Path) -> RunConfig:
    cfg = RunConfig()
    cfg.device, cfg.cache_dir = device, str(cache_dir)
    cfg.model.tiny.warm_start_steps = warm_start_steps
    cfg.data.train_batch_size, cfg.data.num_eval, cfg.sampler.n = 8, 64, 8
    cfg.trainer.total_steps, cfg.trainer.eval_every = steps, 10_000
    cfg.trainer.export, cfg.trainer.checkpoint_final, cfg.trainer.checkpoint_every = False, False, 0
    if device != "cpu":
        cfg.sampler.kv_cache_gb, cfg.sampler.enforce_eager = None, False  # gpu_memory_utilization decides
    return cfg


def check_tiny(args, tmp: Path, peak: float | None) -> dict:
    cfg = tiny_config(args.device, args.steps, args.warm_start_steps, tmp / "cache")
    started = time.perf_counter()
    controller.run(cfg, tmp / "tiny", show_progress=False)
    (model_path,) = (tmp / "cache" / "models").glob("tiny_arith-*")
    return {"workload": "tiny_arith, fp32, 8 prompts x 8 completions x 16 tokens",
            "wall_s": time.perf_counter() - started, **figures(tmp / "tiny", model_path, args.device, peak)}


def check_real_size(args, tmp: Path, peak: float | None) -> dict:
    import real_size

    model = real_size.build_model_in_subprocess(tmp / "model")
    train, test = real_size.prepare_data(args.gsm8k, tmp / "data")
    options = argparse.Namespace(device=args.device, prompts=8, n=4, new_tokens=128, micro_batch_size=2,
                                 warmup=1, steps=2)
    cfg = real_size.run_config(model, train, test, 1, options)
    if args.device != "cpu":
        cfg.sampler.kv_cache_gb, cfg.sampler.enforce_eager = None, False
    started = time.perf_counter()
    controller.run(cfg, tmp / "real", show_progress=False)
    return {"workload": "Qwen2.5-0.5B shape, bf16, GSM8K, 8 prompts x 4 completions x 128 tokens, world size 1",
            "wall_s": time.perf_counter() - started, **figures(tmp / "real", model, args.device, peak)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warm-start-steps", type=int, default=0, help="the tiny model's supervised warm start")
    parser.add_argument("--no-real-size", dest="real_size", action="store_false")
    parser.add_argument("--gsm8k", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = args.out or REPO / "benchmarks" / "results" / f"device_check_{args.device}.json"
    load_before = os.getloadavg()
    name, peak = bf16_peak_tflops(args.device)
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        checks["tiny"] = check_tiny(args, Path(tmp), peak)
        if args.real_size:
            checks["real_size"] = check_real_size(args, Path(tmp), peak)
    for label, check in checks.items():
        mfu = f"MFU {100 * check['mfu']:.1f}% of {peak:g} TFLOP/s" if check["mfu"] is not None else "MFU n/a"
        print(f"{label}: {check['train_tflops_per_s']:.3f} TFLOP/s in training ({mfu}), "
              f"{check['gen_tokens_per_s']:.0f} generated tokens/s, weight sync {check['sync_gb_per_s']:.2f} GB/s "
              f"vs a device copy {check['device_copy_gb_per_s']:.1f} GB/s; {check['step_s']:.2f} s/step, "
              f"logprob gap {check['logprob_diff']:.1e}")
    return write_record(out, load_before, device=args.device, accelerator=name, bf16_peak_tflops=peak, checks=checks)


if __name__ == "__main__":
    main()
