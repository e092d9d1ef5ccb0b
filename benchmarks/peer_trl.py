"""The side-by-side peer of grpo_step.py: Hugging Face TRL's GRPOTrainer on the same reference workload.

Two roles. Imported (by grpo_step.py), it offers make_venv, which builds TRL's own virtual environment
from requirements/peer-trl.txt without importing torch or TRL here. Run with that environment's python,
it trains with TRL on the model folder and parquet that grpo_step.build_workload writes, and records
the seconds per optimizer step (and, within it, TRL's generate-and-score phase):

    python benchmarks/peer_trl.py --model MODEL_DIR --data PARQUET --steps 5 --warmup 1 --threads 2 [--bf16] --out OUT.json

The workload as grpo_step.py runs it: 16 prompts x 8 completions per step (TRL counts completions:
per_device_train_batch_size=128), at most 32 new tokens, temperature 1, top_p 1, top_k off, AdamW at a
constant 1e-5, no KL term and no reference model, grad-norm clip 1.0, one optimizer step per generated
batch, on-policy; generation with transformers' generate (no vLLM), fp32 unless --bf16 (CPU autocast).
Rewards come from rl_tpu's own scorer (rewards/arithmetic.py, loaded by path), so both grade alike.
Nothing is fetched: HF_HUB_OFFLINE=1, the data set is the local parquet.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
REQUIREMENTS = REPO / "requirements" / "peer-trl.txt"
DEFAULT_VENV = REPO / "benchmarks" / ".venv-trl"
BATCH, GROUP = 128, 8  # completions per step, completions per prompt


def make_venv(path: Path = DEFAULT_VENV) -> Path:
    """The python of a virtual environment at `path` holding requirements/peer-trl.txt; built once per file content."""
    python = path / "bin" / "python"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    marker = path / ".peer-trl-requirements.sha256"
    if python.exists() and marker.exists() and marker.read_text().strip() == digest:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)], check=True, timeout=1800)
    marker.write_text(digest + "\n")  # last, so an interrupted install is redone
    return python


def prompt_text(messages: list[dict], tokenizer: Any) -> str | list[dict]:
    """What rl_tpu.data.prompt_text tokenises: chat messages stay conversational (TRL then applies the same
    template with add_generation_prompt=True); without a chat template, the raw contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        return messages
    return "\n".join(m["content"] for m in messages)


def check_prompt_ids(prompt: str | list[dict], tokenizer: Any) -> None:
    """TRL's prompt ids (GRPOTrainer._tokenize_prompts) must be the ones rl_tpu.data.load_examples generates from."""
    if isinstance(prompt, list):
        ours = tokenizer(
            tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )["input_ids"]
        theirs = tokenizer.apply_chat_template([prompt], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ][0]
    else:
        ours = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        theirs = tokenizer(text=[prompt])["input_ids"][0]  # TRL's call: special tokens added if the tokenizer has any
    if list(ours) != list(theirs):
        raise SystemExit(f"prompt ids differ: rl_tpu {list(ours)} vs TRL {list(theirs)} for {prompt!r}")


def arithmetic_reward() -> Callable[..., list[float]]:
    """rl_tpu's rewards/arithmetic.py compute_score as a TRL reward function (dataset columns come as lists)."""
    spec = importlib.util.spec_from_file_location("rl_tpu_rewards_arithmetic", REPO / "rewards" / "arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def arithmetic(
        completions: list[str], data_source: list[str], ground_truth: list[str], extra_info: list[dict], **_: Any
    ) -> list[float]:
        return [
            module.compute_score(s, c, g, e)
            for c, s, g, e in zip(completions, data_source, ground_truth, extra_info, strict=True)
        ]

    return arithmetic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the reference model folder (with its tokenizer)")
    parser.add_argument("--data", type=Path, required=True, help="the reference problems, verl-schema parquet")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (weights and optimizer stay fp32)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    load_before = os.getloadavg()
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: it reads this once
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported, so its pool is sized alike

    import datasets
    import torch
    import transformers
    import trl
    from record import write_record  # beside this script
    from transformers import AutoTokenizer, TrainerCallback

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    rows = datasets.Dataset.from_parquet(str(args.data))
    train = rows.map(
        lambda row: {
            "prompt": prompt_text(row["prompt"], tokenizer),
            "ground_truth": row["reward_model"]["ground_truth"],
        },
        remove_columns=["reward_model", "ability"],
    )
    check_prompt_ids(train[0]["prompt"], tokenizer)

    step_s: list[float] = []
    generate_s: list[float] = []
    mean_lengths: list[float] = []

    class Timer(TrainerCallback):
        """Seconds between consecutive optimizer steps: generation, reward, loss, backward, clip, AdamW, logging."""

        def __init__(self) -> None:
            self.last = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.last:  # the first step starts here; later ones where the previous one ended
                self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            step_s.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:  # logging_steps=1: one log per step
                mean_lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as tmp:
        config = trl.GRPOConfig(
            output_dir=tmp,
            max_steps=args.warmup + args.steps,
            seed=0,
            per_device_train_batch_size=BATCH,
            num_generations=GROUP,
            # one generated batch per optimizer step, used once: TRL then skips the old-logprob pass
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=32,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            use_vllm=False,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            gradient_checkpointing=False,  # TRL's default is on; rl_tpu's trainer.activation_checkpointing is off
            bf16=args.bf16,  # TRL's default is bf16 on; rl_tpu's reference workload is fp32
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = trl.GRPOTrainer(
            model=str(args.model),
            reward_funcs=arithmetic_reward(),
            args=config,
            train_dataset=train,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
        generate_and_score = trainer._generate_and_score_completions  # called once per step by _prepare_inputs

        def timed_generate_and_score(inputs: list[dict]) -> dict:
            start = time.perf_counter()
            out = generate_and_score(inputs)
            generate_s.append(time.perf_counter() - start)
            return out

        trainer._generate_and_score_completions = timed_generate_and_score  # the rest of a step is loss and update
        trainer.train()
    timed, timed_generate = step_s[args.warmup :], generate_s[args.warmup :]
    tokens = [m * BATCH for m in mean_lengths[args.warmup :]]
    record = write_record(
        args.out,
        load_before,
        system="trl",
        trl_version=trl.__version__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        bf16=args.bf16,
        threads=torch.get_num_threads(),
        steps=args.steps,
        warmup=args.warmup,
        step_s_each=timed,
        step_s=statistics.median(timed),
        min=min(timed),
        max=max(timed),
        generate_and_score_s=statistics.median(timed_generate),
        generate_and_score_s_each=timed_generate,
        completion_tokens_per_step=statistics.mean(tokens) if tokens else None,
    )
    print(
        f"trl {record['trl_version']} ({'bf16 autocast' if args.bf16 else 'fp32'}, {record['threads']} threads): "
        f"{record['step_s']:.3f} s/step (min {record['min']:.3f}, max {record['max']:.3f}; generate and score "
        f"{record['generate_and_score_s']:.3f}) over {len(timed)} steps, "
        f"{record['completion_tokens_per_step'] or 0:,.0f} completion tokens/step"
    )


if __name__ == "__main__":
    main()
