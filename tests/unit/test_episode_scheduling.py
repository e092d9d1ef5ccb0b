# ruff: noqa: F811 (the fixtures tokenizer and toolbox are test_episodes.py's, imported)
"""The two episode schedulers: episodes that advance on their own (`async`) give the rollouts lockstep gives for a
deterministic engine, with real tool workers (a per-episode instance included); a slow tool call holds only its
own episode (shown by the order of the engine's requests, not by timing); a failing tool still counts."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest
from test_episodes import ScriptedEngine, call_text, runner, tokenizer, toolbox  # noqa: F401 (fixtures)
from test_tool_failures import Characters, ScriptedTools
from turn_engines import BatchEngine, RunStream, StepEngine

from rl_tpu.episodes.asynchronous import AsyncScheduler
from rl_tpu.episodes.episode import EpisodeLimits, TurnOutput, TurnRequest
from rl_tpu.episodes.loop import EpisodeRunner, LockstepScheduler
from rl_tpu.episodes.tools import ToolError, ToolResult

SCHEDULERS = {"lockstep": LockstepScheduler(), "async": AsyncScheduler(64)}


class ContextEngine(BatchEngine):
    """Deterministic in each request alone: the turn's text depends on the prompt and the turn (prompt `k` makes
    `k % 4` calls, alternating the calculator and a per-episode counter, then answers), its logprobs on the whole
    context; so any scheduler must build the same episodes."""

    def __init__(self, tokenizer, prompts: list[list[int]]):
        super().__init__(self._answer)
        self.tokenizer, self.prompts = tokenizer, prompts

    def _answer(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        outputs = []
        for request in requests:
            k = next(i for i, p in enumerate(self.prompts) if request.ids[: len(p)] == p)
            if request.turn < k % 4:
                text = call_text(f"{k}*{request.turn}") if request.turn % 2 == 0 else call_text("x", name="counter")
            else:
                text = f" {k}"
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: request.max_tokens]
            logprobs = [-((len(request.ids) + i) % 7) / 8 for i in range(len(ids))]
            finish = "length" if len(ids) == request.max_tokens else "stop"
            outputs.append(TurnOutput(ids, logprobs, finish, 5))
        return outputs


def without_tool_time(rollout):
    return dataclasses.replace(rollout, episode=dataclasses.replace(rollout.episode, tool_s=0.0))


def test_async_episodes_equal_locksteps_for_a_deterministic_engine(tokenizer, toolbox, monkeypatch):
    # the same episode keys in both plays: the counter's text names the worker holding the instance (routed by key)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))
    prompts = [tokenizer.encode(f"Q: {k} {'x' * k}") for k in range(6)]
    kwargs = [{"counter": {"create_kwargs": {"start": 10 * k}}} for k in range(6)]
    played = {}
    for name, scheduler in SCHEDULERS.items():
        episodes = runner(tokenizer, toolbox, max_turns=3, max_tokens=400)
        episodes.scheduler = scheduler
        engine = ContextEngine(tokenizer, prompts)
        played[name] = (episodes.run(prompts, 2, list(range(6)), kwargs, engine), engine)
    (lockstep, lock_engine), (asynchronous, async_engine) = played["lockstep"], played["async"]
    assert [without_tool_time(r) for r in asynchronous] == [without_tool_time(r) for r in lockstep]
    assert [(r.group, r.episode.turns) for r in asynchronous] == [
        (k, min(k % 4, 2) + 1) for k in range(6) for _ in (0, 1)
    ]
    assert {r.episode.truncated for r in asynchronous} == {None, "max_turns"}
    assert any(r.episode.tool_calls.get("counter") for r in asynchronous)  # the per-episode instance, released
    assert all(
        r.episode.tool_reward == pytest.approx(0.5 + 0.125) for r in asynchronous if "counter" in r.episode.tool_calls
    )
    # the same turns were asked for, each with its own seed, though not in the same order
    key = lambda r: (r.seed, tuple(r.ids))  # noqa: E731
    assert sorted(map(key, async_engine.asked)) == sorted(map(key, lock_engine.asked))


class SlowTools(ScriptedTools):
    """Every call answers "ok"; a call of the tool `slow` comes back after 0.5 s, the others after 10 ms."""

    def __init__(self):
        super().__init__([], release=ToolResult("", 0.0))

    def run(self, calls, ends=()):
        self.sent += [*calls, *ends]
        return [ToolResult("ok", 0.0) for _ in calls] + [self.release for _ in ends], 0.0

    def stream(self) -> RunStream:
        return RunStream(self.run, delay=lambda calls: 0.5 if any(c.name == "slow" for c in calls) else 0.01)


def text_turn(script: dict[int, list[str]], request: TurnRequest) -> TurnOutput:
    """Prompt `[k]` answers `script[k][turn]`."""
    text = script[request.ids[0]][request.turn]
    return TurnOutput([ord(c) for c in text], [-0.5] * len(text), "stop", 1)


def texts_engine(script: dict[int, list[str]], sleep_s: float = 0.0) -> BatchEngine:
    """`text_turn` in steps of whole turns, each sleeping `sleep_s`."""

    def answer(requests):
        time.sleep(sleep_s)
        return [text_turn(script, r) for r in requests]

    return BatchEngine(answer)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_slow_tool_call_holds_only_its_own_episode(name):
    """Episode 0 calls a slow tool once; episode 1 calls a quick one three times. Advancing on their own, episode 1
    asks for its second, third and fourth turns while episode 0's call is still out; in lockstep it cannot."""
    script = {0: ["call:slow", "done"], 1: ["call:quick", "call:quick", "call:quick", "done"]}
    engine = texts_engine(script)
    limits = EpisodeLimits(max_turns=6, max_tokens=400, turn_tokens=50, max_model_len=1024)
    episodes = EpisodeRunner(limits, Characters(), SlowTools(), Characters(), scheduler=SCHEDULERS[name])
    rollouts = episodes.run([[0], [1]], 1, [0, 1], [{}, {}], engine)
    assert [r.episode.turns for r in rollouts] == [2, 4]
    order = [(r.ids[0], r.turn) for r in engine.asked]
    expected = [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (0, 1)]
    assert (order == expected) == (name == "async"), order


