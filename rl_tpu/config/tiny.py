"""The `model.tiny` section: the locally built preset's shape and warm start (rl_tpu/models/tiny.py, resolve.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TinyModelConfig:
    """The locally built preset (`model=tiny_arith`); ignored when `model.path` is set."""

    vocab_size: int = 512
    split_digits: bool = True
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 128
    seed: int = 0
    # Supervised warm start on the training split so that GRPO starts with a reward signal.
    warm_start_steps: int = 1200
    warm_start_batch_size: int = 64
    warm_start_lr: float = 1e-3
    # Fraction of warm-start labels written by a teacher who forgets to carry / borrow (see README).
    warm_start_teacher_error: float = 0.0
    # tool_math: the fraction of warm-start examples that call the calculator and answer from its result
    # (recipes/tool_math); 0: no tool use, nor tool text in the tokenizer
    warm_start_tool_rate: float = 0.0
    warm_start_malformed_rate: float = 0.0  # the fraction of those calls written malformed (no parser reads them)
    # guess_number: the warm start plays guess-the-number games with secrets 1..this instead of arithmetic
    # (recipes/guess_number): well-formed guesses drawn at random in range whatever the answers, half the games
    # answered higher/lower and half "wrong" (the control's answers), the answers in the loss too: it teaches the
    # format and what an answer says, never a move; 0: arithmetic
    warm_start_guess_max: int = 0
    warm_start_guess_turns: int = 3  # guesses per warm-start game at most (the recipe's turn limit)
