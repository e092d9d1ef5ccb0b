"""Trainer rank 0's side of the weight canary (`rl_tpu/sync/canary.py`): the logprob of each canary continuation
token under the weights just published, computed as the engines compute theirs (the raw log-softmax, no
temperature; a LoRA policy with its adapters)."""

from __future__ import annotations

import time

import torch

from rl_tpu.records import Canary, CanaryTokens


def score_canary(model: torch.nn.Module, tokens: CanaryTokens, version: int, dtype: str, device) -> Canary:
    """One forward of every sequence, right-padded (a causal model's earlier positions never see the padding), with
    dropout off. Collective under FSDP: every rank runs it, and each gets the same canary."""
    start = time.perf_counter()
    width = max(map(len, tokens.sequences))
    ids = torch.zeros((len(tokens.sequences), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(tokens.sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    finally:
        model.train(training)
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    # the logits at position p - 1 predict token p
    chosen = [
        logprobs[row, position - 1, sequence[position]].item()
        for row, (sequence, start_at) in enumerate(zip(tokens.sequences, tokens.starts))
        for position in range(start_at, len(sequence))
    ]
    return Canary(version, dtype, tuple(chosen), time.perf_counter() - start)