class TimedTools(SlowTools):
    """A call of the tool named `sN` comes back after N hundredths of a second; the workers use `cores` of CPU."""

    def __init__(self, cores: float):
        super().__init__()
        self.cores = cores

    def stream(self) -> RunStream:
        return RunStream(self.run, delay=lambda calls: int(calls[0].name[1:]) / 100, cores=self.cores)


@pytest.mark.parametrize("cores", [0.0, 1.0])
def test_answers_that_keep_coming_are_waited_for_only_while_the_tools_compute(cores):
    """Three episodes' second calls come back 0.01, 0.3 and 0.6 s after they were sent, each within a round (0.4 s
    of engine) of the one before, the last one after the deadline (a round after the first answer). While the tool
    workers compute, the last one is waited for: one round, as lockstep (a round then would compete with them for
    the CPU); once they are seen to wait (0.25 s of calls out), the round starts without it."""
    engine = texts_engine({k: ["call:s1", f"call:s{delay}", "done"] for k, delay in enumerate([1, 30, 60])}, 0.4)
    limits = EpisodeLimits(max_turns=6, max_tokens=400, turn_tokens=50, max_model_len=1024)
    episodes = EpisodeRunner(limits, Characters(), TimedTools(cores), Characters(), scheduler=AsyncScheduler(64))
    episodes.run([[0], [1], [2]], 1, [0, 1, 2], [{}] * 3, engine)
    rounds = [sorted(r.ids[0] for r in step) for step in engine.requests]
    if cores:
        assert rounds == [[0, 1, 2]] * 3, rounds
    else:
        assert rounds[:2] == [[0, 1, 2]] * 2 and 2 not in rounds[2], rounds
        assert sorted(k for step in rounds[2:] for k in step) == [0, 1, 2], rounds


@pytest.mark.parametrize(("cores", "on_cpu"), [(0.0, True), (1.0, True), (1.0, False)])
def test_a_turn_joins_the_turns_under_way_unless_it_would_compete_with_the_tools(cores, on_cpu):
    """Episode 0's first turn takes 30 engine steps (1.5 s); episode 1's takes one, then calls a tool for 0.6 s (the
    tools' load is known after 0.25 s of calls out). Tools that wait (a remote environment), or an accelerator's
    engine: episode 1's second turn joins episode 0's under way as soon as its call came back, continuous batching.
    Tools that compute beside a CPU engine: it waits for the next round, as it would compete with them."""
    script = {0: ["done"], 1: ["call:s60", "done"]}
    steps = {(0, 0): 30, (1, 0): 1, (1, 1): 1}
    engine = StepEngine(lambda r: (text_turn(script, r), steps[(r.ids[0], r.turn)]), 0.05)
    limits = EpisodeLimits(max_turns=6, max_tokens=400, turn_tokens=50, max_model_len=1024)
    scheduler = AsyncScheduler(64, engine_on_cpu=on_cpu)
    episodes = EpisodeRunner(limits, Characters(), TimedTools(cores), Characters(), scheduler=scheduler)
    rollouts = episodes.run([[0], [1]], 1, [0, 1], [{}] * 2, engine)
    assert [r.episode.turns for r in rollouts] == [1, 2]
    together = [step for step in engine.steps if {(r.ids[0], r.turn) for r in step} == {(0, 0), (1, 1)}]
    assert bool(together) == (not cores or not on_cpu), [[(r.ids[0], r.turn) for r in step] for step in engine.steps]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_failing_tool_still_counts_toward_the_failure_rate_stop(tokenizer, toolbox, name):
    episodes = runner(tokenizer, toolbox, max_turns=2, max_tokens=400)
    episodes.scheduler = SCHEDULERS[name]
    raises = ' <tool_call>{"name": "raises", "arguments": {}}</tool_call>'
    with pytest.raises(ToolError, match="(?s)1 of the 1 tool calls of this batch failed.*'raises'.*the tool broke"):
        episodes.run([tokenizer.encode("Q:")], 1, [0], [{}], ScriptedEngine(tokenizer, [raises]))


def test_async_tool_calls_of_several_episodes_run_at_once_in_real_workers(tokenizer, toolbox):
    """Calls of episodes that ended their turns at different steps are in the workers together: the stream sends
    a busy worker more (its results carry each call's own answer)."""
    stream = toolbox.stream()
    try:
        groups = [stream.submit([call]) for call in calc_calls(["6*7", "2+2", "10-3"])]
        assert stream.calls_in_flight == 3
        answered = {}
        while len(answered) < 3:
            for group, results, _ in stream.poll(1.0):
                answered[group] = results[0].text
        assert [answered[g] for g in groups] == ["42", "4", "7"]
    finally:
        stream.close()


def calc_calls(expressions: list[str]):
    from rl_tpu.episodes.tool_worker import ToolCall

    return [ToolCall("calc", json.dumps({"expression": e}), {}) for e in expressions]


def test_the_scheduling_key_is_checked():
    from rl_tpu.config.episode import EpisodeConfig

    with pytest.raises(ValueError, match="episode.scheduling='eager': allowed values are async, lockstep"):
        EpisodeConfig(scheduling="eager")
    with pytest.raises(ValueError, match="episode.max_calls_in_flight=0 must be >= 1"):
        EpisodeConfig(max_calls_in_flight=0)
