"""The records that cross between sampler, controller and trainer: the bottom layer, importing nothing of rl_tpu.

A `Rollout` carries token ids, never text to re-tokenise, plus the sampler's per-token
logprobs and the weight version that produced it. A `TrainBatch` is what the trainer
consumes: rollouts flattened with their advantages. A `WeightBundle` is what the trainer
publishes and an engine loads: versioned, checksummed buckets of named tensors
(`rl_tpu/sync/` makes and reads them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch


class Outcome(StrEnum):
    """How a rollout ended, which decides what the learning signal does with it (`algorithm.outcomes`,
    rl_tpu/algorithms/outcomes.py). Listed in precedence: a rollout that met several carries the first of them."""

    lost = "lost"  # a per-episode tool instance was lost with its worker: its state and tool reward are gone
    reward_error = "reward_error"  # a reward raised, returned something that is not a finite number, or crashed
    timeout = "timeout"  # a reward or a tool call ran past its deadline
    # a tool raised on arguments the model wrote well, returned garbage, or its worker was down: the environment's
    # fault (an unknown tool or arguments that fail its schema are the model's: `EpisodeStats.malformed_calls`)
    tool_failure = "tool_failure"
    truncated = "truncated"  # cut at a length or turn limit (finish_reason "length")
    scored = "scored"  # none of these: its reward is what its tokens earned

    @classmethod
    def first(cls, *kinds: str | None) -> Outcome:
        """The kind that decides among several (None: nothing happened; scored when all are None)."""
        order = list(cls)
        return min((cls(k) for k in kinds if k is not None), key=order.index, default=cls.scored)


@dataclass
class EpisodeStats:
    """What a multi-turn episode did beside its tokens: turns, tool calls, how it ended."""

    turns: int  # model turns
    tool_calls: dict[str, int] = field(default_factory=dict)  # per tool name
    tool_failures: dict[str, int] = field(default_factory=dict)  # per tool name: raised, timed out, invalid result
    malformed_calls: int = 0  # tool-call blocks the parser could not read, or naming no known tool
    env_tokens: int = 0  # tokens the environment appended (tool results): out of the loss
    truncated: str | None = None  # "max_turns" or "max_tokens" when the episode was cut short, else None
    tool_s: float = 0.0  # seconds the episode's tool calls took (they run concurrently across episodes)
    tool_reward: float = 0.0  # the sum of the tools' `calc_reward` over the episode's calls
    turn_starts: list[int] = field(default_factory=list)  # where each model turn starts in the completion ids
    # where the final model turn's answer ends: before its first tool call (run, left unrun or cut), else its end
    answer_end: int = 0
    # the per-episode tool whose instance was lost with its worker after a call of it succeeded: the episode's state
    # and tool reward are gone, and its outcome is lost (None: nothing lost)
    lost_instance: str | None = None
    dropped_result_tokens: int = 0  # a tool result that did not fit (the episode ended, truncated): its tokens
    # times the episode was played again in fresh tool instances (`algorithm.outcomes.<kind>=retry`); the other
    # fields are its last play's
    retries: int = 0
    # each tool turn's calls in order, {"name", "status"}: "ok" or the failure's kind (what the rollout inspector shows)
    tool_turns: list[list[dict]] = field(default_factory=list)


@dataclass
class Rollout:
    """A prompt and what followed it: one completion, or a multi-turn episode (the model's turns and the
    environment's tokens between them, in order, as the engine saw them)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # sampler's logprob of each completion token, after temperature (0.0 on environment tokens)
    weight_version: int  # of the oldest weights that sampled any of its tokens
    finish_reason: str  # "stop" (eos) or "length"
    group: int = 0  # index of the prompt in its batch; GRPO normalises within a group
    # per completion token: 1 sampled by the model (in the loss), 0 appended by the environment; None: all sampled
    model_mask: list[int] | None = None
    episode: EpisodeStats | None = None  # multi-turn episodes only
    # how it ended (`Outcome`): set by the episode loop (tool failures) and after grading (a reward's failure); lost
    # where its episode lost an instance, truncated where finish_reason is "length", whatever it was given
    outcome: str | None = None

    def __post_init__(self) -> None:
        lost = self.episode is not None and self.episode.lost_instance is not None
        truncated = self.finish_reason == "length"
        self.outcome = Outcome.first(
            self.outcome, Outcome.lost if lost else None, Outcome.truncated if truncated else None
        )
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"rollout has {len(self.completion_ids)} completion tokens but {len(self.logprobs)} logprobs"
            )
        if self.model_mask is not None and len(self.model_mask) != len(self.completion_ids):
            raise ValueError(
                f"rollout has {len(self.completion_ids)} completion tokens but a model mask of {len(self.model_mask)}"
            )

    def with_outcome(self, kind: str | None) -> Rollout:
        """This rollout, carrying `kind` where that decides before its own outcome (None: unchanged)."""
        return dataclasses.replace(self, outcome=Outcome.first(self.outcome, kind))

    def answer_ids(self) -> list[int]:
        """What an outcome reward reads: the completion, or an episode's final model turn before its first tool
        call; never the tools' results, the calls or the earlier turns (the model's answer is its last word)."""
        if self.episode is None:
            return self.completion_ids
        final_turn = self.episode.turn_starts[-1] if self.episode.turn_starts else 0  # none: the prompt filled it
        return self.completion_ids[final_turn : self.episode.answer_end]

    def turn_spans(self) -> list[tuple[str, int, int]]:
        """An episode's completion as (role, start, end) spans in order: each model turn ("model") and each stretch
        of environment tokens between them ("environment")."""
        mask = self.model_mask
        cuts = sorted(
            {0, len(mask), *self.episode.turn_starts, *(i for i in range(1, len(mask)) if mask[i] != mask[i - 1])}
        )
        return [("model" if mask[a] else "environment", a, b) for a, b in zip(cuts, cuts[1:])]

    def model_tokens(self) -> int:
        """Completion tokens the model sampled (an episode's tool results left out)."""
        return len(self.completion_ids) if self.model_mask is None else sum(self.model_mask)

    @classmethod
    def from_dict(cls, fields: dict) -> Rollout:
        """The rollout `dataclasses.asdict` made `fields` of (JSON keeps every float exactly)."""
        episode = fields.get("episode")
        if episode is not None and "turn_starts" not in episode:
            raise ValueError(
                "a saved episode has no turn_starts: it was recorded before episodes kept where their final turn "
                "starts, so its answer cannot be told from its tool results; resume from a later checkpoint or "
                "start the run again"
            )
        return cls(**{**fields, "episode": EpisodeStats(**episode) if episode is not None else None})


