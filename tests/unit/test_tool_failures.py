"""Tool failures that must not pass silently (issue 47, items 6, 7 and 10): a worker that cannot be replaced fails
calls, not the run, and is tried again with backoff, a bounded number of times; too many failed calls stop the run
naming the tool; an episode whose per-episode instance was lost is marked and left out of the loss; a tool result
that does not fit is counted and logged; a tools YAML naming a missing module is refused, naming it, before the
model is resolved. The worker pool's restarts are checked with a small worker module of the test's own (its start
costs a Python start, not verl's import); the tool workers, verl's tools and the advantages are real."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import pytest
from conftest import compose_run
from turn_engines import BatchEngine, RunStream

from rl_tpu.cluster import worker_pool
from rl_tpu.cluster.worker_pool import WorkerLimits, WorkerPool, worker_environment
from rl_tpu.episodes.loop import EpisodeLimits, EpisodeRunner, TurnOutput
from rl_tpu.episodes.render import EnvironmentIds
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease, ToolWorker, _release, contained
from rl_tpu.episodes.tools import ToolBox, ToolError, ToolResult, ToolSettings
from rl_tpu.records import EpisodeStats, Rollout

FAKE_WORKER = """
import os
from rl_tpu.cluster.worker_pool import serve

def load(marker):
    if os.path.exists(marker):
        raise RuntimeError("the server is unreachable")
    return None, "ready"

def answer(state, positions, items, loop):
    for position, item in zip(positions, items):
        if item == "die":
            os._exit(3)
        yield [(position, ("ok", item))]

if __name__ == "__main__":
    serve(load, answer)
"""

TOOLS = """
import os
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Ok(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="ok"), 0.0, {}

