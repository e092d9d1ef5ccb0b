"""What an episode's outcome reward reads: the model's final turn before any tool call, never a tool's text; a
plugin also gets the whole episode; the overlong penalty counts the model's tokens. Episodes come from the real turn
loop (verl's parser, the tiny tokenizer, a tool in its worker) driven by a scripted engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import compose_run
from test_episodes import RESPONSE_FORMAT, ScriptedEngine

from rewards import BUILTIN_REWARDS
from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.config.reasoning_gym import ReasoningGymConfig
from rl_tpu.controller import rollouts as controller
from rl_tpu.controller.phases import Phases
from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.data.datasets import Example, read_rows
from rl_tpu.data.reasoning_gym import ensure_reasoning_gym_dataset
from rl_tpu.episodes.loop import EpisodeLimits, EpisodeRunner, ToolCallParser
from rl_tpu.episodes.render import PlainRenderer
from rl_tpu.episodes.tools import ToolBox, ToolSettings
from rl_tpu.grader.grader import Grades
from rl_tpu.records import Rollout

ECHO_TOOL = '''
from verl.tools.function_tool import function_tool


@function_tool("echo")
def echo(text: str) -> str:
    """Say the text back.

    Args:
        text: what to say
    """
    return text
'''


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def echo_box(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "echo_tool.py"
    path.write_text(ECHO_TOOL)
    box = ToolBox(ToolSettings(None, str(path), 1, 10.0, 2048, 1024))
    yield box
    box.close()


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    """A reasoning-gym row, so that its scorer runs too; its answer is an integer every built-in can read."""
    config = ReasoningGymConfig(task="products", config={"max_digits": 2}, size=4, system_prompt=None)
    train, _ = ensure_reasoning_gym_dataset(tmp_path_factory.mktemp("rg"), config, num_eval=2, seed=3)
    return read_rows(train)[0]


def answer_in_every_form(truth: str) -> str:
    """The right answer as each built-in reward reads one (arithmetic's first integer comes first)."""
    return f"<answer>{truth}</answer> \\boxed{{{truth}}} #### {truth}"


def echo_call(text: str) -> str:
    return f" <tool_call>{json.dumps({'name': 'echo', 'arguments': {'text': text}})}</tool_call>"


def episode(tokenizer, box, script: list[str], max_turns: int = 4, max_tokens: int = 400) -> Rollout:
    limits = EpisodeLimits(max_turns, max_tokens, turn_tokens=200, max_model_len=1024)
    runner = EpisodeRunner(limits, ToolCallParser("hermes", tokenizer), box, PlainRenderer(tokenizer, RESPONSE_FORMAT))
    [rollout] = runner.run([tokenizer.encode("Q:")], 1, [0], [{}], ScriptedEngine(tokenizer, script))
    return rollout


class CapturingGrader:
    """Records the samples `grade` builds: exactly the arguments each reward function is called with."""

    def __init__(self):
        self.samples = []

    def submit(self, samples):
        self.samples += samples
        grades = Grades([0.0] * len(samples), {"arithmetic": [0.0] * len(samples)}, {})
        return type("Done", (), {"result": lambda _: grades})()


def graded_sample(rollout: Rollout, row: dict, tokenizer):
    example = Example([0], row["data_source"], row["reward_model"]["ground_truth"], row["extra_info"])
    grader = CapturingGrader()
    controller.grade([rollout], [example], tokenizer, grader)
    return grader.samples[0]


def builtin_scores(sample) -> dict[str, float]:
    import importlib

    return {
        name: float(
            importlib.import_module(f"rewards.{name}").compute_score(
                sample.data_source, sample.solution_str, sample.ground_truth, sample.extra_info
            )
        )
        for name in BUILTIN_REWARDS
    }


def scripts(tokenizer, truth: str) -> dict[str, tuple[list[str], dict]]:
    """Episodes that never answer, each with the answer in a tool's text or in a call: (script, limits)."""
    call = echo_call(answer_in_every_form(truth))
    cut = len(tokenizer.encode(call, add_special_tokens=False)) - 4  # inside the call's closing `"}}</tool_call>`
    return {
        "tool result, then no answer": ([call, "<|endoftext|>"], {}),
        "a call left unrun at max_turns": ([call], {"max_turns": 1}),
        "a call cut at max_tokens": ([call], {"max_tokens": cut}),
    }


@pytest.mark.parametrize(
    "kind", ["tool result, then no answer", "a call left unrun at max_turns", "a call cut at max_tokens"]
)
def test_an_episode_that_never_answers_scores_zero_under_every_builtin_reward(kind, tokenizer, echo_box, row):
    truth = row["reward_model"]["ground_truth"]
    script, limits = scripts(tokenizer, truth)[kind]
    rollout = episode(tokenizer, echo_box, script, **limits)
    whole = tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
    assert f"#### {truth}" in whole  # the answer is in the episode's text, written by the tool or inside a call
    sample = graded_sample(rollout, row, tokenizer)
    assert builtin_scores(sample) == dict.fromkeys(BUILTIN_REWARDS, 0.0), sample.solution_str


def test_an_answer_after_the_tool_result_scores_under_every_builtin_reward(tokenizer, echo_box, row):
    truth = row["reward_model"]["ground_truth"]
    rollout = episode(tokenizer, echo_box, [echo_call("3"), " " + answer_in_every_form(truth)])
    sample = graded_sample(rollout, row, tokenizer)
    assert sample.solution_str == " " + answer_in_every_form(truth)
    assert builtin_scores(sample) == dict.fromkeys(BUILTIN_REWARDS, 1.0)


def test_the_text_before_a_final_turns_call_is_its_answer(tokenizer, echo_box, row):
    truth = row["reward_model"]["ground_truth"]
    rollout = episode(tokenizer, echo_box, [f" {truth} is my guess;" + echo_call("x")], max_turns=1)
    assert rollout.episode.truncated == "max_turns"
    # the space before the marker may be its own token, kept
    assert graded_sample(rollout, row, tokenizer).solution_str.rstrip() == f" {truth} is my guess;"


def test_a_plugin_reads_the_final_turn_and_finds_the_whole_episode_in_extra_info(tokenizer, echo_box, row):
    rollout = episode(tokenizer, echo_box, [echo_call("1776"), " 42"])
    sample = graded_sample(rollout, row, tokenizer)
    assert sample.solution_str == " 42"
    view = sample.extra_info["episode"]
    assert view["text"] == tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)
    assert view["turns"] == [
        {"role": "model", "text": echo_call("1776")},
        {"role": "environment", "text": RESPONSE_FORMAT.format(result="1776")},
        {"role": "model", "text": " 42"},
    ]
    assert view["truncated"] is None
    assert sample.extra_info["reasoning_gym"] == row["extra_info"]["reasoning_gym"]  # the row's own fields stay
    batch = GradedBatch([Example([0], "src", "42", {})], [rollout], Grades([1.0], {"arithmetic": [1.0]}, {}))
    [dumped] = controller.dump_rows(batch, tokenizer)
    assert (dumped["answer"], dumped["output"]) == (" 42", view["text"])
    # the ids the trainer scored, and the turns as spans of them: what a check of the chat template reads
    assert (dumped["input_ids"], dumped["output_ids"]) == (rollout.prompt_ids, rollout.completion_ids)
    assert [(t["role"], t["start"], t["end"]) for t in dumped["turns"]] == rollout.turn_spans()
    assert [t["role"] for t in dumped["turns"]] == ["model", "environment", "model"]
    single = Rollout([0], rollout.completion_ids, rollout.logprobs, 0, "stop")  # a single completion: all of it
    assert graded_sample(single, row, tokenizer).solution_str == view["text"]


