"""Where the bf16 sampler-trainer logprob gap comes from, and what `model.fp32_residual` does to it and costs.

The real-size model of `real_size.py` (Qwen2.5-0.5B's shape, random init, 151,936-entry vocabulary)
samples 8 GSM8K prompts x 4 completions x 128 tokens (T = 1, fixed seeds) in three vLLM engines:
bf16, bf16 with the fp32 residual stream (`rl_tpu.precision`), and fp32. The completions of each are
then scored, as the trainer scores them (`rl_tpu.logprobs`, parameters cast to bf16 as FSDP2's mixed
precision casts them, buffers kept fp32), by a bf16 model, a bf16 model with the fp32 residual
stream, and an fp32 model. The figure is the mean absolute logprob difference per completion token.
The cost: each engine's generation time, and the trainer's train step (world size 1, `TrainerWorker`,
a synthetic batch of 8 sequences of 256 + 128 tokens, micro-batches of 2, activation checkpointing)
with `model.fp32_residual` on and off, the second of two steps, in the order on, off, on, off.

    python benchmarks/logprob_gap.py              # about 15 minutes; writes benchmarks/results/logprob_gap.json
    python benchmarks/logprob_gap.py --tiny       # the tiny preset instead (a minute; a smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from real_size import build_model_in_subprocess
from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENGINES = {"bf16": ("bfloat16", False), "bf16, fp32 residual": ("bfloat16", True), "fp32": ("float32", False)}
TRAINERS = {"bf16": ("bfloat16", False), "bf16, fp32 residual": ("bfloat16", True), "fp32": ("float32", False)}


def prompts_of(gsm8k: Path, tokenizer, count: int) -> list[list[int]]:
    questions = [json.loads(line)["question"] for line in (gsm8k / "test.jsonl").read_text().splitlines()[:count]]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]


def sample(model: Path, prompts: list[list[int]], dtype: str, fp32_residual: bool, args) -> list:
    import ray

    from rl_tpu.sampler.engine import EngineOptions, SamplingSettings, launch_sampler

    max_len = max(map(len, prompts)) + args.new_tokens
    engine = launch_sampler(str(model), dtype, max_len, 0.5, seed=0, options=EngineOptions(fp32_residual=fp32_residual))
    try:
        settings = SamplingSettings(n=args.n, temperature=1.0, max_tokens=args.new_tokens)
        start = time.perf_counter()
        rollouts = ray.get(engine.generate.remote(prompts, settings, list(range(len(prompts)))), timeout=1800)
        return rollouts, time.perf_counter() - start
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine)


def trainer_model(model: Path, dtype: str, fp32_residual: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from rl_tpu.models.precision import keep_residual_fp32

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for param in net.parameters():  # as FSDP2's MixedPrecisionPolicy: parameters cast, buffers kept
        param.data = param.data.to(getattr(torch, dtype))
    if fp32_residual:
        keep_residual_fp32(net)
    return net


def train_step_seconds(model: Path, fp32_residual: bool) -> float:
    """The second of two train steps of a world-size-1 trainer on a synthetic batch."""
    import torch
    from trainer_memory import synthetic_batch

    from rl_tpu.config import RunConfig
    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.model.fp32_residual = "cpu", "bfloat16", fp32_residual
    cfg.trainer.micro_batch_size, cfg.trainer.activation_checkpointing = 2, True
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    batch = synthetic_batch(8, 256, 128, vocab)
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(model), 0, 1, "127.0.0.1", free_port())
    try:
        worker.train_step(batch)
        return worker.train_step(batch)["time/train_s"]
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gap(net, rollouts: list, micro: int = 4) -> dict[str, float]:
    import torch

    from rl_tpu.models.logprobs import pad_batch, token_logprobs
    from rl_tpu.records import TrainBatch

    diffs = []
    for i in range(0, len(rollouts), micro):
        part = rollouts[i : i + micro]
        batch = TrainBatch(
            [r.prompt_ids for r in part],
            [r.completion_ids for r in part],
            [r.logprobs for r in part],
            [[0.0] * len(r.logprobs) for r in part],
            1.0,
        )
        t = pad_batch(batch, pad_id=1, device=torch.device("cpu"))
        with torch.no_grad():
            log_prob, _ = token_logprobs(net, t, 1.0, with_entropy=False)
        diffs.append((log_prob - t["sampler_logprobs"]).abs()[t["response_mask"].bool()])
    every = torch.cat(diffs)
    return {"mean": every.mean().item(), "max": every.max().item(), "tokens": every.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="the tiny preset (random init) and arithmetic prompts")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "logprob_gap.json")
    args = parser.parse_args()
    import ray
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    load_before = os.getloadavg()
    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from rl_tpu.config import DataConfig, TinyModelConfig
            from rl_tpu.models.resolve import build_tiny_arith

            model = Path(tmp) / "tiny"
            build_tiny_arith(TinyModelConfig(warm_start_steps=0), DataConfig(), model)
            tokenizer = AutoTokenizer.from_pretrained(model)
            prompts = [
                tokenizer(f"Q: What is {a} + {b}? A:")["input_ids"] for a, b in zip(range(3, 99, 7), range(9, 99, 5))
            ]
        else:
            model = build_model_in_subprocess(Path(tmp) / "model")
            prompts = prompts_of(args.gsm8k, AutoTokenizer.from_pretrained(model), args.prompts)
        sampled = {name: sample(model, prompts, *how, args) for name, how in ENGINES.items()}
        generate_s = {name: seconds for name, (_, seconds) in sampled.items()}
        print(f"generate seconds per engine: {generate_s}", flush=True)
        for trainer, how in TRAINERS.items():
            net = trainer_model(model, *how)
            for engine, (rollouts, _) in sampled.items():
                table[f"engine {engine} / trainer {trainer}"] = gap(net, rollouts)
                print(
                    f"engine {engine:20s} trainer {trainer:20s} {table[f'engine {engine} / trainer {trainer}']}",
                    flush=True,
                )
            del net
        ray.shutdown()
        train_s = {"fp32 residual": [], "bf16 residual": []}
        for fp32_residual in (True, False, True, False):
            train_s["fp32 residual" if fp32_residual else "bf16 residual"].append(
                train_step_seconds(model, fp32_residual)
            )
            print(f"train step seconds: {train_s}", flush=True)
    write_record(
        args.out,
        load_before,
        args=vars(args) | {"gsm8k": str(args.gsm8k), "out": str(args.out)},
        gaps=table,
        generate_s=generate_s,
        train_step_s=train_s,
    )


if __name__ == "__main__":
    main()
