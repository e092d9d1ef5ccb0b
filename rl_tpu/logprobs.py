"""Token log-probabilities of completions under the policy: the batch layout and a chunked computation.

Shared by the trainer's update and the warm start. Prompts are left-padded so that every row's
completion starts in the same column; the model then computes logits only at the completion
positions (`logits_to_keep`), and the fp32 log-softmax and entropy are computed a chunk of
positions at a time, recomputed in the backward pass (activation checkpointing), so no
`[batch, sequence, vocabulary]` fp32 tensor ever exists. At a 152k vocabulary that tensor
would be the largest allocation of a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from rl_tpu.rollout import TrainBatch

DEFAULT_CHUNK = 32  # completion positions per chunk of the fp32 log-softmax (x rows x vocabulary floats)


def bucketed(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` (the length itself past the largest, or without buckets)."""
    return min((b for b in buckets if b >= length), default=length)


def pad_batch(batch: TrainBatch, pad_id: int, device: torch.device,
              buckets: Sequence[int] = ()) -> dict[str, torch.Tensor]:
    """Prompts left-padded to end in column P-1, completions right-padded from column P; (bs, response_len)
    tensors in verl's layout. Completion token j of every row is predicted by the logits at column P-1+j.

    With `buckets` (`trainer.seq_buckets`), P and the response length are each rounded up to a bucket,
    so that a compiler sees a few shapes only (TPU graphs are compiled per shape); padding changes no
    token's logprob."""
    prompt_len = bucketed(max(map(len, batch.prompt_ids)), buckets)
    resp_len = bucketed(max(1, max(map(len, batch.completion_ids))), buckets)
    rows = len(batch)
    input_ids = torch.full((rows, prompt_len + resp_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros((rows, resp_len))
    sampler_logprobs = torch.zeros((rows, resp_len))
    targets = torch.full((rows, resp_len), pad_id, dtype=torch.long)
    advantages = torch.zeros((rows, resp_len))
    for i, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
        n_p, n_c = len(prompt), len(completion)
        input_ids[i, prompt_len - n_p: prompt_len + n_c] = torch.tensor(prompt + completion)
        attention_mask[i, prompt_len - n_p: prompt_len + n_c] = 1
        response_mask[i, :n_c] = float(batch.in_loss(i))
        targets[i, :n_c] = torch.tensor(completion)
        sampler_logprobs[i, :n_c] = torch.tensor(batch.sampler_logprobs[i])
        advantages[i, :n_c] = torch.tensor(batch.advantages[i])
    # positions count from each row's first real token, as the sampler numbers them
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, targets=targets,
                   response_mask=response_mask, sampler_logprobs=sampler_logprobs, advantages=advantages)
    return {k: v.to(device) for k, v in tensors.items()}


def _chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(log_probs, -1, targets[..., None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else torch.zeros_like(chosen)
    return chosen, entropy


def token_logprobs(model: torch.nn.Module, t: dict[str, torch.Tensor], temperature: float, with_entropy: bool = True,
                   chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropy) of the completion tokens under logits / temperature, in fp32."""
    resp_len = t["targets"].shape[1]
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"],
                   use_cache=False, logits_to_keep=resp_len + 1).logits[:, :resp_len]
    recompute = torch.is_grad_enabled()
    parts = []
    for start in range(0, resp_len, chunk):
        args = (logits[:, start: start + chunk], t["targets"][:, start: start + chunk], temperature, with_entropy)
        parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args))
    chosen = torch.cat([c for c, _ in parts], dim=1)
    return chosen, torch.cat([e for _, e in parts], dim=1) if with_entropy else None
