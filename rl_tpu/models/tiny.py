"""The `tiny_arith` preset: a byte-level BPE tokenizer and a Qwen3-architecture model built locally.

Nothing is downloaded. The tokenizer is trained with `tokenizers` on the exhaustive arithmetic
corpus of DESIGN.md's reference workload; the model is `Qwen3ForCausalLM` built from config
with `torch.manual_seed(seed)`. Both are written as an ordinary Hugging Face folder, so the
trainer, vLLM and `transformers` load them like any other checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS, PAD = "<|endoftext|>", "<|pad|>"


def arithmetic_corpus(tool_traces: bool = False) -> list[str]:
    """Every line ``Q: What is {a} {op} {b}? A: {ans}`` for op in + - * and a, b in 0..99 (seed-free); with
    `tool_traces`, also each line's episode with the calculator (`rl_tpu.data.arithmetic.tool_trace`)."""
    from rl_tpu.data.arithmetic import ARITHMETIC_OPS, arithmetic_prompt, tool_trace

    problems = [(a, op, b) for op in ARITHMETIC_OPS for a in range(100) for b in range(100)]
    lines = [f"{arithmetic_prompt(a, op, b)} {ARITHMETIC_OPS[op](a, b)}" for a, op, b in problems]
    if tool_traces:
        lines += [arithmetic_prompt(a, op, b) + "".join(tool_trace(a, op, b)) for a, op, b in problems]
    return lines


def build_tokenizer(
    vocab_size: int, split_digits: bool, tool_traces: bool = False, extra_lines: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Byte-level BPE with ``<|endoftext|>`` (eos, id 0) and ``<|pad|>`` (pad, id 1).

    ``split_digits`` keeps every digit its own token, so the model sees numbers digit by digit
    (the same number is otherwise one, two or three merged tokens depending on context). ``tool_traces`` trains
    it on calculator episodes too, so a tool call's fixed text is a few tokens; `extra_lines` (another task's
    text: guess-the-number games) join the corpus.
    """
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([*arithmetic_corpus(tool_traces), *extra_lines], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)


def build_model(
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    max_positions: int,
    seed: int,
) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def save_hf_folder(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
