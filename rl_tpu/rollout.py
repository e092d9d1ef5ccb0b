"""The records that cross between sampler, controller and trainer.

A `Rollout` carries token ids, never text to re-tokenise, plus the sampler's per-token
logprobs and the weight version that produced it. A `TrainBatch` is what the trainer
consumes: rollouts flattened with their advantages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampler's logprob of each completion token, after temperature
    weight_version: int
    finish_reason: str  # "stop" (eos) or "length"
    group: int = 0  # index of the prompt in its batch; GRPO normalises within a group

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"rollout has {len(self.completion_ids)} completion tokens but {len(self.logprobs)} logprobs"
            )


@dataclass
class TrainBatch:
    """Rollouts for one optimizer step, in the order the trainer sees them."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]  # one scalar per sequence (outcome reward), broadcast over its tokens
    temperature: float
    # Async mode: truncate importance weights (trainer / sampler probability) at this; None: on-policy, no weights
    rollout_is_threshold: float | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """The contiguous slice a data-parallel rank trains on."""
        per_rank = -(-len(self) // world_size)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        return TrainBatch(self.prompt_ids[sl], self.completion_ids[sl], self.sampler_logprobs[sl],
                          self.advantages[sl], self.temperature, self.rollout_is_threshold)

    def sorted_by_length(self) -> "TrainBatch":
        """The same sequences by completion length, then prompt length, so that a micro-batch pads less: each
        pads its prompts to its longest prompt and its completions to its longest completion. A group's
        completions share one prompt, so completion length is the key that varies most."""
        order = sorted(range(len(self)), key=lambda i: (len(self.completion_ids[i]), len(self.prompt_ids[i])))
        return TrainBatch([self.prompt_ids[i] for i in order], [self.completion_ids[i] for i in order],
                          [self.sampler_logprobs[i] for i in order], [self.advantages[i] for i in order],
                          self.temperature, self.rollout_is_threshold)

    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)