def test_an_episodes_turns_and_answer_survive_a_checkpoint(tokenizer, echo_box):
    rollout = episode(tokenizer, echo_box, [echo_call("1776"), " 42"])
    stats = rollout.episode
    assert stats.turn_starts[0] == 0 and stats.answer_end == len(rollout.completion_ids)
    saved = json.loads(json.dumps(dataclasses.asdict(rollout)))
    assert Rollout.from_dict(saved) == rollout
    del saved["episode"]["turn_starts"]  # recorded before episodes kept their turns: refused, not misread
    with pytest.raises(ValueError, match="turn_starts"):
        Rollout.from_dict(saved)


def test_every_verl_parser_has_a_call_start_marker_and_one_without_is_refused(tokenizer):
    from verl.experimental.agent_loop.tool_parser import ToolParser

    from rl_tpu.episodes.loop import call_start_marker

    for name in ToolParser._registry:
        assert call_start_marker(name, ToolParser.get_tool_parser(name, tokenizer))
    with pytest.raises(ValueError, match="episode.tool_parser='mine'"):
        call_start_marker("mine", object())


def test_the_overlong_penalty_counts_the_models_tokens_not_the_tool_results(tokenizer, echo_box):
    rollout = episode(tokenizer, echo_box, [echo_call("1776"), " 42"])
    length, model = len(rollout.completion_ids), sum(rollout.model_mask)
    cfg = compose_run(
        "episode.enable=true",
        f"episode.function_tool_path={Path(__file__).resolve().parents[2] / 'examples/tools/calc_function.py'}",
        f"episode.max_tokens={length}",
        "reward.overlong_buffer.enable=true",
        f"reward.overlong_buffer.len={length - model}",  # the buffer starts where the model's tokens end
    )
    version = rollout.weight_version
    single = Rollout([1], rollout.completion_ids, rollout.logprobs, version, "stop")  # all the model's: at the limit

    class OneBatch:
        def __init__(self):
            self.cfg = cfg

        def pop(self, step):
            return [Example([1], "src", "7", {})], controller.GeneratedRollouts([rollout, single], {})

    batch, _ = controller.next_graded(
        version + 1, OneBatch(), tokenizer, CapturingGrader(), LearningSignal(cfg), Phases()
    )
    assert batch.grades.scores == pytest.approx([0.0, -1.0])


def test_each_tool_turn_records_its_calls_names_and_statuses(tokenizer, echo_box):
    """What the rollout inspector shows of a tool turn (rl_tpu/controller/recording.py)."""
    unknown = f" <tool_call>{json.dumps({'name': 'nope', 'arguments': {}})}</tool_call>"
    rollout = episode(tokenizer, echo_box, [echo_call("1776"), unknown, " 42"])
    assert rollout.episode.tool_turns == [
        [{"name": "echo", "status": "ok"}],
        [{"name": "nope", "status": "unknown_tool"}],  # the model's mistake, counted malformed
    ]
    assert rollout.episode.malformed_calls == 1