class Raises(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the service is down")

class Exits(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        os._exit(3)
"""


def failed(kind: str, message: str) -> tuple:
    return ("fail", kind, message)


@pytest.fixture
def fake_pool(tmp_path, monkeypatch):
    """Two workers of FAKE_WORKER; each cannot start while the marker file exists. Backoff shortened."""
    monkeypatch.setattr(worker_pool, "RESTART_BACKOFF_S", 0.05)
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    env = worker_environment([])
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    marker = tmp_path / "unreachable"
    pool = WorkerPool("fake_worker", (str(marker), WorkerLimits()), 2, env, 10.0, "fake worker", RuntimeError)
    yield pool, marker
    pool.close()


def test_a_worker_that_cannot_be_replaced_fails_its_items_and_is_tried_again_with_backoff(fake_pool):
    pool, marker = fake_pool
    marker.touch()  # from now on a start fails, as a tool whose server is down after a timeout
    outcomes = pool.run(["die"], batched=False, failed=failed, route=lambda item: 0)
    assert outcomes[0][:2] == ("fail", "crash")  # before, the failed replacement raised out of run()
    # the place is down: its pinned items fail at once, naming why; the others go to the worker still up
    outcomes = pool.run(["a", "b", "c"], batched=False, failed=failed, route=lambda item: 0 if item == "a" else None)
    assert outcomes[0][:2] == ("fail", "unavailable") and outcomes[1:] == [("ok", "b"), ("ok", "c")]
    assert "1 of 5 starts failed in a row" in outcomes[0][2] and "the server is unreachable" in outcomes[0][2]
    marker.unlink()
    time.sleep(0.1)  # past the backoff: the next item that needs the place starts it again
    assert pool.run(["a"], batched=False, failed=failed, route=lambda item: 0) == [("ok", "a")]


def test_a_place_is_given_up_after_its_bounded_number_of_failed_starts(fake_pool):
    pool, marker = fake_pool
    marker.touch()
    pool.run(["die"], batched=False, failed=failed, route=lambda item: 0)
    for tries in range(2, worker_pool.MAX_FAILED_STARTS + 1):
        time.sleep(0.05 * 2 ** (tries - 2) + 0.05)  # the backoff doubles
        [outcome] = pool.run(["x"], batched=False, failed=failed, route=lambda item: 0)
        assert f"{tries} of 5 starts failed" in outcome[2]
    assert "given up" in outcome[2]
    marker.unlink()
    time.sleep(1.0)
    [outcome] = pool.run(["x"], batched=False, failed=failed, route=lambda item: 0)
    assert outcome[1] == "unavailable" and "given up" in outcome[2]  # no further start was tried
    assert pool.run(["y", "z"], batched=False, failed=failed) == [("ok", "y"), ("ok", "z")]  # the other place works


def test_a_stream_spreads_calls_without_an_instance_over_the_workers(fake_pool):
    """Calls added one by one, as episodes end their turns, go to the least loaded worker: before, the first worker
    took the whole queue, and CPU-bound calls ran one after another while the other worker idled."""
    pool, _ = fake_pool
    job = pool.stream(failed)
    try:
        for item in "abcd":
            job.add([item])
            job._dispatch()
        assert [len(w.in_flight) for w in pool.live] == [2, 2]
        while not job.finished:
            job.step(5.0)
        assert job.outcomes == [("ok", item) for item in "abcd"]
    finally:
        job.close()


def tools_yaml(folder: Path, classes: dict[str, str]) -> Path:
    """A tools YAML of `classes` (tool name -> class path), with TOOLS beside it as `flaky_tools.py`."""
    (folder / "flaky_tools.py").write_text(TOOLS)
    entries = [
        {
            "class_name": path,
            "config": {"type": "native"},
            "tool_schema": {"type": "function", "function": {"name": name, "description": name}},
        }
        for name, path in classes.items()
    ]
    path = folder / "tools.yaml"
    path.write_text(json.dumps({"tools": entries}))  # JSON is YAML
    return path


FLAKY = {"ok": "flaky_tools.Ok", "raises": "flaky_tools.Raises", "exits": "flaky_tools.Exits"}


def toolbox(folder: Path, rate: float) -> ToolBox:
    return ToolBox(ToolSettings(str(tools_yaml(folder, FLAKY)), None, 1, 5.0, 2048, 64, max_failure_rate=rate))


@pytest.fixture(scope="module")
def flaky_box(tmp_path_factory):
    box = toolbox(tmp_path_factory.mktemp("flaky"), 0.1)
    yield box
    box.close()


def calls(*names: str) -> list[ToolCall]:
    return [ToolCall(name, "{}", {}) for name in names]


def test_a_tool_that_fails_every_call_stops_the_run_after_its_first_calls_naming_it(flaky_box):
    flaky_box.begin_batch()
    with pytest.raises(ToolError) as stop:
        flaky_box.run(calls(*["raises"] * 200))
    text = str(stop.value)
    # at least eight calls, all failed: the rest of the batch is not run (a worker runs a share of its calls at once,
    # so the first answers are a share's, not exactly eight)
    failed = re.match(r"(\d+) of the \1 tool calls of this batch failed, every one of them", text)
    assert failed and 8 <= int(failed[1]) < 200, text
    assert "episode.max_tool_failure_rate=0.1" in text and "tool 'raises'" in text and "tools.yaml" in text
    assert "first failure (exception)" in text and "RuntimeError: the service is down" in text


def test_more_failed_calls_than_the_rate_stop_the_run_at_the_end_of_the_batch(flaky_box):
    flaky_box.begin_batch()
    results, _ = flaky_box.run(calls(*["ok"] * 9, "raises", "nope"))  # an unknown tool is the model's mistake
    assert [r.failure for r in results[-2:]] == ["exception", "unknown_tool"]
    flaky_box.end_batch()  # 1 of 10: not more than 0.1
    flaky_box.begin_batch()
    flaky_box.run(calls("ok", "ok", "raises"))  # not every call failed: the batch goes on
    with pytest.raises(ToolError, match="^1 of the 3 tool calls of this batch failed, more than the rate allowed"):
        flaky_box.end_batch()


def test_a_worker_that_cannot_be_replaced_fails_the_calls_not_the_batch(tmp_path):
    box = toolbox(tmp_path, 0.1)
    try:
        (tmp_path / "flaky_tools.py").unlink()  # the worker's replacement cannot load its tools
        box.begin_batch()
        results, _ = box.run(calls("exits"))
        assert results[0].failure == "crash"
        results, _ = box.run(calls("ok", "ok"))  # before, ToolError came out of here and failed the batch
        assert [r.failure for r in results] == ["unavailable"] * 2
        assert "no module 'flaky_tools'" in results[0].text
        # past the rate, the run stops, naming the tool and why its worker could not start
        with pytest.raises(ToolError, match="(?s)^3 of the 3 tool calls.*2 of them of tool 'ok'.*no module 'flaky"):
            box.end_batch()
    finally:
        box.close()


def test_a_tools_yaml_naming_a_missing_module_is_refused_before_the_model_is_resolved(tmp_path, monkeypatch):
    from rl_tpu.controller import run

    def resolve(*args):
        raise AssertionError("the model was resolved before the tools were checked")

    monkeypatch.setattr(run, "resolve_model_path", resolve)
    path = tools_yaml(tmp_path, {"search": "no_such_package.search.SearchTool"})
    cfg = compose_run("episode.enable=true", f"episode.tools_config_file={path}")
    with pytest.raises(ToolError) as refused:
        run.run(cfg, tmp_path / "run")
    assert (
        f"{path}: tool 'search' names class_name='no_such_package.search.SearchTool', but no module "
        "'no_such_package.search' is on the tool workers' import path"
    ) in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_the_tool_failure_rate_is_a_fraction():
    with pytest.raises(ValueError, match=r"episode.max_tool_failure_rate=1.5 must be in \[0, 1\]"):
        compose_run("episode.max_tool_failure_rate=1.5")


def test_the_release_of_an_instance_lost_with_its_worker_fails_as_lost():
    worker = ToolWorker({}, {})  # a replaced worker: it holds no instance
    lost = asyncio.run(contained(_release(worker, ToolRelease("game", "batch/0/0", held=True))))
    assert lost[:2] == ("fail", "lost") and "its reward is lost" in lost[2]  # before: ("ok", "", 0.0)
    never_made = asyncio.run(contained(_release(worker, ToolRelease("game", "batch/0/1", held=False))))
    assert never_made == ("ok", "", 0.0)


class Characters:
    """A stand-in parser and renderer over character ids: a turn `call:NAME` calls NAME with no arguments."""

    stop_token_ids: list[int] = []

    def parse(self, ids: list[int]) -> tuple[list[tuple[str, str]], int]:
        text = "".join(map(chr, ids))
        return ([(text.removeprefix("call:"), "{}")] if text.startswith("call:") else []), 0

    def answer_length(self, ids: list[int]) -> int:
        return 0 if "".join(map(chr, ids)).startswith("call:") else len(ids)

    def environment_ids(self, runtime_ids: list[int], calls: list, results: list[str]) -> EnvironmentIds:
        return EnvironmentIds([ord(c) for c in "|".join(results)])


class ScriptedTools:
    """A stand-in ToolBox: `game` keeps an instance per episode; each call gets the next scripted result."""

    per_episode = frozenset({"game"})

    def __init__(self, results: list[ToolResult], release: ToolResult):
        self.results, self.release, self.sent = list(results), release, []

    def begin_batch(self) -> None: ...

    def end_batch(self) -> None: ...

    def run(self, calls: list[ToolCall], ends: list[ToolRelease] = ()) -> tuple[list[ToolResult], float]:
        self.sent += [*calls, *ends]
        return [self.results.pop(0) for _ in calls] + [self.release for _ in ends], 0.0

    def stream(self) -> RunStream:  # episodes that advance on their own
        return RunStream(self.run)


def scripted_engine(turns: list[str]):
    def generate(requests) -> list[TurnOutput]:
        turn = turns.pop(0)
        return [TurnOutput([ord(c) for c in turn], [-0.5] * len(turn), "stop", 1) for _ in requests]

    return BatchEngine(generate)


def episode(tools: ScriptedTools, turns: list[str], max_tokens: int = 200) -> Rollout:
    limits = EpisodeLimits(max_turns=4, max_tokens=max_tokens, turn_tokens=50, max_model_len=512)
    runner = EpisodeRunner(limits, Characters(), tools, Characters())
    [rollout] = runner.run([[1, 2]], 1, [0], [{}], scripted_engine(turns))
    return rollout


def test_an_episode_whose_instance_was_lost_is_marked():
    lost = ToolResult("Error executing tool 'game': its state is lost", 0.0, "lost")
    tools = ScriptedTools([ToolResult("3 left", 0.25), lost], release=lost)
    rollout = episode(tools, ["call:game", "call:game", "done"])
    assert rollout.episode.lost_instance == "game"  # before: no mark, trained with its tool reward 0.25
    assert tools.sent[-1] == ToolRelease("game", rollout_key(tools), held=True)  # a call of it had succeeded
    # an instance whose calls never succeeded was never held: its release may find nothing, and that is no loss
    tools = ScriptedTools([ToolResult("Error", 0.0, "timeout")], release=ToolResult("", 0.0))
    rollout = episode(tools, ["call:game", "done"])
    assert rollout.episode.lost_instance is None and tools.sent[-1].held is False


def rollout_key(tools: ScriptedTools) -> str:
    return tools.sent[0].episode


def test_a_tool_result_that_does_not_fit_is_counted_and_logged(caplog):
    tools = ScriptedTools([ToolResult("x" * 500, 0.0)], release=ToolResult("", 0.0))
    with caplog.at_level(logging.WARNING, logger="rl_tpu.episodes.loop"):
        rollout = episode(tools, ["call:ok", "done"], max_tokens=100)
    assert rollout.episode.truncated == "max_tokens" and rollout.episode.dropped_result_tokens == 500
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("1 of 1 episodes ended (truncated max_tokens) because a tool result of up to 500 tokens")
    assert "episode.max_tokens" in line


def test_an_episode_that_lost_its_instance_is_out_of_the_loss_and_of_its_groups_statistics():
    from rl_tpu.algorithms import core as algorithms
    from rl_tpu.algorithms import outcomes
    from rl_tpu.algorithms.learning_signal import counted_advantages
    from rl_tpu.controller.rollouts import GradedBatch, episode_metrics
    from rl_tpu.grader.grader import Grades

    def rollout(group: int, lost: str | None = None, dropped: int = 0) -> Rollout:
        stats = EpisodeStats(1, lost_instance=lost, dropped_result_tokens=dropped)
        return Rollout([1], [2, 3], [0.0, 0.0], 0, "stop", group, [1, 1], stats)

    rollouts = [rollout(0), rollout(0), rollout(0, lost="game"), rollout(1), rollout(1, dropped=9)]
    assert [r.outcome for r in rollouts] == ["scored", "scored", "lost", "scored", "scored"]
    cfg = compose_run().algorithm
    counts = outcomes.counted(rollouts, cfg.outcomes)
    assert outcomes.loss_mask(rollouts, counts, overlong_filter=False) == [True, True, False, True, True]
    assert outcomes.loss_mask(rollouts[:2], counts[:2], overlong_filter=False) is None  # nothing left out
    scores = [1.0, 0.0, 0.0, 1.0, 0.0]
    graded = GradedBatch([], rollouts, Grades(scores, {}, {}))
    advantages = counted_advantages(graded, counts, cfg, None, None)
    without = algorithms.advantages([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [2] * 4, cfg)
    # the group's other episodes get what they would without the lost one (its reward 0 is not what it earned)
    kept = advantages[:2] + advantages[3:]
    assert [a for row in kept for a in row] == pytest.approx([a for row in without for a in row])
    assert advantages[2] == [0.0, 0.0]
    metrics = episode_metrics(rollouts, "episode")
    assert (metrics["episode/lost_instances"], metrics["episode/tool_results_dropped"]) == (1.0, 1.0)
