"""Where the policy comes from: a user's Hugging Face folder, or the `tiny_arith` preset, shipped warm-started
(`shipped`) or built locally."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from filelock import FileLock, Timeout

from rl_tpu.config import DataConfig, ModelConfig, TinyModelConfig
from rl_tpu.data.arithmetic import (
    ARITHMETIC_OPS,
    SPLIT_VERSION,
    answer_without_carry,
    arithmetic_prompt,
    split_arithmetic_problems,
    tool_trace,
)
from rl_tpu.data.guess_number import GAME_FORMAT, game_corpus, guess_prompt, random_game
from rl_tpu.models.shipped import install_shipped
from rl_tpu.records import TrainBatch

log = logging.getLogger(__name__)
BUILD_WAIT_S = 1800.0  # for another run's build of the same tiny model (a warm start takes minutes on a CPU)


def resolve_model_path(cfg: ModelConfig, data: DataConfig, cache_dir: Path) -> Path:
    """`model.path` if given (checked), else the tiny preset, built and warm-started once per setting."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path={cfg.path}: no config.json there; expected a Hugging Face model folder"
            )
        return path
    folder = cache_dir / "models" / preset_folder_name(cfg.tiny, data)
    # a sweep's trials start at once: one builds, the others wait and reuse it
    lock = FileLock(folder.parent / f".{folder.name}.lock")
    try:
        with lock.acquire(timeout=BUILD_WAIT_S):
            if not (folder / "model.safetensors").is_file() and not install_shipped(folder):
                build_tiny_arith(cfg.tiny, data, folder)
    except Timeout:
        raise TimeoutError(
            f"another run held {lock.lock_file} (building the tiny model into {folder}) for more than "
            f"{BUILD_WAIT_S:g} s; if no run is building it, delete the lock file"
        ) from None
    return folder


def preset_folder_name(tiny: TinyModelConfig, data: DataConfig) -> str:
    """The cache folder of the preset built with these settings: `tiny_arith-<12 hex digits of their sha256>`."""
    settings = {
        "tiny": preset_key_fields(tiny),
        "ops": data.ops,
        "max_operand": data.max_operand,
        "num_eval": data.num_eval,
        "data_seed": data.seed,
        "split": SPLIT_VERSION,  # the warm start trains on the training split
    }
    if tiny.warm_start_guess_max > 0:  # the games' text, which the warm start imitates
        settings["game_format"] = GAME_FORMAT
    return "tiny_arith-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def preset_key_fields(tiny: TinyModelConfig) -> dict:
    """The preset's settings that name its cache folder: every field, except the tool-use ones at their default
    (fields added later join the key only when set, so the folders built before them stay valid)."""
    fields = dataclasses.asdict(tiny)
    defaults = TinyModelConfig()
    for key in ("warm_start_tool_rate", "warm_start_malformed_rate", "warm_start_guess_max", "warm_start_guess_turns"):
        if fields[key] == getattr(defaults, key):
            del fields[key]
    return fields


