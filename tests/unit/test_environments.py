"""Environment libraries: reasoning-gym tasks as a data source scored by their own scorer, and an OpenEnv
`Environment` as a verl tool (OpenEnvTool) run by the tool workers, per call or kept for an episode, in the worker
or on an OpenEnv server on loopback. reasoning-gym, openenv-core and verl are the real packages; nothing is
faked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml as yaml_module
from conftest import free_port

from rewards.reasoning_gym import compute_score
from rl_tpu.config.reasoning_gym import ReasoningGymConfig
from rl_tpu.data.datasets import read_rows
from rl_tpu.data.reasoning_gym import ensure_reasoning_gym_dataset
from rl_tpu.episodes.tool_worker import ToolCall, ToolRelease
from rl_tpu.episodes.tools import ToolBox, ToolSettings

REPO = Path(__file__).resolve().parents[2]
PRODUCTS = ReasoningGymConfig(task="products", config={"max_digits": 2}, size=40, system_prompt=None)


@pytest.fixture(scope="module")
def products(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    train, test = ensure_reasoning_gym_dataset(tmp_path_factory.mktemp("rg"), PRODUCTS, num_eval=30, seed=3)
    return read_rows(train), read_rows(test)


def test_a_task_becomes_verl_rows_with_a_held_out_split_of_other_questions(products, tmp_path):
    train, test = products
    assert len(train) == 40 and 0 < len(test) <= 30
    row = train[0]
    assert row["data_source"] == "reasoning_gym/products" and row["prompt"][-1]["role"] == "user"
    assert (
        "multiplication" in row["prompt"][-1]["content"] and row["reward_model"]["ground_truth"].lstrip("-").isdigit()
    )
    assert not {r["prompt"][-1]["content"] for r in train} & {r["prompt"][-1]["content"] for r in test}
    again, _ = ensure_reasoning_gym_dataset(tmp_path, PRODUCTS, num_eval=30, seed=3)  # the same setting: the same rows
    assert read_rows(again) == train
    with_prompt = ReasoningGymConfig(task="products", config={"max_digits": 2}, size=4)
    first = read_rows(ensure_reasoning_gym_dataset(tmp_path, with_prompt, num_eval=4, seed=3)[0])[0]
    assert first["prompt"][0]["role"] == "system" and "<answer>" in first["prompt"][0]["content"]


def test_the_tasks_own_scorer_scores_the_answer_between_answer_tags(products):
    row = products[0][5]
    truth, info = row["reward_model"]["ground_truth"], row["extra_info"]
    assert compute_score(row["data_source"], f"thinking... <answer>{truth}</answer>", truth, info) == 1.0
    assert compute_score(row["data_source"], f"<answer>{int(truth) + 1}</answer>", truth, info) == 0.0
    assert compute_score(row["data_source"], truth, truth, info) == 0.0  # no tags: no answer
    with pytest.raises(ValueError, match="regenerates with answer"):  # a row that is not the entry it names
        compute_score(row["data_source"], truth, "-1", info)


@pytest.mark.parametrize(
    "config, message",
    [
        (ReasoningGymConfig(task="no_such_task"), "allowed values are .*basic_arithmetic.*products"),
        (
            ReasoningGymConfig(task="products", config={"digits": 2}),
            "digits not a field of products's config; allowed keys are .*max_digits",
        ),
        (ReasoningGymConfig(task="products", config={"min_digits": 0}), "data.reasoning_gym .task products"),
        (
            ReasoningGymConfig(task="products", system_prompt="nope"),
            "system_prompt='nope': allowed values are .*default",
        ),
    ],
)
def test_bad_settings_name_the_key_and_the_allowed_values(config, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        ensure_reasoning_gym_dataset(tmp_path, config, num_eval=4, seed=0)


def test_the_task_size_and_seed_are_not_taken_from_the_tasks_config():
    with pytest.raises(ValueError, match="data.reasoning_gym.size"):
        ReasoningGymConfig(task="products", config={"size": 5})


@pytest.fixture(scope="module")
def openenv_toolbox(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openenv")
    yaml = folder / "tools.yaml"
    entry = {
        "class_name": "rl_tpu.episodes.openenv_tool.OpenEnvTool",
        "config": {"type": "native", "environment": "calculator_env.CalculatorEnvironment", "name": "calc"},
    }
    [guess] = yaml_module.safe_load((REPO / "examples/tools/guess_number.yaml").read_text())["tools"]
    yaml.write_text(json.dumps({"tools": [entry, guess]}))  # JSON is YAML
    for module in ("calculator_env.py", "calculator.py", "guess_number_env.py"):
        (folder / module).write_text((REPO / "examples/tools" / module).read_text())
    box = ToolBox(ToolSettings(str(yaml), None, 2, 10.0, 2048, 64))
    yield box
    box.close()


def test_an_openenv_environment_is_a_tool_whose_parameters_are_its_action_fields(openenv_toolbox):
    schema = openenv_toolbox.schemas["calc"]["function"]
    assert schema["parameters"]["required"] == ["expression"]
    assert set(schema["parameters"]["properties"]) == {"expression"}  # OpenEnv's `metadata` is not the model's
    assert schema["description"] == "Evaluate an arithmetic expression."
    results, _ = openenv_toolbox.run(
        [
            ToolCall("calc", json.dumps({"expression": "37*48"}), {}),
            ToolCall("calc", json.dumps({"expr": "1+1"}), {}),  # no required `expression`: the model's mistake
            ToolCall("calc", json.dumps({"expression": "2**3"}), {}),  # the environment's own error text
        ]
    )
    assert (results[0].text, results[0].failure) == ("1776", None)
    assert results[1].failure == "bad_arguments" and "expression" in results[1].text
    assert results[2].failure is None and results[2].text.startswith("error: unsupported operator")


SERVER_PING_S = 1.5  # the server's keep-alive: a ping every 1.5 s, a connection closed if 1.5 s pass unanswered


@pytest.fixture(scope="module")
def remote_guess_toolbox(tmp_path_factory):
    """The guess-the-number game on a real OpenEnv server (examples/tools/guess_number_server.py) on loopback."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "guess_number_server.py", "--port", str(port), "--ping-s", str(SERVER_PING_S)],
        cwd=REPO / "examples/tools",
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"the OpenEnv server did not answer on port {port} within 60 s (exit {server.poll()})")
            time.sleep(0.2)
    [entry] = yaml_module.safe_load((REPO / "examples/tools/guess_number_remote.yaml").read_text())["tools"]
    entry["config"]["base_url"] = f"http://127.0.0.1:{port}"
    folder = tmp_path_factory.mktemp("remote")
    (folder / "tools.yaml").write_text(json.dumps({"tools": [entry]}))
    box = ToolBox(ToolSettings(str(folder / "tools.yaml"), None, 2, 10.0, 2048, 64))
    yield box
    box.close()
    server.terminate()
    server.wait(timeout=30)


