"""A real-size model through the whole loop on CPU: Qwen2.5-0.5B's shape, GSM8K, trainer world size 1 and 2.

The model is built from a Qwen2.5-0.5B-shaped config (hidden 896, 24 layers, 14 heads, 2 KV
heads, intermediate 4864, tied embeddings; random init, nothing downloaded) with a byte-level
BPE tokenizer built locally, given a chat template and padded with added tokens to Qwen's
151,936 entries so that embeddings and logits have their real size. bf16 served weights (fp32
masters in the trainer), GSM8K prompts (../shared/data/gsm8k, through
recipes/grpo_gsm8k/prepare.py) scored by the `gsm8k` reward, `--prompts` x `--n` completions
of at most `--new-tokens` tokens. Each world size is one run through `run`, the
real path (placement, FSDP2 ranks, vLLM engine, weight sync); figures are medians over the
steps after `--warmup`, and peak RSS is per process (each trainer rank, the sampler, the
driver). Activation checkpointing is on, micro-batches are 2 sequences and the engine's KV
cache is 0.5 GiB (32 sequences of at most 640 tokens need 0.25), as a 24 GB host needs:
without checkpointing the world-size-1 trainer reached 13.9 GB and Ray's memory monitor
stopped the run.

    python benchmarks/real_size.py              # writes benchmarks/results/real_size.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.cluster.memory import peak_rss_mb
from rl_tpu.config import RunConfig
from rl_tpu.outputs.metrics import read_metrics

QWEN_VOCAB = 151_936
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2.5 shapes (their config.json files); all tie the LM head to the embeddings
QWEN_SHAPES = {
    "0.5b": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
    "1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960
    ),
    "3b": dict(
        hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008
    ),
}


def build_model_in_subprocess(folder: Path, shape: str = "0.5b") -> Path:
    """Build in a child process, so that the driver does not keep the memory of a full model it never uses."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(build_model, (folder, shape))


def build_model(folder: Path, shape: str = "0.5b") -> Path:
    """A Qwen2.5-shaped model (`QWEN_SHAPES`, bf16 on disk) and a tokenizer of Qwen's vocabulary size."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rl_tpu.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(512, split_digits=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(QWEN_VOCAB - len(tokenizer))])
    tokenizer.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **QWEN_SHAPES[shape],
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # a GPU host initialises on the GPU
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prepare_data(gsm8k: Path, folder: Path) -> tuple[Path, Path]:
    from recipes.grpo_gsm8k.prepare import main as prepare

    prepare(["--input_dir", str(gsm8k), "--output_dir", str(folder)])
    return folder / "train.parquet", folder / "test.parquet"


def run_config(model: Path, train: Path, test: Path, world_size: int, args) -> RunConfig:
    cfg = RunConfig()
    cfg.device, cfg.model.path, cfg.model.dtype = getattr(args, "device", "cpu"), str(model), "bfloat16"
    cfg.data.train_files, cfg.data.val_files = str(train), str(test)
    cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.val_max_samples = args.prompts, 512, args.prompts
    cfg.sampler.n, cfg.sampler.response_length, cfg.sampler.kv_cache_gb = args.n, args.new_tokens, 0.5
    cfg.reward.name = "gsm8k"
    cfg.trainer.world_size, cfg.trainer.micro_batch_size = world_size, args.micro_batch_size
    cfg.trainer.activation_checkpointing = True  # as the real-model recipes set it
    cfg.trainer.skip_zero_advantage_rows = False  # a random-init model scores 0 alike: the cost of every row
    cfg.trainer.total_steps, cfg.trainer.eval_every = args.warmup + args.steps, 10_000
    cfg.trainer.export, cfg.trainer.checkpoint_final, cfg.trainer.checkpoint_every = False, False, 0
    cfg.ray.object_store_mb = 2048
    return cfg


def measure(cfg: RunConfig, run_dir: Path, warmup: int) -> dict:
    started = time.perf_counter()
    from rl_tpu.controller.run import run as run_training  # Ray and vLLM: the builders above need neither

    run_training(cfg, run_dir, show_progress=False)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > warmup and "actor/loss" in r]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    every = read_metrics(run_dir / "metrics.jsonl")
    ranks = range(cfg.trainer.world_size)
    return {
        "world_size": cfg.trainer.world_size,
        "steps_measured": len(rows),
        "wall_s": time.perf_counter() - started,
        **{key: median(f"time/{key}") for key in ("step_s", "generate_s", "reward_s", "train_step_s", "sync_s")},
        "gen_tokens_per_s": median("perf/gen_tokens_per_s"),
        "train_tokens_per_s": median("perf/train_tokens_per_s"),
        "sync_bytes": median("sync/bytes"),
        "sync_mb_per_s": median("sync/mb_per_s"),
        "logprob_diff": median("actor/logprob_diff"),
        "trainer_rank_peak_rss_mb": [max(r.get(f"perf/trainer_{k}_peak_rss_mb", 0) for r in every) for k in ranks],
        "sampler_peak_rss_mb": max(r.get("perf/sampler_peak_rss_mb", 0) for r in every),
    }


def add_workload_arguments(parser: argparse.ArgumentParser, prompts: int, n: int, new_tokens: int, steps: int) -> None:
    """The workload's options (`run_config` reads them), with a script's defaults for its size."""
    parser.add_argument("--gsm8k", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--n", type=int, default=n)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, prompts=8, n=4, new_tokens=128, steps=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "real_size.json")
    args = parser.parse_args()
    # Inherited by the local Ray cluster's workers: glibc's per-thread malloc arenas hold on to freed
    # memory, and 24 GB leave ~1 GB to spare at world size 2. (Raising RAY_memory_usage_threshold here
    # was tried and did not move Ray's 95% kill point.)
    os.environ.setdefault("MALLOC_ARENA_MAX", "2")
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_in_subprocess(Path(tmp) / "model")
        train, test = prepare_data(args.gsm8k, Path(tmp) / "data")
        for world_size in args.world_sizes:
            cfg = run_config(model, train, test, world_size, args)
            runs.append(
                {**measure(cfg, Path(tmp) / f"run-ws{world_size}", args.warmup), "load_average": os.getloadavg()}
            )
            print(json.dumps(runs[-1]), flush=True)
    base = min(runs, key=lambda r: r["world_size"])
    for run in runs:
        run["largest_rank_rss_vs_first"] = max(run["trainer_rank_peak_rss_mb"]) / max(base["trainer_rank_peak_rss_mb"])
        print(
            f"world size {run['world_size']}: {run['step_s']:.1f} s/step (generate {run['generate_s']:.1f}, train "
            f"{run['train_step_s']:.1f}, sync {run['sync_s']:.2f} for {run['sync_bytes'] / 2**20:.0f} MiB); "
            f"{run['gen_tokens_per_s']:.0f} generated and {run['train_tokens_per_s']:.0f} trained tokens/s; peak RSS "
            f"per trainer rank {[round(mb) for mb in run['trainer_rank_peak_rss_mb']]} MiB "
            f"({run['largest_rank_rss_vs_first']:.2f} x world size {base['world_size']}), sampler "
            f"{run['sampler_peak_rss_mb']:.0f} MiB; logprob gap {run['logprob_diff']:.2e}"
        )
    write_record(
        args.out,
        load_before,
        args=vars(args) | {"gsm8k": str(args.gsm8k), "out": str(args.out)},
        driver_peak_rss_mb=peak_rss_mb(),
        runs=runs,
    )


if __name__ == "__main__":
    main()