def check_context(model_path: Path, prompt_tokens: int, completion_tokens: int, completion_keys: str) -> None:
    """A prompt and its completion must fit the model's positions (vLLM refuses a longer context, later, in the
    engine's actor)."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if limit is not None and prompt_tokens + completion_tokens > limit:
        raise ValueError(
            f"data.max_prompt_length={prompt_tokens} plus {completion_tokens} completion tokens ({completion_keys}) is "
            f"{prompt_tokens + completion_tokens}, over the {limit} positions of model {model_path} "
            "(max_position_embeddings): lower them"
        )


def check_decoder(model_path: Path, fp32_residual: bool = False) -> None:
    """The model's family has a record (`families.py`) and the model is laid out as it says: the trainer shards its
    blocks one by one (and, with `fp32_residual`, replaces their norms). Checked on a model built on the meta
    device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_tpu.models.families import family_at
    from rl_tpu.models.precision import keep_residual_fp32

    family = family_at(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    try:
        family.decoder_layers(model)
        if fp32_residual:
            keep_residual_fp32(model)
    except TypeError as err:
        raise TypeError(f"model.path={model_path}: {err}") from err


def build_tiny_arith(tiny: TinyModelConfig, data: DataConfig, folder: Path) -> None:
    """Tokenizer + model from config + supervised warm start, written atomically to `folder`."""
    from rl_tpu.models.tiny import build_model, build_tokenizer, save_hf_folder

    game = tiny.warm_start_guess_max > 0
    tokenizer = build_tokenizer(
        tiny.vocab_size,
        tiny.split_digits,
        tool_traces=tiny.warm_start_tool_rate > 0,
        extra_lines=game_corpus(tiny.warm_start_guess_max, tiny.warm_start_guess_turns) if game else (),
    )
    model = build_model(
        len(tokenizer),
        tiny.hidden_size,
        tiny.num_layers,
        tiny.num_heads,
        tiny.num_kv_heads,
        tiny.head_dim,
        tiny.intermediate_size,
        tiny.max_position_embeddings,
        tiny.seed,
    )
    if tiny.warm_start_steps > 0 and game:
        warm_start_game(model, tokenizer, tiny)
    elif tiny.warm_start_steps > 0:
        train, _ = split_arithmetic_problems(data.ops, data.max_operand, data.num_eval, data.seed)
        warm_start(
            model,
            tokenizer,
            train,
            tiny.warm_start_steps,
            tiny.warm_start_batch_size,
            tiny.warm_start_lr,
            tiny.warm_start_teacher_error,
            tiny.seed,
            tiny.warm_start_tool_rate,
            tiny.warm_start_malformed_rate,
        )
    tmp = folder.with_name(folder.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_folder(model, tokenizer, tmp)
    (tmp / "rl_tpu_preset.json").write_text(
        json.dumps({"tiny": dataclasses.asdict(tiny), "ops": data.ops, "max_operand": data.max_operand}, indent=2)
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


Example = tuple[list[int], list[int], list[int]]  # prompt ids, completion ids, completion mask (1: in the loss)


def warm_start(
    model: torch.nn.Module,
    tokenizer,
    problems: list[tuple[int, str, int]],
    steps: int,
    batch_size: int,
    lr: float,
    teacher_error: float,
    seed: int,
    tool_rate: float = 0.0,
    malformed_rate: float = 0.0,
) -> None:
    """Supervised fine-tuning on `prompt -> " answer<eos>"`: gives GRPO a policy with some reward signal.

    With `teacher_error` > 0 that fraction of labels comes from a teacher who forgets to carry, a
    systematic mistake that only the verifier's reward can reveal to the policy. With `tool_rate` > 0 that
    fraction of examples are episodes with the calculator (`tool_trace`; the tool's result is context, out of
    the loss), `malformed_rate` of their calls written so that no parser reads them.
    """
    rng = random.Random(seed)

    def draw() -> list[Example]:
        batch = []
        for a, op, b in rng.sample(problems, batch_size):
            prompt = tokenizer(arithmetic_prompt(a, op, b))["input_ids"]
            if tool_rate and rng.random() < tool_rate:  # no draw without tools: the default warm start is unchanged
                ids, mask = _tool_example(tokenizer, a, op, b, malformed=rng.random() < malformed_rate)
            else:
                label = answer_without_carry(a, op, b) if rng.random() < teacher_error else ARITHMETIC_OPS[op](a, b)
                ids = tokenizer(f" {label}")["input_ids"] + [tokenizer.eos_token_id]
                mask = [1] * len(ids)
            batch.append((prompt, ids, mask))
        return batch

    supervise(model, tokenizer, draw, steps, lr, masked=bool(tool_rate))


def warm_start_game(model: torch.nn.Module, tokenizer, tiny: TinyModelConfig) -> None:
    """Supervised fine-tuning on guess-the-number games of a player who guesses at random (`random_game`), the
    environment's answers in the loss too: the format of a game and what its answers say, not how to win it. Half the games are answered higher / lower, half "wrong" (the
    control's environment), so both arms of recipes/guess_number start from this one model."""
    rng = random.Random(tiny.seed)
    high, turns = tiny.warm_start_guess_max, tiny.warm_start_guess_turns
    prompt = tokenizer(guess_prompt(1, high))["input_ids"]

    def draw() -> list[Example]:
        games = [
            random_game(rng, 1, high, turns, feedback=rng.random() < 0.5) for _ in range(tiny.warm_start_batch_size)
        ]
        return [(prompt, *_segment_ids(tokenizer, game)) for game in games]

    # the environment's answers are in the loss too: the model learns what they say (a guess answered "higher"
    # makes the guess + 1 the new low), not how to play; its own guesses stay at random
    supervise(model, tokenizer, draw, tiny.warm_start_steps, tiny.warm_start_lr, masked=False)


def supervise(
    model: torch.nn.Module, tokenizer, draw: Callable[[], list[Example]], steps: int, lr: float, masked: bool
) -> None:
    """`steps` AdamW steps on the completions of `draw()`'s batches (their masked tokens out of the loss, with
    `masked`), under a linear warm-up and a cosine decay to zero."""
    from rl_tpu.models.logprobs import pad_batch, token_logprobs

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to zero
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        prompts, completions, masks = map(list, zip(*draw()))
        zeros = [[0.0] * len(c) for c in completions]  # no sampler logprobs or advantages: a supervised step
        batch = TrainBatch(prompts, completions, zeros, zeros, 1.0, model_masks=masks if masked else None)
        t = pad_batch(batch, tokenizer.pad_token_id, torch.device("cpu"))
        log_prob, _ = token_logprobs(model, t, 1.0, with_entropy=False)
        loss = -(log_prob * t["response_mask"]).sum() / t["response_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps:
            log.info("warm start %d/%d: loss %.3f (%.0f s)", step, steps, loss.item(), time.perf_counter() - start)


def _segment_ids(tokenizer, segments: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """A game's ids after the prompt and its mask, as the engine and the plain renderer make them: each model turn
    tokenized alone (an empty one: the end of sequence), each environment turn encoded alone; the mask marks the
    model's turns (1), as an episode's does."""
    ids, mask = [], []
    for text, by_model in segments:
        if by_model:
            part = tokenizer(text)["input_ids"] if text else [tokenizer.eos_token_id]
        else:
            part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        mask += [int(by_model)] * len(part)
    return ids, mask


def _tool_example(tokenizer, a: int, op: str, b: int, malformed: bool) -> tuple[list[int], list[int]]:
    """A calculator episode's ids after the prompt, as the engine and the plain renderer make them, and its mask."""
    call, result, answer = tool_trace(a, op, b, malformed)
    call_ids = tokenizer(call)["input_ids"]
    if malformed:  # the turn ends at the stop string and the episode with it
        return call_ids, [1] * len(call_ids)
    result_ids = tokenizer.encode(result, add_special_tokens=False)
    answer_ids = tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id]
    return call_ids + result_ids + answer_ids, [1] * len(call_ids) + [0] * len(result_ids) + [1] * len(answer_ids)
