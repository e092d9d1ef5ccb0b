"""The turn loop: what each model turn and each tool turn does to an episode (`EpisodeRunner`), and the lockstep
scheduler (`episode.scheduling=lockstep`: every live episode of a batch goes to the engine together at each turn,
and their tool calls run together); episodes that advance on their own are `rl_tpu.episodes.asynchronous`'s. Each
episode's environment tokens are appended to the ids the engine produced.

An episode ends when its model turn calls no tool, after `max_turns` model turns (a turn that still calls tools
then is cut: truncated "max_turns"), or when its tokens after the prompt reach `max_tokens` (truncated
"max_tokens"; a tool result that would not leave room for one more model token is not appended, so an episode
always ends on the model's tokens, where the outcome reward sits; such episodes are counted and logged). The
loop records where each model turn starts and where the final one's answer ends, before its first tool call
(`EpisodeStats.turn_starts`, `answer_end`): the text an outcome reward reads.

A tool with an instance per episode (`lifetime: episode`, a stateful environment) is created by the episode's
first call of it and released when the episode ends (in lockstep with the next turn's calls; the rest when the
batch ends).
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
from typing import Any, Protocol

from rl_tpu.config import OutcomesConfig
from rl_tpu.episodes.episode import (
    Episode,
    EpisodeLimits,
    TurnEngine,
    TurnOutput,
    TurnRequest,
    generate_all,
    turn_seed,
)
from rl_tpu.episodes.render import Renderer
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease
from rl_tpu.episodes.tools import MODEL_ERRORS, ToolBox, ToolResult, failure_outcome
from rl_tpu.records import Outcome, Rollout

log = logging.getLogger(__name__)


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


class EpisodeRunner:
    """Runs a batch of episodes on one engine. What a turn does to an episode is here, shared by both schedulers;
    when episodes go to the engine and to the tools is the scheduler's (`LockstepScheduler`, or
    `rl_tpu.episodes.asynchronous.AsyncScheduler`)."""

    def __init__(
        self,
        limits: EpisodeLimits,
        parser: ToolCallParser,
        tools: ToolBox,
        renderer: Renderer,
        outcomes: OutcomesConfig | None = None,
        scheduler: Scheduler | None = None,
    ):
        """`outcomes`: which episodes are played again, and how often (None: none); `scheduler`: lockstep if None."""
        self.limits, self.parser, self.tools, self.renderer = limits, parser, tools, renderer
        self.outcomes = outcomes or OutcomesConfig()
        self.scheduler = scheduler or LockstepScheduler()

    def run(
        self,
        prompts: list[list[int]],
        samples: int,
        seeds: list[int | None],
        tools_kwargs: list[dict],
        engine: TurnEngine,
    ) -> list[Rollout]:
        """`samples` episodes per prompt, in prompt order (each prompt's `group` its index), whatever the order
        they ended in."""
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
                self.scheduler.play(self, playing, engine)
                playing = self._again(episodes)
        finally:  # what is still open if the batch failed
            self.release_now([e for e in episodes if e.open_tools])
        self.tools.end_batch()  # past episode.max_tool_failure_rate the run stops, naming the tool
        self._log_dropped_results(episodes)
        return [e.rollout() for e in episodes]

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

    def request(self, episode: Episode) -> TurnRequest | None:
        """The episode's next model turn, with what is left of its budget; None (and the episode ended, truncated
        max_tokens) where nothing is left."""
        limits = self.limits
        budget = min(
            limits.turn_tokens,
            limits.max_tokens - len(episode.ids),
            limits.max_model_len - len(episode.prompt_ids) - len(episode.ids),
        )
        if budget <= 0:
            episode.end("max_tokens")
            return None
        turns = episode.stats.turns
        return TurnRequest(episode.context(), budget, turn_seed(episode.seed, episode.sample, turns), turns)

    def take_turn(self, episode: Episode, turn: TurnOutput) -> bool:
        """Adds a model turn to its episode; True where it called tools that will run, else the episode ended."""
        limits = self.limits
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
            return True
        return False

    def calls(self, episode: Episode) -> list[ToolCall]:
        """The episode's pending calls, a per-episode tool's naming its instance."""
        made = []
        for name, arguments in episode.pending_calls:
            create_kwargs = episode.tools_kwargs.get(name, {}).get("create_kwargs", {})
            if name not in self.tools.per_episode:
                made.append(ToolCall(name, arguments, create_kwargs))
                continue
            episode.open_tools.add(name)
            made.append(ToolCall(name, arguments, create_kwargs, episode.key, name not in episode.succeeded_tools))
        return made

    @staticmethod
    def releases(ending: list[Episode]) -> tuple[list[tuple[Episode, str]], list[ToolRelease]]:
        """The ending episodes' per-episode instances to release (now closed), with their owners."""
        owners = [(e, name) for e in ending for name in sorted(e.open_tools)]
        for episode in ending:
            episode.open_tools = set()
        return owners, [ToolRelease(name, e.key, name in e.succeeded_tools) for e, name in owners]

    def released(self, owners: list[tuple[Episode, str]], results: list[ToolResult]) -> None:
        for (episode, name), result in zip(owners, results, strict=True):
            self._count(episode, name, result)  # calc_reward's, once per instance

    def release_now(self, ending: list[Episode]) -> None:
        owners, ends = self.releases(ending)
        if ends:
            self.released(owners, self.tools.run([], ends)[0])

    @staticmethod
    def _count(episode: Episode, name: str, result: ToolResult) -> None:
        if result.failure:
            episode.stats.tool_failures[name] = episode.stats.tool_failures.get(name, 0) + 1
            episode.outcome = Outcome.first(episode.outcome, failure_outcome(result.failure))
        if result.failure == "lost":
            episode.stats.lost_instance = name
        episode.stats.tool_reward += result.reward

    def take_results(self, episode: Episode, results: list[ToolResult], seconds: float) -> None:
        """Counts the episode's call results and appends them, or ends it where they would not leave room for
        another model turn."""
        episode.stats.tool_turns.append(
            [{"name": name, "status": r.failure or "ok"} for (name, _), r in zip(episode.pending_calls, results)]
        )
        for (name, _), result in zip(episode.pending_calls, results, strict=True):
            if result.failure in MODEL_ERRORS:  # the model's mistake, not the tool's: the call was malformed
                episode.stats.malformed_calls += 1
                continue
            episode.stats.tool_calls[name] = episode.stats.tool_calls.get(name, 0) + 1
            self._count(episode, name, result)
            if result.failure is None and name in self.tools.per_episode:
                episode.succeeded_tools.add(name)
        episode.stats.tool_s += seconds
        turn = self.renderer.environment_ids(episode.context(), episode.pending_calls, [r.text for r in results])
        if len(episode.ids) - turn.replaced + len(turn.ids) >= self.limits.max_tokens:
            episode.end("max_tokens")  # no room for the model to read the result and answer
            episode.stats.dropped_result_tokens = len(turn.ids)
        else:
            episode.add_environment(turn.ids, turn.replaced)


