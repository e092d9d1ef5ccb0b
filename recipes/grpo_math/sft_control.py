"""The control of results.md that is not RL: more supervised training on the warm start's own teacher.

Starts from the model GRPO starts from (the recipe's warm-started tiny model) and trains it on the
teacher's labels (the same mistakes, at the same rate) for as many sequences as GRPO trains on:
`trainer.total_steps * data.train_batch_size * sampler.n` (12,800 for the default), in warm-start
batches. GRPO also spends generation on its sequences; the control does not, so the budget favours
it. The result is a Hugging Face folder; evaluate it as the GRPO runs are evaluated:

    python recipes/grpo_math/sft_control.py --seed 0 --lr 3e-4 --out outputs/sft_control/seed0
    python -m rl_tpu.main +recipe=grpo_math model.path=outputs/sft_control/seed0 trainer.total_steps=0 \
        trainer.eval_pass_k=8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_tpu.config import RunConfig, cache_path, register_configs
from rl_tpu.data.arithmetic import split_arithmetic_problems
from rl_tpu.models.resolve import resolve_model_path, warm_start
from rl_tpu.models.tiny import save_hf_folder

SEED_OFFSET = 1000  # the warm start drew its batches with the tiny model's seed (0): draw others


def recipe_config(recipe: str) -> RunConfig:
    register_configs()
    with initialize_config_module("rl_tpu.configs", version_base=None):
        return OmegaConf.to_object(compose("config", [f"+recipe={recipe}"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="grpo_math")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, required=True, help="peak learning rate (linear warm-up, cosine decay)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = recipe_config(args.recipe)
    tiny = cfg.model.tiny
    start = resolve_model_path(cfg.model, cfg.data, cache_path(cfg))
    sequences = cfg.trainer.total_steps * cfg.data.train_batch_size * cfg.sampler.n
    steps = sequences // tiny.warm_start_batch_size
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(start)
    train, _ = split_arithmetic_problems(cfg.data.ops, cfg.data.max_operand, cfg.data.num_eval, cfg.data.seed)
    torch.manual_seed(SEED_OFFSET + args.seed)
    print(
        f"continuing {start} for {steps} steps of {tiny.warm_start_batch_size} ({sequences} sequences), "
        f"teacher error {tiny.warm_start_teacher_error}, lr {args.lr:g}, seed {args.seed}",
        flush=True,
    )
    warm_start(
        model,
        tokenizer,
        train,
        steps,
        tiny.warm_start_batch_size,
        args.lr,
        tiny.warm_start_teacher_error,
        SEED_OFFSET + args.seed,
    )
    save_hf_folder(model, tokenizer, args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
