"""Episodes: the turn loop's ids, masks and logprobs, its endings (no call, max_turns, max_tokens), malformed calls,
and tools that hang, raise or return garbage, each contained and counted. The engine here is a scripted stand-in
(the loop is engine-agnostic); the tools, their worker processes, verl's parser and the tokenizer are real."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import compose_run
from turn_engines import BatchEngine

from rl_tpu.episodes.loop import EpisodeLimits, EpisodeRunner, ToolCallParser, TurnOutput, TurnRequest
from rl_tpu.episodes.render import ChatRenderer, PlainRenderer
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease, truncate
from rl_tpu.episodes.tools import ToolBox, ToolError, ToolSettings

REPO = Path(__file__).resolve().parents[2]
CALC_FUNCTION = str(REPO / "examples/tools/calc_function.py")
RESPONSE_FORMAT = "\n<tool_response>\n{result}\n</tool_response>\n"

MISBEHAVING_TOOLS = """
import os
import time
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Hangs(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(3600)

class Raises(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")

class ReturnsNumber(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return 42

class ReturnsNonStringText(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse.model_construct(text=["not", "a", "string"]), 0.0, {}

class Rewards(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="ok"), 0.25, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.5

class Counter(BaseTool):  # lifetime: episode; says which process holds it and how often it was called
    counts = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id, _ = await super().create(instance_id)
        self.counts[instance_id] = kwargs["create_kwargs"].get("start", 0)
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("exit"):
            os._exit(3)
        self.counts[instance_id] += 1
        return ToolResponse(text=f"{os.getpid()} count {self.counts[instance_id]}"), 0.125, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.5

    async def release(self, instance_id, **kwargs):
        del self.counts[instance_id]
"""
LIFETIMES = {"Counter": "episode"}


def tools_yaml(folder: Path) -> Path:
    (folder / "misbehaving.py").write_text(MISBEHAVING_TOOLS)
    entries = []
    for name in ("Hangs", "Raises", "ReturnsNumber", "ReturnsNonStringText", "Rewards", "Counter"):
        schema = {"type": "function", "function": {"name": name.lower(), "description": name}}
        config = {"type": "native", "lifetime": LIFETIMES.get(name, "call")}
        entries.append({"class_name": f"misbehaving.{name}", "config": config, "tool_schema": schema})
    path = folder / "tools.yaml"
    path.write_text(json.dumps({"tools": entries}))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def toolbox(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    box = ToolBox(ToolSettings(str(tools_yaml(folder)), CALC_FUNCTION, 2, 3.0, 2048, 64))
    yield box
    box.close()


def test_tools_that_hang_raise_or_return_garbage_fail_that_call_only(toolbox):
    calls = [ToolCall(name, "{}", {}) for name in ("hangs", "raises", "returnsnumber", "returnsnonstringtext")]
    calls.append(ToolCall("calc", json.dumps({"expression": "37*48"}), {}))
    warm = [ToolCall("calc", json.dumps({"expression": "1+1"}), {}) for _ in range(2)]
    assert [r.text for r in toolbox.run(warm)[0]] == ["2", "2"]  # both workers up: their start-up is not timed
    start = time.monotonic()
    results, _ = toolbox.run(calls)
    # the hung call (an hour's sleep) waited for its 3 s deadline, not forever; the bound leaves room for the
    # replacement worker's start on a loaded host (9.9 s seen with four processes on two cores)
    assert time.monotonic() - start < 30
    assert [r.failure for r in results] == ["timeout", "exception", "invalid", "invalid", None]
    assert "the tool broke" in results[1].text and results[1].text.startswith("Error executing tool 'raises'")
    assert results[4].text == "1776"
    # the pool replaced the hung worker and goes on
    again, _ = toolbox.run([ToolCall("calc", json.dumps({"expression": "(2+3)*4"}), {})])
    assert again[0].text == "20" and again[0].failure is None


def test_a_calls_reward_is_executes_step_reward_plus_calc_reward_and_bad_calls_are_named(toolbox):
    results, _ = toolbox.run(
        [ToolCall("rewards", "{}", {}), ToolCall("missing", "{}", {}), ToolCall("calc", "not json", {})]
    )
    assert results[0].reward == pytest.approx(0.75) and results[0].failure is None
    assert results[1].failure == "unknown_tool" and "Available tools" in results[1].text
    assert results[2].failure == "bad_arguments" and "Invalid JSON" in results[2].text


def test_a_per_episode_tool_keeps_its_instance_in_one_worker_until_released_and_a_lost_one_is_named(toolbox):
    assert toolbox.per_episode == {"counter"}
    episodes = [f"batch/{group}/0" for group in range(6)]
    first, _ = toolbox.run([ToolCall("counter", "{}", {"start": 10}, key) for key in episodes])
    second, _ = toolbox.run([ToolCall("counter", "{}", {}, key, may_create=False) for key in episodes])
    for one, two in zip(first, second):
        pid, _, count = one.text.partition(" count ")
        assert (count, one.reward, one.failure) == ("11", 0.125, None)  # calc_reward waits for the release
        assert two.text == f"{pid} count 12"  # the same instance, in the same worker
    assert len({r.text.split()[0] for r in first}) == 2  # the episodes are spread over both workers
    ends, _ = toolbox.run([], [ToolRelease("counter", key) for key in episodes])
    assert [(r.reward, r.failure) for r in ends] == [(0.5, None)] * len(episodes)  # calc_reward, once each
    # released: its instance is gone, and a call that may not make one says so; so does one whose worker died
    crashed, _ = toolbox.run(
        [ToolCall("counter", "{}", {}, episodes[0], may_create=False), ToolCall("counter", '{"exit": true}', {}, "b")]
    )
    assert crashed[0].failure == "lost" and "its state is lost" in crashed[0].text
    assert crashed[1].failure == "crash"
    [after], _ = toolbox.run([ToolCall("counter", "{}", {}, "b", may_create=False)])
    assert after.failure == "lost"


def test_a_tools_lifetime_is_call_or_episode(tmp_path):
    yaml = tmp_path / "tools.yaml"
    entry = {"class_name": "verl.tools.base_tool.BaseTool", "config": {"type": "native", "lifetime": "run"}}
    schema = {"type": "function", "function": {"name": "f", "description": "f"}}
    yaml.write_text(json.dumps({"tools": [{**entry, "tool_schema": schema}]}))
    with pytest.raises(ToolError, match="tool 'f': config lifetime='run'; allowed values are call, episode"):
        ToolBox(ToolSettings(str(yaml), None, 1, 3.0, 2048, 64))


def test_long_results_are_cut_with_verls_markers():
    assert truncate("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate("abcdefgh", 4, "left") == "(truncated)...efgh"
    assert truncate("abcdefgh", 4, "right") == "abcd...(truncated)"
    assert truncate("abc", 4, "middle") == "abc"


def call_text(expression: str, name: str = "calc") -> str:
    return f' <tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


class ScriptedEngine(BatchEngine):
    """Answers each turn from a script keyed by the episode's turn number; records what it was asked. Its weight
    version falls by one at each step (so an episode's oldest turn shows)."""

    def __init__(self, tokenizer, script: list[str], version: int = 3):
        super().__init__(self._answer)
        self.tokenizer, self.script, self.version = tokenizer, script, version

    def _answer(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        outputs = []
        for request in requests:
            text = self.script[min(request.turn, len(self.script) - 1)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: request.max_tokens]
            finish = "length" if len(ids) == request.max_tokens else "stop"
            outputs.append(TurnOutput(ids, [-0.5] * len(ids), finish, self.version - len(self.requests) + 1))
        return outputs


def runner(tokenizer, toolbox, max_turns=4, max_tokens=200) -> EpisodeRunner:
    limits = EpisodeLimits(max_turns, max_tokens, turn_tokens=80, max_model_len=512)
    return EpisodeRunner(
        limits, ToolCallParser("hermes", tokenizer), toolbox, PlainRenderer(tokenizer, RESPONSE_FORMAT)
    )


def test_an_episode_is_the_models_ids_then_the_tools_ids_then_the_answer(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [call_text("37*48"), " 1776"])
    prompt = tokenizer.encode("Q: What is 37 * 48? A:")
    [rollout] = runner(tokenizer, toolbox).run([prompt], 1, [7], [{}], engine)
    turn1 = tokenizer.encode(call_text("37*48"), add_special_tokens=False)
    env = tokenizer.encode(RESPONSE_FORMAT.format(result="1776"), add_special_tokens=False)
    turn2 = tokenizer.encode(" 1776", add_special_tokens=False)
    assert rollout.completion_ids == turn1 + env + turn2
    assert rollout.model_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
    assert rollout.logprobs == [-0.5] * len(turn1) + [0.0] * len(env) + [-0.5] * len(turn2)
    # the second turn saw exactly the ids before it: no decode and re-encode of the first
    assert engine.requests[1][0].ids == prompt + turn1 + env
    assert rollout.weight_version == 2  # the oldest weights of its turns
    stats = rollout.episode
    assert (stats.turns, stats.tool_calls, stats.env_tokens, stats.truncated) == (2, {"calc": 1}, len(env), None)
    assert rollout.finish_reason == "stop"


def test_an_episode_that_keeps_calling_ends_at_max_turns_without_running_the_last_calls(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [call_text("1+1")])
    [rollout] = runner(tokenizer, toolbox, max_turns=3, max_tokens=400).run(
        [tokenizer.encode("Q:")], 1, [0], [{}], engine
    )
    assert rollout.episode.turns == 3 and rollout.episode.tool_calls == {"calc": 2}
    assert (rollout.episode.truncated, rollout.finish_reason) == ("max_turns", "length")
    assert rollout.model_mask[-1] == 1  # it ends on the model's tokens


def test_an_episode_ends_at_max_tokens_and_never_on_a_tool_result(tokenizer, toolbox):
    turn = len(tokenizer.encode(call_text("1+1"), add_special_tokens=False))
    env = len(tokenizer.encode(RESPONSE_FORMAT.format(result="2"), add_special_tokens=False))
    engine = ScriptedEngine(tokenizer, [call_text("1+1")])
    # room for two turns and one result, not for a second result and a third turn
    limit = 2 * turn + env + 1
    [rollout] = runner(tokenizer, toolbox, max_tokens=limit).run([tokenizer.encode("Q:")], 1, [0], [{}], engine)
    assert rollout.episode.truncated == "max_tokens" and rollout.finish_reason == "length"
    assert len(rollout.completion_ids) <= limit and rollout.model_mask[-1] == 1
    # a turn's budget is what is left
    assert [r[0].max_tokens for r in engine.requests] == [80, limit - turn - env]


def test_malformed_and_unknown_calls_are_counted_and_the_model_reads_why(tokenizer, toolbox):
    broken = ' <tool_call>{"name": "calc", "arguments": </tool_call>'
    engine = ScriptedEngine(tokenizer, [broken])
    [rollout] = runner(tokenizer, toolbox).run([tokenizer.encode("Q:")], 1, [0], [{}], engine)
    assert rollout.episode.malformed_calls == 1 and rollout.episode.turns == 1  # no call parsed: the episode ends
    engine = ScriptedEngine(tokenizer, [call_text("1", name="nope"), " 2"])
    [rollout] = runner(tokenizer, toolbox, max_tokens=400).run([tokenizer.encode("Q:")], 1, [0], [{}], engine)
    assert rollout.episode.malformed_calls == 1 and rollout.episode.tool_calls == {}
    assert "Unknown function 'nope'" in tokenizer.decode(
        [t for t, m in zip(rollout.completion_ids, rollout.model_mask) if not m]
    )


def test_samples_of_a_prompt_are_separate_episodes_in_prompt_order_with_their_own_seeds(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [call_text("2*3"), " 6"])
    prompts = [tokenizer.encode("Q: a"), tokenizer.encode("Q: b")]
    rollouts = runner(tokenizer, toolbox).run(prompts, 2, [11, 12], [{}, {}], engine)
    assert [r.group for r in rollouts] == [0, 0, 1, 1]
    assert [r.prompt_ids for r in rollouts] == [prompts[0]] * 2 + [prompts[1]] * 2
    seeds = [r.seed for r in engine.requests[0]]
    assert len(set(seeds)) == 4 and [r.seed for r in engine.requests[1]] != seeds  # per episode and per turn


def test_an_episode_calls_its_own_instance_of_a_per_episode_tool_which_ends_with_it(tokenizer, toolbox):
    engine = ScriptedEngine(tokenizer, [call_text("x", name="counter"), call_text("x", name="counter"), " done"])
    prompts = [tokenizer.encode("Q: a"), tokenizer.encode("Q: b")]
    kwargs = [{"counter": {"create_kwargs": {"start": 100 * group}}} for group in range(2)]
    rollouts = runner(tokenizer, toolbox, max_tokens=400).run(prompts, 2, [1, 2], kwargs, engine)
    for rollout in rollouts:
        read = tokenizer.decode([t for t, m in zip(rollout.completion_ids, rollout.model_mask) if not m])
        start = 100 * rollout.group
        assert f"count {start + 1}" in read and f"count {start + 2}" in read  # one instance, its own state
        assert rollout.episode.tool_calls == {"counter": 2} and not rollout.episode.tool_failures
        assert rollout.episode.tool_reward == pytest.approx(2 * 0.125 + 0.5)  # each step, then calc_reward once
    # every instance was released at its episode's end
    [stale], _ = toolbox.run([ToolCall("counter", "{}", {}, "anything", may_create=False)])
    assert stale.failure == "lost"


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_chat_renderer_appends_what_the_template_renders_after_the_models_turn(tokenizer):
    chat = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    chat.chat_template = CHATML
    renderer = ChatRenderer(chat, model_type="llama", tools=None)  # the default builder: no boundary fix-ups
    runtime = chat.encode("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n" + call_text("1+1") + "<|im_end|>\n")
    ids = renderer.environment_ids(runtime, [("calc", '{"expression": "1+1"}')], ["2"]).ids
    assert (
        chat.decode(ids) == "<|im_start|>tool\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_that_cannot_load_stop_the_run_before_ray_naming_the_file(tmp_path):
    from rl_tpu.controller.run import tool_schemas
    from rl_tpu.episodes.tools import ToolError

    broken = tmp_path / "broken_tools.py"
    broken.write_text("import a_module_that_does_not_exist\n")
    cfg = compose_run("episode.enable=true", f"episode.function_tool_path={broken}")
    with pytest.raises(ToolError, match="(?s)broken_tools.py.*No module named 'a_module_that_does_not_exist'"):
        tool_schemas(cfg)
    cfg = compose_run("episode.enable=true", f"episode.function_tool_path={CALC_FUNCTION}")
    assert [s["function"]["name"] for s in tool_schemas(cfg)] == ["calc"]


@pytest.mark.parametrize("source, expected", [("plugin", [1.0, 0.0]), ("tools", [0.5, 0.25]), ("sum", [1.5, 0.25])])
def test_an_episodes_reward_is_the_plugins_the_tools_or_their_sum(source, expected):
    from rl_tpu.algorithms.learning_signal import with_tool_rewards
    from rl_tpu.grader.grader import Grades
    from rl_tpu.records import EpisodeStats, Rollout

    rollouts = [Rollout([1], [2], [0.0], 0, "stop", episode=EpisodeStats(1, tool_reward=r)) for r in (0.5, 0.25)]
    grades = with_tool_rewards(Grades([1.0, 0.0], {"arithmetic": [1.0, 0.0]}, {}), rollouts, source)
    assert grades.scores == expected
    assert grades.components["arithmetic"] == [1.0, 0.0]  # eval/accuracy stays the plugin's
