"""One episode's record (`Episode`: its ids, masks, logprobs, weight versions and stats as its turns are added),
the limits that end it, and what passes between an episode and the engine (`TurnRequest`, `TurnOutput`, through a
`TurnEngine`). The schedulers (`rl_tpu.episodes.loop`, `rl_tpu.episodes.asynchronous`) move episodes; what a turn
does to one is here and in `EpisodeRunner`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rl_tpu.data.datasets import derived_seed
from rl_tpu.records import EpisodeStats, Outcome, Rollout


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns
    max_tokens: int  # model and environment tokens after the prompt
    turn_tokens: int  # new tokens per model turn (sampler.response_length)
    max_model_len: int  # the engine's context
    max_parallel_calls: int = 1  # calls of one turn that run; the rest are dropped and counted malformed


@dataclass(frozen=True)
class TurnRequest:
    ids: list[int]  # the whole context: prompt, then every turn so far
    max_tokens: int
    seed: int | None
    turn: int = 0  # the episode's model turn it asks for (0: the first)


@dataclass(frozen=True)
class TurnOutput:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    version: int  # the weights that sampled it


class TurnEngine(Protocol):
    """The engine as the schedulers drive it: requests added one by one, each finished turn returned by the step that
    ended it (vLLM's request-level API in the engine's actor; a scripted stand-in in tests)."""

    def add(self, request: TurnRequest) -> str:
        """Queues one model turn; returns its id."""
        ...

    def step(self) -> list[tuple[str, TurnOutput]]:
        """One engine step over every queued turn; the turns it finished, by id."""
        ...

    def busy(self) -> bool:
        """Turns are queued or running."""
        ...


def generate_all(engine: TurnEngine, requests: list[TurnRequest]) -> list[TurnOutput]:
    """The turns of `requests`, in order, once every one of them ended (one lockstep turn)."""
    ids = [engine.add(request) for request in requests]
    done: dict[str, TurnOutput] = {}
    while engine.busy():
        done.update(engine.step())
    return [done[i] for i in ids]


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """One episode's draws at one turn: fixed by its prompt's seed, so a resumed run draws them again."""
    return None if seed is None else derived_seed(seed, sample, turn)


@dataclass
class Episode:
    prompt_ids: list[int]
    seed: int | None
    sample: int  # its index among its prompt's samples
    group: int
    tools_kwargs: dict
    ids: list[int] = field(default_factory=list)  # after the prompt
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stats: EpisodeStats = field(default_factory=lambda: EpisodeStats(turns=0))
    finish_reason: str = "stop"
    done: bool = False
    pending_calls: list[tuple[str, str]] = field(default_factory=list)  # this turn's calls, (name, JSON arguments)
    key: str = ""  # unique in the engine's life: names its instances of per-episode tools
    open_tools: set[str] = field(default_factory=set)  # per-episode tools it called, not yet released
    succeeded_tools: set[str] = field(default_factory=set)  # per-episode tools it called successfully
    outcome: Outcome | None = None  # the worst its tools did (None: nothing failed that was not the model's doing)

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_model_turn(self, turn: TurnOutput, answer_length: int) -> None:
        """`answer_length`: the turn's ids before its first tool call (`ToolCallParser.answer_length`)."""
        self.stats.turn_starts.append(len(self.ids))
        self.stats.answer_end = len(self.ids) + answer_length
        self.ids += turn.ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.ids)
        self.versions.append(turn.version)
        self.stats.turns += 1
        self.finish_reason = turn.finish_reason

    def add_environment(self, ids: list[int], replaced: int = 0) -> None:
        """Appends the environment's ids after dropping the last `replaced` (model) ids the chat template renders
        otherwise (verl's GLM boundary: a stop token that is not the tool turn's first)."""
        if replaced:
            del self.ids[-replaced:], self.logprobs[-replaced:], self.mask[-replaced:]
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.stats.env_tokens += len(ids)

    def end(self, truncated: str | None = None) -> None:
        self.done = True
        if truncated:
            self.stats.truncated, self.finish_reason = truncated, "length"

    def rollout(self) -> Rollout:
        return Rollout(
            self.prompt_ids,
            self.ids,
            self.logprobs,
            min(self.versions),
            self.finish_reason,
            self.group,
            self.mask,
            self.stats,
            self.outcome,
        )

    def again(self) -> Episode:
        """This episode to be played again from its prompt, in fresh tool instances (a key of its own)."""
        retries = self.stats.retries + 1
        stats = EpisodeStats(turns=0, retries=retries)
        return Episode(
            self.prompt_ids,
            self.seed,
            self.sample,
            self.group,
            self.tools_kwargs,
            stats=stats,
            key=f"{self.key}/retry{retries}",
        )