@dataclass
class TrainBatch:
    """Rollouts for one training step, in the order the trainer sees them."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[list[float]]  # one per completion token (outcome estimators give each token the same)
    temperature: float
    # importance weights pi_trainer / pi_sampler: "token", "sequence", or None (on-policy: no weights)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0  # the weights are truncated at this
    # per sequence, whether its tokens are in the loss (overlong filtering leaves truncated ones out, and an episode
    # that lost its tool instance is left out); None: all
    loss_mask: list[bool] | None = None
    # per completion token, whether the model sampled it (environment tokens stay out of the loss); None: all did
    model_masks: list[list[int]] | None = None
    # per sequence, its number among those whose per-token trainer logprobs and entropy the update keeps for the
    # rollout record (`PolicyUpdate.take_recorded`), -1 for the others; None: none kept
    recorded: list[int] | None = None

    def __post_init__(self) -> None:
        for i, (completion, advantages) in enumerate(zip(self.completion_ids, self.advantages, strict=True)):
            if len(advantages) != len(completion):
                raise ValueError(
                    f"sequence {i} has {len(completion)} completion tokens but {len(advantages)} advantages"
                )
            if self.model_masks is not None and len(self.model_masks[i]) != len(completion):
                raise ValueError(
                    f"sequence {i} has {len(completion)} completion tokens but a model mask of "
                    f"{len(self.model_masks[i])}"
                )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def _take(self, rows) -> "TrainBatch":
        rows = list(rows)
        return dataclasses.replace(
            self,
            prompt_ids=[self.prompt_ids[i] for i in rows],
            completion_ids=[self.completion_ids[i] for i in rows],
            sampler_logprobs=[self.sampler_logprobs[i] for i in rows],
            advantages=[self.advantages[i] for i in rows],
            loss_mask=None if self.loss_mask is None else [self.loss_mask[i] for i in rows],
            model_masks=None if self.model_masks is None else [self.model_masks[i] for i in rows],
            recorded=None if self.recorded is None else [self.recorded[i] for i in rows],
        )

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """The contiguous slice a data-parallel rank trains on."""
        per_rank = -(-len(self) // world_size)
        return self._take(range(len(self))[rank * per_rank : (rank + 1) * per_rank])

    def sorted_by_length(self) -> "TrainBatch":
        """The same sequences by completion length, then prompt length, so that a micro-batch pads less: each
        pads its prompts to its longest prompt and its completions to its longest completion. A group's
        completions share one prompt, so completion length is the key that varies most."""
        return self._take(
            sorted(range(len(self)), key=lambda i: (len(self.completion_ids[i]), len(self.prompt_ids[i])))
        )

    def rows_with_signal(self, multiple: int) -> "TrainBatch":
        """The rows in the loss with a non-zero advantage, in batch order: the only ones whose gradient can be non-zero.

        Topped up with the shortest other rows to a multiple of `multiple` (at least one, at most every row): of
        the data-parallel ranks, so that each gets as many rows and runs as many forward and backward passes
        (FSDP's collectives pair them across ranks), or of ranks times micro-batch rows, so that no micro-batch
        has a new row count (a compiler's new shape)."""
        signal = [i for i in range(len(self)) if self.in_loss(i) and any(a != 0.0 for a in self.advantages[i])]
        wanted = min(len(self), max(multiple, -(-len(signal) // multiple) * multiple))
        rest = sorted(
            set(range(len(self))) - set(signal),
            key=lambda i: (len(self.completion_ids[i]) + len(self.prompt_ids[i]), i),
        )
        return self._take(sorted(signal + rest[: wanted - len(signal)]))

    def in_loss(self, i: int) -> bool:
        return self.loss_mask is None or self.loss_mask[i]

    def model_tokens(self, i: int) -> int:
        """Completion tokens of sequence i the model sampled."""
        return len(self.completion_ids[i]) if self.model_masks is None else sum(self.model_masks[i])

    def num_tokens(self) -> int:
        """Completion tokens in the loss."""
        return sum(self.model_tokens(i) for i in range(len(self)) if self.in_loss(i))

    def num_seqs(self) -> int:
        """Sequences in the loss."""
        return sum(self.in_loss(i) for i in range(len(self)))


class WeightSyncError(RuntimeError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # e.g. "float32", "bfloat16"
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    specs: tuple[TensorSpec, ...]
    checksum: str
    handle: Any  # object_store: [ObjectRef]; shm_file: the file's path; collective: the group's {host, port}
    index: int  # its place in the bundle (buckets may come from several senders)


@dataclass(frozen=True)
class CanaryTokens:
    """The weight canary's fixed token sequences (rl_tpu/sync/canary.py), which every engine scores right after it
    installs a version and the trainer scores under the weights it published as that version."""

    sequences: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]  # each sequence's first continuation token: the tokens before it are its prompt


@dataclass(frozen=True)
class Canary:
    """Trainer rank 0's logprob of each canary continuation token under the weights it published as `version`."""

    version: int
    dtype: str  # the served dtype, which sets the default bound on the gap
    logprobs: tuple[float, ...]  # every continuation token's, sequence after sequence
    seconds: float = 0.0  # how long scoring them took the trainer


@dataclass(frozen=True)
class WeightBundle:
    version: int
    transport: str
    buckets: tuple[Bucket, ...]
    num_bytes: int
    # a LoRA adapter's bundle: its `adapter_config.json` content (None: the buckets hold the full weights), and
    # the checksum of the base it applies to, which every engine compares with the base it serves
    adapter: dict | None = None
    base_checksum: str | None = None
    canary: CanaryTokens | None = None  # what the engines score once they installed it (None: no canary)

    @property
    def names(self) -> list[str]:
        return [spec.name for bucket in self.buckets for spec in bucket.specs]

    @classmethod
    def merge(cls, parts: list["WeightBundle"]) -> "WeightBundle":
        """One bundle from the parts that several trainer ranks sent (each holds some of the buckets)."""
        buckets = tuple(sorted((b for part in parts for b in part.buckets), key=lambda b: b.index))
        if {(p.version, p.transport) for p in parts} != {(parts[0].version, parts[0].transport)} or [
            b.index for b in buckets
        ] != list(range(len(buckets))):
            raise WeightSyncError(
                f"the trainer ranks' parts of a weight bundle do not fit together: versions "
                f"{[p.version for p in parts]}, buckets {[[b.index for b in p.buckets] for p in parts]}"
            )
        # a LoRA adapter's config and base checksum travel with rank 0's part
        lead = next((p for p in parts if p.base_checksum is not None), parts[0])
        return cls(
            lead.version, lead.transport, buckets, sum(p.num_bytes for p in parts), lead.adapter, lead.base_checksum
        )
