"""Trainer rank 0's side of the canary (`rl_tpu/sync/canary.py`): the logprob of each canary continuation token under
the weights just published, computed as the engines compute theirs (the raw log-softmax, no temperature)."""

from __future__ import annotations

import torch

from rl_tpu.records import Canary
from rl_tpu.sync.canary import canary_sequences


class TrainerCanary:
    """The canary's sequences in the run's tokenizer, scored by the policy (a LoRA policy with its adapters)."""

    def __init__(self, model_path: str, dtype: str):
        from transformers import AutoTokenizer

        self.sequences, self.starts = canary_sequences(AutoTokenizer.from_pretrained(model_path))
        self.dtype = dtype

    def score(self, model: torch.nn.Module, version: int, device: torch.device) -> Canary:
        """One forward of every sequence, right-padded (a causal model's earlier positions never see the padding).
        Collective under FSDP: every rank runs it; each gets the same canary."""
        width = max(map(len, self.sequences))
        ids = torch.zeros((len(self.sequences), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, sequence in enumerate(self.sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        training = model.training
        model.eval()  # no dropout: the engine serves the policy without it
        try:
            with torch.no_grad():
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        finally:
            model.train(training)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        # the logits at position p - 1 predict token p
        chosen = [
            logprobs[row, position - 1, sequence[position]].item()
            for row, (sequence, start) in enumerate(zip(self.sequences, self.starts))
            for position in range(start, len(sequence))
        ]
        return Canary(version, self.dtype, self.sequences, self.starts, tuple(chosen))