class Scheduler(Protocol):
    def play(self, runner: EpisodeRunner, episodes: list[Episode], engine: TurnEngine) -> None:
        """Turns until every episode ended and released what it held."""
        ...


class LockstepScheduler:
    """Every live episode goes to the engine together at each turn, and their tool calls run together: the next
    turn waits for the slowest call (`episode.scheduling=lockstep`, the baseline)."""

    def play(self, runner: EpisodeRunner, episodes: list[Episode], engine: TurnEngine) -> None:
        while live := [e for e in episodes if not e.done]:
            asking = [(e, r) for e in live if (r := runner.request(e)) is not None]
            turns = generate_all(engine, [r for _, r in asking]) if asking else []
            calling = [e for (e, _), turn in zip(asking, turns, strict=True) if runner.take_turn(e, turn)]
            self._tool_turn(runner, calling, ending=[e for e in live if e.done and e.open_tools])
        runner.release_now([e for e in episodes if e.open_tools])  # those that ended on a tool turn

    @staticmethod
    def _tool_turn(runner: EpisodeRunner, calling: list[Episode], ending: list[Episode]) -> None:
        """Runs the calling episodes' calls and appends their results; releases the ending episodes' instances."""
        calls = [runner.calls(e) for e in calling]
        owners, ends = runner.releases(ending)
        results, seconds = runner.tools.run([c for mine in calls for c in mine], ends)
        start = sum(len(mine) for mine in calls)
        runner.released(owners, results[start:])
        start = 0
        for episode, mine in zip(calling, calls):
            runner.take_results(episode, results[start : start + len(mine)], seconds)
            start += len(mine)
