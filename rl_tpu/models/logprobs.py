"""Token log-probabilities of completions under the policy: the batch layout and a chunked computation.

Shared by the trainer's update and the warm start. Prompts are left-padded so that every row's
completion starts in the same column; the model then computes logits only at the completion
positions (`logits_to_keep`), and the fp32 log-softmax and entropy are computed a chunk of
positions at a time, recomputed in the backward pass (activation checkpointing), so no
`[batch, sequence, vocabulary]` fp32 tensor ever exists. At a 152k vocabulary that tensor
would be the largest allocation of a step.

With `share_prompts` (`trainer.share_prompts`), a GRPO group's completions share one forward of
their prompt: the distinct prompts of a micro-batch run once, their keys and values are handed to
every row that has that prompt (as a KV cache, through which the gradient flows back), and the
completions then run on their own. Loss and gradients are the whole-sequence forward's (fp32: to
1e-6, tests/unit/test_train_step_settings.py); a prompt costs 1/`sampler.n` of its compute.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer

from rl_tpu.records import TrainBatch

DEFAULT_CHUNK = 32  # completion positions per chunk of the fp32 log-softmax (x rows x vocabulary floats)


def bucketed(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `length` (the length itself past the largest, or without buckets)."""
    return min((b for b in buckets if b >= length), default=length)


def pad_batch(
    batch: TrainBatch, pad_id: int, device: torch.device, buckets: Sequence[int] = (), share_prompts: bool = False
) -> dict[str, torch.Tensor]:
    """Prompts left-padded to end in column P-1, completions right-padded from column P; (bs, response_len)
    tensors in verl's layout. Completion token j of every row is predicted by the logits at column P-1+j.

    With `buckets` (`trainer.seq_buckets`), P and the response length are each rounded up to a bucket,
    so that a compiler sees a few shapes only (TPU graphs are compiled per shape); padding changes no
    token's logprob. With `share_prompts`, `prompt_rows` (the first row of each distinct prompt) and
    `prompt_index` (each row's position in `prompt_rows`) let `token_logprobs` run each prompt once; with
    `buckets` too, `prompt_rows` repeats its last row up to a power of two (at most the row count), so that
    the prompts' forward has a few batch sizes only (the repeats' outputs are not used)."""
    prompt_len = bucketed(max(map(len, batch.prompt_ids)), buckets)
    # shared prompts take two forwards, the prompts' and the completions': at least two columns, so that a micro-batch
    # of one-token completions runs both too (FSDP ranks pair their forwards' collectives: one fewer deadlocks them)
    resp_len = bucketed(max(2 if share_prompts else 1, *map(len, batch.completion_ids)), buckets)
    rows = len(batch)
    # one vectorised pass: every row's tokens flattened, then scattered to their (row, column) places
    n_p = torch.tensor([len(p) for p in batch.prompt_ids])
    n_c = torch.tensor([len(c) for c in batch.completion_ids])
    row = torch.arange(rows).repeat_interleave(n_p + n_c)
    first = torch.cumsum(n_p + n_c, 0) - (n_p + n_c)  # each row's first place in the flat tokens
    column = torch.arange(len(row)) - first[row] + (prompt_len - n_p)[row]
    flat = torch.tensor([t for p, c in zip(batch.prompt_ids, batch.completion_ids) for t in p + c], dtype=torch.long)
    input_ids = torch.full((rows, prompt_len + resp_len), pad_id, dtype=torch.long)
    input_ids[row, column] = flat
    attention_mask = torch.zeros_like(input_ids)
    attention_mask[row, column] = 1
    # the completions' own places: row, and position j in its completion
    c_row = torch.arange(rows).repeat_interleave(n_c)
    c_col = torch.arange(len(c_row)) - (torch.cumsum(n_c, 0) - n_c)[c_row]

    def completion_tensor(values: list[list] | torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
        flat_values = values if torch.is_tensor(values) else torch.tensor([v for vs in values for v in vs])
        out = torch.full((rows, resp_len), fill, dtype=dtype)
        out[c_row, c_col] = flat_values.to(dtype)
        return out

    in_loss = torch.tensor([float(batch.in_loss(i)) for i in range(rows)])[c_row]
    if batch.model_masks is not None:  # environment tokens (tool results) are context, never trained on
        in_loss = in_loss * torch.tensor([m for mask in batch.model_masks for m in mask], dtype=torch.float32)
    response_mask = completion_tensor(in_loss, 0.0, torch.float32)
    targets = completion_tensor(batch.completion_ids, pad_id, torch.long)
    sampler_logprobs = completion_tensor(batch.sampler_logprobs, 0.0, torch.float32)
    advantages = completion_tensor(batch.advantages, 0.0, torch.float32)
    # positions count from each row's first real token, as the sampler numbers them
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        targets=targets,
        response_mask=response_mask,
        sampler_logprobs=sampler_logprobs,
        advantages=advantages,
    )
    if share_prompts:
        slots: dict[tuple[int, ...], int] = {}  # a distinct prompt -> its place in `rows`
        rows, index = [], []
        for i, prompt in enumerate(map(tuple, batch.prompt_ids)):
            if prompt not in slots:
                slots[prompt] = len(rows)
                rows.append(i)
            index.append(slots[prompt])
        if buckets:
            rows += rows[-1:] * (min(len(batch), 1 << (len(rows) - 1).bit_length()) - len(rows))
        tensors.update(prompt_rows=torch.tensor(rows), prompt_index=torch.tensor(index))
    if device.type == "cuda":  # from page-locked memory the copies run asynchronously, without a staging copy
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v.to(device) for k, v in tensors.items()}