def guess(value: int | str, episode: str, target: int | None = None) -> ToolCall:
    return ToolCall("guess", json.dumps({"guess": value}), {"target": target}, episode, may_create=target is not None)


@pytest.mark.parametrize("where", ["in_the_worker", "on_a_server"])
def test_an_openenv_environment_with_lifetime_episode_is_one_game_across_the_episodes_calls(where, request):
    """The same game in the tool worker (guess_number.yaml) and on an OpenEnv server (guess_number_remote.yaml):
    the same schema, answers, rewards and refusals."""
    openenv_toolbox = request.getfixturevalue("openenv_toolbox" if where == "in_the_worker" else "remote_guess_toolbox")
    assert "guess" in openenv_toolbox.per_episode
    schema = openenv_toolbox.schemas["guess"]["function"]
    assert schema["parameters"]["required"] == ["guess"] and schema["parameters"]["properties"]["guess"]["type"]
    opened, _ = openenv_toolbox.run([guess(50, "a", target=70), guess(50, "b", target=20)])
    assert [json.loads(r.text) for r in opened] == [
        {"hint": "higher", "low": 51, "high": 100, "guesses": 1},
        {"hint": "lower", "low": 1, "high": 49, "guesses": 1},
    ]
    moves = [guess(80, "a"), guess(20, "b"), guess(70, "a")]  # a's second and third guesses in one turn, in order
    played, _ = openenv_toolbox.run(moves)
    assert [json.loads(r.text) for r in played] == [
        {"hint": "lower", "low": 51, "high": 79, "guesses": 2},
        {"hint": "correct", "low": 1, "high": 49, "guesses": 2},
        {"hint": "correct", "low": 51, "high": 79, "guesses": 3},
    ]
    assert [r.reward for r in played] == [0.0, pytest.approx(0.9), pytest.approx(0.8)]  # the step rewards
    # arguments the action refuses (checked here, or by the server): one line the model reads, the model's mistake
    # (a malformed call), not the environment's failure
    [refused], _ = openenv_toolbox.run([guess("many", "c", target=5)])
    assert refused.failure == "bad_arguments" and "guess" in refused.text and "\n" not in refused.text
    [over], _ = openenv_toolbox.run([guess(70, "a")])
    assert over.failure == "exception" and over.text.endswith(
        "guess: this episode's environment is done; it takes no more actions"
    )
    ended, _ = openenv_toolbox.run([], [ToolRelease("guess", episode) for episode in "abc"])
    assert [r.failure for r in ended] == [None, None, None]
    [gone], _ = openenv_toolbox.run([guess(1, "a")])
    assert gone.failure == "lost"  # closed with its episode


