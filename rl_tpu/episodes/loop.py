"""The turn loop: every live episode of a batch goes to the engine together at each turn, their tool calls run
together, and each episode's environment tokens are appended to the ids the engine produced.

An episode ends when its model turn calls no tool, after `max_turns` model turns (a turn that still calls tools
then is cut: truncated "max_turns"), or when its tokens after the prompt reach `max_tokens` (truncated
"max_tokens"; a tool result that would not leave room for one more model token is not appended, so an episode
always ends on the model's tokens, where the outcome reward sits; such episodes are counted and logged). The
loop records where each model turn starts and where the final one's answer ends, before its first tool call
(`EpisodeStats.turn_starts`, `answer_end`): the text an outcome reward reads.

A tool with an instance per episode (`lifetime: episode`, a stateful environment) is created by the episode's
first call of it and released when the episode ends, with the next turn's calls (the rest when the batch ends).
An episode whose instance was lost with its worker after a call of it succeeded (its state and reward are gone)
is marked (`EpisodeStats.lost_instance`).

Each episode's outcome (`Rollout.outcome`) records the worst its tools did (`tools.failure_outcome`: `lost`,
`timeout`, `tool_failure`; the model's malformed calls leave it scored). An episode whose outcome
`algorithm.outcomes` sets to retry is played again once the batch's episodes ended, in fresh tool instances, with
its own seed (the same draws where the engine is deterministic: the episode the model would have played in a
working environment), up to `algorithm.outcomes.max_retries` times (`EpisodeStats.retries`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from rl_tpu.config import OutcomesConfig
from rl_tpu.data.datasets import derived_seed
from rl_tpu.episodes.render import Renderer, make_renderer
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease
from rl_tpu.episodes.tools import MODEL_ERRORS, ToolBox, ToolResult, ToolSettings, failure_outcome
from rl_tpu.records import EpisodeStats, Outcome, Rollout

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class TurnOutput:
    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    version: int  # the weights that sampled it


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    """One episode's draws at one turn: fixed by its prompt's seed, so a resumed run draws them again."""
    return None if seed is None else derived_seed(seed, sample, turn)


class ToolCallParser:
    """verl's tool-call parser chosen by name (`hermes`, `qwen3_coder`, `gpt-oss`, ...), plus a count of blocks it
    dropped (verl's parsers skip a block they cannot read)."""

    def __init__(self, name: str, tokenizer: Any):
        from verl.experimental.agent_loop.tool_parser import ToolParser

        known = sorted(ToolParser._registry)
        if name not in known:
            raise ValueError(f"episode.tool_parser={name!r}: allowed values are {', '.join(known)}")
        self.parser = ToolParser.get_tool_parser(name, tokenizer)
        self.tokenizer = tokenizer
        self.start_marker = call_start_marker(name, self.parser)
        self.loop = asyncio.new_event_loop()

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.parser.stop_token_ids)

    def parse(self, ids: list[int]) -> tuple[list[tuple[str, str]], int]:
        """The turn's calls as (name, JSON arguments), and how many call blocks could not be read."""
        _, calls = self.loop.run_until_complete(self.parser.extract_tool_calls(ids))
        blocks = self.tokenizer.decode(ids).count(self.start_marker)
        return [(c.name, c.arguments) for c in calls], max(0, blocks - len(calls))

    def answer_length(self, ids: list[int]) -> int:
        """How many of a turn's ids come before its first call's start marker (all of them without one): a call,
        run or not, or cut by a limit, is not an answer, so an outcome reward reads the text before it at most."""
        at = self.tokenizer.decode(ids).find(self.start_marker)
        if at < 0:
            return len(ids)
        low, high = 0, len(ids)  # the longest prefix whose text stops before the marker
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if len(self.tokenizer.decode(ids[:middle])) <= at else (low, middle - 1)
        return low


# where a call starts, for the parsers that name it other than `tool_call_start_token`
_START_MARKER_FIELDS = ("tool_call_start_token", "tool_calls_section_start_token", "tool_calls_start_token")
_START_MARKERS = {"gpt-oss": " to=functions."}  # harmony's recipient, in the header of a call's message


