"""Fixed token sequences scored under what an engine serves now, one token generated and dropped: the whole
vocabulary's logprobs at every position (`rl_tpu.consistency`), or the logprob of each canary continuation token
after an install (`rl_tpu/sync/canary.py`)."""

from __future__ import annotations

import torch

from rl_tpu.records import CanaryTokens


def full_distribution_params():
    """vLLM's parameters that score a sequence: every token of the vocabulary at every position (flat, not decoded:
    a constant number of Python objects whatever the vocabulary), one token generated and dropped."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=-1, flat_logprobs=True, detokenize=False)


def dense_rows(flat, vocab: int) -> torch.Tensor:
    """vLLM's flat prompt logprobs of one sequence (every token of the vocabulary at each position after the
    first) as a [positions, vocab] table; an entry vLLM left out stays -inf, which no bound lets through."""
    rows = torch.full((len(flat.start_indices) - 1, vocab), float("-inf"))
    for row, (start, end) in enumerate(zip(flat.start_indices[1:], flat.end_indices[1:])):
        rows[row, torch.tensor(flat.token_ids[start:end])] = torch.tensor(flat.logprobs[start:end], dtype=torch.float32)
    return rows


def canary_params():
    """vLLM's parameters that score a canary sequence: the logprob of each of its own tokens (prompt logprobs are
    the raw log-softmax, as the trainer computes them; they never read the prefix cache)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)


def continuation_logprobs(outputs: list, tokens: CanaryTokens) -> list[float]:
    """From vLLM's outputs for the canary's sequences, each continuation token's logprob, in the trainer's order."""
    return [
        output.prompt_logprobs[position][sequence[position]].logprob
        for output, sequence, start in zip(outputs, tokens.sequences, tokens.starts, strict=True)
        for position in range(start, len(sequence))
    ]