def _chunk_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.gather(log_probs, -1, targets[..., None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else torch.zeros_like(chosen)
    return chosen, entropy


@functools.cache
def compiled_chunk_logprobs(backend: str):
    """`_chunk_logprobs` compiled once for every chunk shape: its log-softmax, gather and entropy fused (the
    reference workload's batch, forward and backward on one core: 39 -> 22 ms)."""
    return torch.compile(_chunk_logprobs, backend=backend, dynamic=True)


def token_logprobs(
    model: torch.nn.Module,
    t: dict[str, torch.Tensor],
    temperature: float,
    with_entropy: bool = True,
    chunk: int = DEFAULT_CHUNK,
    compile_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropy) of the completion tokens under logits / temperature, in fp32.

    `compile_backend`: compile the log-softmax with it (`trainer.compile`); None: run it eagerly."""
    resp_len = t["targets"].shape[1]
    if "prompt_rows" in t:
        logits = _shared_prompt_logits(model, t)
    else:
        logits = model(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
            use_cache=False,
            logits_to_keep=resp_len + 1,
        ).logits[:, :resp_len]
    recompute = torch.is_grad_enabled()
    chunk_logprobs = compiled_chunk_logprobs(compile_backend) if compile_backend else _chunk_logprobs
    parts = []
    for start in range(0, resp_len, chunk):
        args = (logits[:, start : start + chunk], t["targets"][:, start : start + chunk], temperature, with_entropy)
        parts.append(checkpoint(chunk_logprobs, *args, use_reentrant=False) if recompute else chunk_logprobs(*args))
    chosen = torch.cat([c for c, _ in parts], dim=1)
    return chosen, torch.cat([e for _, e in parts], dim=1) if with_entropy else None


class _PromptCapture(DynamicLayer):
    """A layer's keys and values in the prompts' forward: kept, and returned as they came (no cache before them).
    A block that activation checkpointing runs again stores the same values again."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.is_initialized, self.dtype, self.device = True, key_states.dtype, key_states.device
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PromptPrefix(DynamicLayer):
    """A layer's prompt keys and values, one row per completion, in front of the completions' own. `update`
    stores nothing, so a block run again by activation checkpointing attends to what it attended to before."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.is_initialized, self.dtype, self.device = True, keys.dtype, keys.device
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _shared_prompt_logits(model: torch.nn.Module, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits that predict each completion token, with each distinct prompt run once (`share_prompts`).

    The prompts' forward keeps each layer's keys and values (after RoPE); indexing them by `prompt_index`
    gives every completion its prompt's, through which the gradient flows back to the prompt, and the
    completions' forward attends to them as a generation step would. The last prompt position's logits
    predict completion token 0 and completion token j's predict token j + 1, so the last column is not run
    (`pad_batch` gives shared prompts two columns at least: every micro-batch runs both forwards)."""
    resp_len = t["targets"].shape[1]
    prompt_len = t["input_ids"].shape[1] - resp_len
    rows, index = t["prompt_rows"], t["prompt_index"]
    captured = Cache(layer_class_to_replicate=_PromptCapture)
    prompts = model(
        input_ids=t["input_ids"][rows, :prompt_len],
        attention_mask=t["attention_mask"][rows, :prompt_len],
        position_ids=t["position_ids"][rows, :prompt_len],
        past_key_values=captured,
        use_cache=True,
        logits_to_keep=1,
    )
    first = prompts.logits[index]
    prefix = Cache(layers=[_PromptPrefix(layer.keys[index], layer.values[index]) for layer in captured.layers])
    rest = model(
        input_ids=t["input_ids"][:, prompt_len:-1],
        attention_mask=t["attention_mask"][:, :-1],
        position_ids=t["position_ids"][:, prompt_len:-1],
        past_key_values=prefix,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], dim=1)


def forward_positions(t: dict[str, torch.Tensor], batch: TrainBatch) -> tuple[int, int]:
    """The positions `token_logprobs` runs through the model for `batch` laid out as `t`: (real tokens, with
    padding). Counted on the host from the batch and the tensors' shapes: no value is read from the device."""
    rows, width = t["attention_mask"].shape
    resp_len = t["targets"].shape[1]
    if "prompt_rows" not in t:
        return sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)), rows * width
    # each distinct prompt runs once (a repeated row of a bucketed count computes no real token); the completions'
    # last column is not run
    distinct = {tuple(p) for p in batch.prompt_ids}
    real = sum(map(len, distinct)) + sum(min(len(c), resp_len - 1) for c in batch.completion_ids)
    return real, t["prompt_rows"].shape[0] * (width - resp_len) + rows * (resp_len - 1)


def next_token_logprobs(model: torch.nn.Module, sequences: list[list[int]], device: torch.device) -> torch.Tensor:
    """The full fp32 log-softmax over the vocabulary at every position but the last of each sequence (the
    distribution of the token that follows it), rows stacked in order: what the consistency certificate compares
    with the engine's. One sequence a forward: no padding, so nothing but the model decides a row."""
    rows = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, :-1]
            rows.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    return torch.cat(rows)