def call_start_marker(name: str, parser: Any) -> str:
    """The text that starts a tool call of verl's parser `name`: it counts the call blocks a turn holds and cuts a
    turn's answer before its first call. A parser whose calls rl_tpu cannot find is refused."""
    found = [getattr(parser, f) for f in _START_MARKER_FIELDS if getattr(parser, f, None)]
    marker = _START_MARKERS.get(name) or next(iter(found), None)
    if marker is None:
        raise ValueError(
            f"episode.tool_parser={name!r}: rl_tpu does not know where its tool calls start, so it could not keep "
            "them out of the text a reward reads; use a parser with a start marker (hermes, qwen3_coder, glm, ...)"
        )
    return marker


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


class EpisodeRunner:
    """Runs a batch of episodes on one engine, given how to run one turn of several episodes."""

    def __init__(
        self,
        limits: EpisodeLimits,
        parser: ToolCallParser,
        tools: ToolBox,
        renderer: Renderer,
        outcomes: OutcomesConfig | None = None,
    ):
        """`outcomes`: which episodes are played again, and how often (None: none)."""
        self.limits, self.parser, self.tools, self.renderer = limits, parser, tools, renderer
        self.outcomes = outcomes or OutcomesConfig()

    def run(
        self,
        prompts: list[list[int]],
        samples: int,
        seeds: list[int | None],
        tools_kwargs: list[dict],
        generate: Callable[[list[TurnRequest]], list[TurnOutput]],
    ) -> list[Rollout]:
        """`samples` episodes per prompt, in prompt order (each prompt's `group` its index)."""
        batch = uuid.uuid4().hex
        episodes = [
            Episode(list(prompt), seed, sample, group, kwargs, key=f"{batch}/{group}/{sample}")
            for group, (prompt, seed, kwargs) in enumerate(zip(prompts, seeds, tools_kwargs, strict=True))
            for sample in range(samples)
        ]
        self.tools.begin_batch()
        playing = episodes
        try:
            while playing:
                self._play(playing, generate)
                playing = self._again(episodes)
        finally:  # what is still open if the batch failed
            self._tool_turn([], ending=[e for e in episodes if e.open_tools])
        self.tools.end_batch()  # past episode.max_tool_failure_rate the run stops, naming the tool
        self._log_dropped_results(episodes)
        return [e.rollout() for e in episodes]

    def _play(self, episodes: list[Episode], generate) -> None:
        """Turns until every episode ended, then the release of what they still hold (where a lost one shows)."""
        while live := [e for e in episodes if not e.done]:
            calling = self._model_turn(live, generate)
            self._tool_turn(calling, ending=[e for e in live if e.done and e.open_tools])
        self._tool_turn([], ending=[e for e in episodes if e.open_tools])  # those that ended on a tool turn

    def _again(self, episodes: list[Episode]) -> list[Episode]:
        """The episodes to play again (their outcome set to retry, retries left), replacing theirs in `episodes`."""
        again = []
        for i, episode in enumerate(episodes):
            if self.outcomes.retried(episode.outcome) and episode.stats.retries < self.outcomes.max_retries:
                episodes[i] = episode.again()
                again.append(episodes[i])
        return again

    def _log_dropped_results(self, episodes: list[Episode]) -> None:
        """One line for the batch's episodes that ended because a tool result did not fit (counted per episode)."""
        dropped = [e.stats.dropped_result_tokens for e in episodes if e.stats.dropped_result_tokens]
        if dropped:
            log.warning(
                "%d of %d episodes ended (truncated max_tokens) because a tool result of up to %d tokens did not fit "
                "in the %d tokens an episode may hold: raise episode.max_tokens or lower episode.max_tool_response_chars",
                len(dropped),
                len(episodes),
                max(dropped),
                self.limits.max_tokens,
            )

    def _model_turn(self, live: list[Episode], generate) -> list[Episode]:
        """One turn of every live episode; returns those whose turn called tools that will run."""
        limits, asking, requests = self.limits, [], []
        for episode in live:
            budget = min(
                limits.turn_tokens,
                limits.max_tokens - len(episode.ids),
                limits.max_model_len - len(episode.prompt_ids) - len(episode.ids),
            )
            if budget <= 0:
                episode.end("max_tokens")
                continue
            asking.append(episode)
            requests.append(
                TurnRequest(episode.context(), budget, turn_seed(episode.seed, episode.sample, episode.stats.turns))
            )
        calling = []
        for episode, turn in zip(asking, generate(requests) if requests else [], strict=True):
            episode.add_model_turn(turn, self.parser.answer_length(turn.ids))
            calls, malformed = self.parser.parse(turn.ids)
            episode.stats.malformed_calls += malformed + max(0, len(calls) - limits.max_parallel_calls)
            episode.pending_calls = calls[: limits.max_parallel_calls]
            if not episode.pending_calls:
                at_budget = turn.finish_reason == "length" and len(episode.ids) >= limits.max_tokens
                episode.end("max_tokens" if at_budget else None)
            elif episode.stats.turns >= limits.max_turns:
                episode.end("max_turns")
            else:
                calling.append(episode)
        return calling

    @staticmethod
    def _count(episode: Episode, name: str, result: ToolResult) -> None:
        if result.failure:
            episode.stats.tool_failures[name] = episode.stats.tool_failures.get(name, 0) + 1
            episode.outcome = Outcome.first(episode.outcome, failure_outcome(result.failure))
        if result.failure == "lost":
            episode.stats.lost_instance = name
        episode.stats.tool_reward += result.reward

    def _call(self, episode: Episode, name: str, arguments: str) -> ToolCall:
        create_kwargs = episode.tools_kwargs.get(name, {}).get("create_kwargs", {})
        if name not in self.tools.per_episode:
            return ToolCall(name, arguments, create_kwargs)
        episode.open_tools.add(name)
        return ToolCall(name, arguments, create_kwargs, episode.key, name not in episode.succeeded_tools)

    def _tool_turn(self, calling: list[Episode], ending: list[Episode]) -> None:
        """Runs the calling episodes' calls and appends their results; releases the ending episodes' instances."""
        calls = [self._call(e, name, arguments) for e in calling for name, arguments in e.pending_calls]
        owners = [(e, name) for e in ending for name in sorted(e.open_tools)]
        for episode in ending:
            episode.open_tools = set()
        ends = [ToolRelease(name, e.key, name in e.succeeded_tools) for e, name in owners]
        results, seconds = self.tools.run(calls, ends)
        for (episode, name), result in zip(owners, results[len(calls) :]):
            self._count(episode, name, result)  # calc_reward's, once per instance
        start = 0
        for episode in calling:
            mine = results[start : start + len(episode.pending_calls)]
            start += len(mine)
            calls_made = zip(episode.pending_calls, mine)
            episode.stats.tool_turns.append(
                [{"name": name, "status": r.failure or "ok"} for (name, _), r in calls_made]
            )
            for (name, _), result in zip(episode.pending_calls, mine):
                if result.failure in MODEL_ERRORS:  # the model's mistake, not the tool's: the call was malformed
                    episode.stats.malformed_calls += 1
                    continue
                episode.stats.tool_calls[name] = episode.stats.tool_calls.get(name, 0) + 1
                self._count(episode, name, result)
                if result.failure is None and name in self.tools.per_episode:
                    episode.succeeded_tools.add(name)
            episode.stats.tool_s += seconds
            turn = self.renderer.environment_ids(episode.context(), episode.pending_calls, [r.text for r in mine])
            if len(episode.ids) - turn.replaced + len(turn.ids) >= self.limits.max_tokens:
                episode.end("max_tokens")  # no room for the model to read the result and answer
                episode.stats.dropped_result_tokens = len(turn.ids)
            else:
                episode.add_environment(turn.ids, turn.replaced)


@dataclass(frozen=True)
class EpisodeOptions:
    """What an engine needs to run episodes (from the `episode` config section)."""

    limits: EpisodeLimits
    tools: ToolSettings
    tool_parser: str
    renderer: str  # auto | chat | plain
    tool_response_format: str  # plain renderer
    stop: tuple[str, ...]  # strings that end a model turn (kept in its ids)
    outcomes: OutcomesConfig | None = None  # which episodes are played again (`algorithm.outcomes`)


def build_runner(options: EpisodeOptions, tokenizer: Any, model_type: str | None) -> EpisodeRunner:
    """The parser, the tool workers and the renderer of one engine."""
    parser = ToolCallParser(options.tool_parser, tokenizer)
    tools = ToolBox(options.tools)
    try:
        renderer = make_renderer(
            options.renderer, tokenizer, options.tool_response_format, model_type, list(tools.schemas.values())
        )
    except Exception:
        tools.close()
        raise
    return EpisodeRunner(options.limits, parser, tools, renderer, options.outcomes)
