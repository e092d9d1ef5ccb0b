"""LoRA against full fine-tuning on a real-size model, in one invocation: trainer peak memory, bytes per sync, sync
and step time.

The model, data and settings are real_size.py's (Qwen2.5-0.5B's shape, random init, bf16 served, GSM8K prompts, the
real path: placement, FSDP2 trainer, vLLM engine, object-store sync) at world size 1; the two variants run one after
the other in this process's Ray cluster: `full` (today's default) and `lora` (`actor.lora.lora_rank`, every linear
layer of the blocks, the adapter sent alone and served by vLLM's LoRA support). A LoRA trainer keeps its frozen base
in bf16 and has no gradient or optimizer state for it; the full trainer holds fp32 master weights, their gradients
and AdamW's two moments.

    python benchmarks/lora_sync.py        # writes benchmarks/results/lora_sync.json (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from real_size import (  # beside this script
    REPO,
    add_workload_arguments,
    build_model_in_subprocess,
    measure,
    prepare_data,
    run_config,
)
from record import write_record

from rl_tpu.cluster.memory import peak_rss_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, prompts=4, n=2, new_tokens=32, steps=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "lora_sync.json")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # as real_size.py: freed memory goes back to the system
    load_before = os.getloadavg()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_in_subprocess(Path(tmp) / "model")
        train, test = prepare_data(args.gsm8k, Path(tmp) / "data")
        for variant in ("full", "lora"):
            cfg = run_config(model, train, test, 1, args)
            if variant == "lora":
                cfg.actor.lora.lora_rank, cfg.actor.lora.lora_alpha = args.rank, 2 * args.rank
            runs[variant] = {**measure(cfg, Path(tmp) / variant, args.warmup), "load_average": os.getloadavg()}
            print(variant, json.dumps(runs[variant]), flush=True)
    full, lora = runs["full"], runs["lora"]
    ratios = {
        "sync_bytes": lora["sync_bytes"] / full["sync_bytes"],
        "sync_s": lora["sync_s"] / full["sync_s"],
        "trainer_peak_rss": lora["trainer_rank_peak_rss_mb"][0] / full["trainer_rank_peak_rss_mb"][0],
        "train_step_s": lora["train_step_s"] / full["train_step_s"],
        "step_s": lora["step_s"] / full["step_s"],
    }
    print(
        f"LoRA rank {args.rank} vs full: sync {lora['sync_bytes'] / 2**20:.1f} vs {full['sync_bytes'] / 2**20:.0f} MiB "
        f"({ratios['sync_bytes']:.4f}), {lora['sync_s']:.3f} vs {full['sync_s']:.2f} s; trainer peak "
        f"{lora['trainer_rank_peak_rss_mb'][0]:.0f} vs {full['trainer_rank_peak_rss_mb'][0]:.0f} MiB "
        f"({ratios['trainer_peak_rss']:.2f}); train step {lora['train_step_s']:.1f} vs {full['train_step_s']:.1f} s; "
        f"logprob gap {lora['logprob_diff']:.2e} vs {full['logprob_diff']:.2e}"
    )
    write_record(
        args.out,
        load_before,
        args=vars(args) | {"gsm8k": str(args.gsm8k), "out": str(args.out)},
        driver_peak_rss_mb=peak_rss_mb(),
        runs=runs,
        lora_over_full=ratios,
    )


if __name__ == "__main__":
    main()
