"""Inside a tool worker: calls run at once, each with its own deadline (one that awaits, blocks the event loop or is
stuck in a thread), a per-episode instance's calls in order, results cut before they cross the pipe, and Ray
refused. The tools, verl and the worker processes are real."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.episodes.tool_worker import RAY_REFUSAL, ToolCall, ToolRelease, refuse_ray
from rl_tpu.episodes.tools import ToolBox, ToolError, ToolSettings

TOOLS = """
import asyncio
import os
import time
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Waits(BaseTool):  # an I/O-bound tool: a server that takes `seconds` to answer
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(parameters.get("seconds", 1.0))
        return ToolResponse(text=str(os.getpid())), 0.0, {}

class Blocks(BaseTool):  # a synchronous client inside an async tool: it holds the worker's event loop
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(3600)

class Exits(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        os._exit(3)

class Huge(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="x" * 100_000_000), 0.0, {}

class Counter(BaseTool):  # lifetime: episode; its calls must see each other's counts in order
    counts = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, _ = await super().create(instance_id)
        self.counts[instance_id] = []
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(parameters.get("seconds", 0.0))
        self.counts[instance_id].append(parameters["n"])
        return ToolResponse(text=f"{os.getpid()} {self.counts[instance_id]}"), 0.0, {}
"""
FUNCTIONS = '''
import time

from verl.tools.function_tool import function_tool


@function_tool
def stuck(seconds: float) -> str:
    """Sleeps in the thread verl runs a synchronous function tool in.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"
'''
USES_RAY = """
import ray
from verl.tools.base_tool import BaseTool

@ray.remote(num_cpus=0)
class Limiter:  # verl's SandboxFusionTool's global rate limiter, in short
    def acquire(self):
        return True

class UsesRay(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.limiter = Limiter.options(name="rate-limiter", get_if_exists=True).remote()
"""


def tools_yaml(folder: Path, module: str, source: str, classes: dict[str, str]) -> str:
    """A verl tools YAML of `classes` (name -> lifetime) from `source`, written as `module` beside it."""
    (folder / f"{module}.py").write_text(source)
    entries = [
        {
            "class_name": f"{module}.{name}",
            "config": {"type": "native", "lifetime": lifetime},
            "tool_schema": {"type": "function", "function": {"name": name.lower(), "description": name}},
        }
        for name, lifetime in classes.items()
    ]
    (folder / "tools.yaml").write_text(json.dumps({"tools": entries}))  # JSON is YAML
    return str(folder / "tools.yaml")


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    """Two workers, 32 calls at once in each (the defaults), a 3 s deadline, 150 MB each beyond their tools."""
    folder = tmp_path_factory.mktemp("tools")
    classes = {"Waits": "call", "Blocks": "call", "Exits": "call", "Huge": "call", "Counter": "episode"}
    (folder / "functions.py").write_text(FUNCTIONS)
    yaml = tools_yaml(folder, "slow_tools", TOOLS, classes)
    box = ToolBox(ToolSettings(yaml, str(folder / "functions.py"), 2, 3.0, 150, 64))
    yield box
    box.close()


def waits(seconds: float = 1.0) -> ToolCall:
    return ToolCall("waits", json.dumps({"seconds": seconds}), {})


def count(n: int, episode: str, seconds: float = 0.0) -> ToolCall:
    return ToolCall("counter", json.dumps({"n": n, "seconds": seconds}), {}, episode)


def test_a_workers_calls_that_await_run_at_once(toolbox):
    assert {r.failure for r in toolbox.run([waits(0.0)] * 4)[0]} == {None}  # both workers up: not timed
    start = time.monotonic()
    results, _ = toolbox.run([waits(1.0)] * 64)
    elapsed = time.monotonic() - start
    # one at a time per worker this took 32 s; at once, 1 s and the pipe (the bound is for a loaded host)
    assert elapsed < 8, f"64 calls of 1 s took {elapsed:.1f} s"
    assert [r.failure for r in results] == [None] * 64
    assert len({r.text for r in results}) == 2  # spread over both workers


def test_a_call_that_blocks_its_worker_fails_alone_and_the_worker_goes_on(toolbox):
    [opened], _ = toolbox.run([count(1, "kept")])
    pid = opened.text.split()[0]
    # the episode's worker also gets the blocking call, and each worker a share of the others
    calls = [ToolCall("blocks", "{}", {}), count(2, "kept"), *[waits(0.5)] * 6, ToolCall("blocks", "{}", {})]
    start = time.monotonic()
    results, _ = toolbox.run(calls)
    assert time.monotonic() - start < 3 + 5 + 10  # the deadline, the pool's grace, a loaded host
    assert [r.failure for r in results] == ["timeout", None, *[None] * 6, "timeout"]
    assert "no answer within 3 s" in results[0].text
    assert results[1].text == f"{pid} [1, 2]"
    # interrupted, not killed: the worker that held the episode's instance still holds it
    [after], _ = toolbox.run([count(3, "kept")])
    assert after.text == f"{pid} [1, 2, 3]"
    toolbox.run([], [ToolRelease("counter", "kept")])


def test_a_call_stuck_in_a_thread_fails_alone_and_its_worker_is_replaced(toolbox):
    stuck = ToolCall("stuck", json.dumps({"seconds": 3600}), {})
    results, _ = toolbox.run([stuck, *[waits(0.2)] * 7])
    assert [r.failure for r in results] == ["timeout", *[None] * 7]
    after, _ = toolbox.run([ToolCall("stuck", json.dumps({"seconds": 0}), {}), waits(0.0), waits(0.0)])
    assert [(r.failure, r.text) for r in after][0] == (None, "woke")
    assert {r.failure for r in after} == {None}


def test_a_worker_that_dies_fails_the_calls_it_was_running_and_no_other(toolbox):
    # the first worker gets the first two calls, the second the other two: the dead worker's second call died with
    # it (it is not run again; before, it was, and a crashing call after it crashed each replacement in turn)
    results, _ = toolbox.run([ToolCall("exits", "{}", {}), waits(1.0), waits(1.0), waits(1.0)])
    assert [r.failure for r in results] == ["crash", "crash", None, None]
    assert "the worker died (exit code 3)" in results[1].text


def test_an_episodes_calls_keep_their_order_and_a_timed_out_instance_is_dropped(toolbox):
    # the first call is the slowest: the second waits for it, as a turn's calls of one episode must
    first, _ = toolbox.run([count(1, "e", seconds=0.5), count(2, "e"), count(1, "f")])
    assert [r.text.split(" ", 1)[1] for r in first] == ["[1]", "[1, 2]", "[1]"]
    # a call past its deadline leaves the instance in an unknown state: dropped, the episode's next call is lost
    late, _ = toolbox.run([count(3, "e", seconds=3600)])
    assert late[0].failure == "timeout"
    [after], _ = toolbox.run([ToolCall("counter", json.dumps({"n": 4}), {}, "e", may_create=False)])
    assert after.failure == "lost"
    toolbox.run([], [ToolRelease("counter", "e"), ToolRelease("counter", "f")])


def test_a_long_result_is_cut_in_its_worker_before_the_pipe(toolbox):
    """100 MB of text under a 150 MB memory limit: sent whole, its pickled copy would not fit (the worker died)."""
    [result], _ = toolbox.run([ToolCall("huge", "{}", {})])
    assert result.failure is None
    assert result.text == "x" * 32 + "...(truncated)..." + "x" * 32  # episode.max_tool_response_chars=64


def test_a_tool_that_uses_ray_is_refused_naming_it_and_why(tmp_path):
    yaml = tools_yaml(tmp_path, "ray_tool", USES_RAY, {"UsesRay": "call"})
    with pytest.raises(ToolError, match="ray_tool.UsesRay uses Ray in its tool worker: a tool may not use Ray"):
        ToolBox(ToolSettings(yaml, None, 1, 3.0, 2048, 64))


def test_a_tool_that_started_ray_itself_is_refused_and_its_cluster_shut_down(monkeypatch):
    class Ray:  # what a tool's own ray.init() leaves in the worker (a real start takes ~30 s on a loaded host)
        initialized = True

        def is_initialized(self) -> bool:
            return self.initialized

        def shutdown(self) -> None:
            self.initialized = False

    ray = Ray()
    monkeypatch.setenv("RAY_ENABLE_AUTO_CONNECT", "1")
    monkeypatch.setitem(sys.modules, "ray", ray)
    with pytest.raises(RuntimeError, match="a tool started Ray"):
        refuse_ray()
    assert not ray.initialized
    assert RAY_REFUSAL.startswith("a tool may not use Ray")


def test_calls_per_worker_is_at_least_one():
    with pytest.raises(ValueError, match="episode.tool_calls_per_worker=0 must be >= 1"):
        EpisodeConfig(tool_calls_per_worker=0)