def test_a_servers_session_outlasts_a_turn_longer_than_its_keep_alive(remote_guess_toolbox):
    """Between two turns (the model generating) the worker answers the server's pings, so a game's WebSocket is
    open at the next call (the default server closes a connection silent for 40 s; this one, for 3 s)."""
    [opened], _ = remote_guess_toolbox.run([guess(50, "slow", target=70)])
    assert opened.failure is None
    time.sleep(3 * SERVER_PING_S + 1)
    [moved], _ = remote_guess_toolbox.run([guess(70, "slow")])
    assert (moved.failure, json.loads(moved.text)) == (None, {"hint": "correct", "low": 51, "high": 100, "guesses": 2})
    remote_guess_toolbox.run([], [ToolRelease("guess", "slow")])


def test_an_openenv_tool_is_given_a_class_or_a_server_and_a_server_it_cannot_read_is_named():
    from rl_tpu.episodes.openenv_tool import OpenEnvTool

    with pytest.raises(ValueError, match="set one of config.environment .* and config.base_url"):
        OpenEnvTool({"type": "native"})
    with pytest.raises(ValueError, match="base_url='http://127.0.0.1:9': config.name is required"):
        OpenEnvTool({"type": "native", "base_url": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match="base_url='http://127.0.0.1:9': no action schema at its /schema"):
        OpenEnvTool({"type": "native", "base_url": "http://127.0.0.1:9", "name": "guess", "timeout_s": 2})


def test_the_reasoning_gym_recipe_takes_any_task_with_one_override():
    from test_config import compose_recipe

    from rl_tpu.controller.checks import validate

    cfg = compose_recipe(
        "grpo_reasoning_gym",
        "model.path=/models/m",
        "data.reasoning_gym.task=products",
        "+data.reasoning_gym.config={max_digits: 3}",
    )
    validate(cfg)
    assert (cfg.data.reasoning_gym.task, cfg.data.reasoning_gym.config) == ("products", {"max_digits": 3})
    assert cfg.reward.name == "reasoning_gym" and cfg.data.train_files is None
    with pytest.raises(Exception, match="both set"):
        compose_recipe("grpo_reasoning_gym", "model.path=/models/m", "data.train_files=t.parquet")
