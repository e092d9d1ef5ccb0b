"""Multi-turn episodes through the whole loop (real vLLM engine, two FSDP2 ranks, verl's function tool in worker
processes): the tool_math recipe's model (the shipped warm start: it calls the calculator in about a quarter of its
episodes) calls the tool, reads its result and answers; after every weight sync the engine's and the trainer's
fp32 logprobs of the model's tokens agree below 1e-5 per token; a sync-mode run with this deterministic tool
resumes exactly; an OpenEnv environment as the tool, one per episode, under a LoRA policy.

Both episode schedulers run, without a run of their own: the first run advances episodes on their own
(`episode.scheduling=async`), and the resumed run plays its steps in lockstep (set), so it resumes exactly
only if both schedulers make the same episodes, and its logprob gap is lockstep's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import MODULE_CLI, REPO
from test_e2e import assert_same_steps

from rl_tpu.outputs.metrics import read_metrics

EPISODE_OVERRIDES = (
    "+recipe=tool_math",  # its model and held-out set as shipped: no warm start to build (minutes of the suite)
    "data.val_max_samples=16",
    "data.train_batch_size=4",
    "sampler.n=8",  # 32 episodes a step: none calling the tool at the model's call rate is a chance of 3e-5
    "trainer.eval_every=2",
    "trainer.world_size=2",
)
CALC_FUNCTION = f"episode.function_tool_path={REPO / 'examples/tools/calc_function.py'}"


def episode_cli(run_dir, cache_dir, *overrides: str, tool: str = CALC_FUNCTION) -> None:
    """A run of the tool_math recipe (conftest's run_cli runs grpo_math's) with the calculator `tool`."""
    command = [*MODULE_CLI, *EPISODE_OVERRIDES, tool, f"hydra.run.dir={run_dir}", f"cache_dir={cache_dir}", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-5000:] + done.stderr[-5000:])
    assert done.returncode == 0, f"episode run failed (rc {done.returncode})"


@pytest.fixture(scope="module")
def episode_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    # every episode recorded, for the rollout inspector's page
    episode_cli(
        root / "run",
        root / "cache",
        "trainer.total_steps=4",
        "trainer.checkpoint_every=2",
        "trainer.rollout_data_every=1",
        "episode.scheduling=async",
    )
    return root


def test_episodes_call_the_tool_and_the_logprobs_agree_after_every_sync(episode_run):
    rows = read_metrics(episode_run / "run" / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for row in steps:
        assert row["episode/tool_call_rate"] > 0.1 and row["episode/turns_mean"] > 1.0, row["step"]
        assert row["episode/env_tokens_mean"] > 0 and row["episode/tool/calc/calls"] > 0
        assert row["episode/tool_failures_mean"] == 0.0
        # the model's tokens after a tool result, scored by the trainer as the engine sampled them
        assert row["actor/logprob_diff"] < 1e-5, "sampler and trainer disagree on the logprobs of the same tokens"
    assert "eval/episode/tool_call_rate" in rows[0]


def test_the_rollout_inspector_sets_the_tool_turns_apart(episode_run, tmp_path):
    """`python -m rl_tpu.report RUN` writes the page; a headless Chromium checks it as for single completions
    (tests/browser.py), and each episode's tool turns are boxes of their own naming the tool and its status."""
    from browser import check_page, start_browser
    from selenium.webdriver.common.by import By

    run = episode_run / "run"
    subprocess.run([*MODULE_CLI[:2], "rl_tpu.report", str(run)], cwd=REPO, check=True, capture_output=True, timeout=300)
    driver = start_browser()
    try:
        seen = check_page(driver, run, tmp_path / "inspect.png")
        for element, row in zip(driver.find_elements(By.CSS_SELECTOR, "#groups .sample"), seen["recorded"]):
            tool_turns = element.find_elements(By.CSS_SELECTOR, ".tool-turn")
            environment = [t for t in row["turns"] if t["role"] == "environment"]
            assert len(tool_turns) == len(environment)
            for box, turn in zip(tool_turns, environment):
                assert len(box.find_elements(By.CSS_SELECTOR, ".tok")) == turn["end"] - turn["start"]
                assert all("masked" in tok.get_attribute("class") for tok in box.find_elements(By.CSS_SELECTOR, ".tok"))
                assert box.find_element(By.CSS_SELECTOR, ".tool-label").text == "tool: calc (ok)"
        assert any(t["role"] == "environment" for row in seen["recorded"] for t in row["turns"])
    finally:
        driver.quit()


def test_a_sync_run_with_a_deterministic_tool_resumes_exactly_in_either_scheduling(episode_run):
    """The run's steps 3 and 4 were played by episodes advancing on their own; the resumed run plays them in
    lockstep, and every figure that decides learning is the same, bit for bit."""
    episode_cli(
        episode_run / "resumed",
        episode_run / "cache",
        "trainer.total_steps=4",
        f"trainer.resume_from={episode_run / 'run'}/checkpoints/step_2",
        "episode.scheduling=lockstep",
    )
    trained = [r for r in read_metrics(episode_run / "resumed" / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in trained] == [3, 4]
    assert all(r["actor/logprob_diff"] < 1e-5 for r in trained)  # lockstep's episodes, scored by the trainer
    assert_same_steps(trained, episode_run / "run", keys=("episode/env_tokens_mean", "episode/tool_calls_mean"))


def test_an_openenv_environment_as_the_tool_trains_a_lora_policy(episode_run):
    """The calculator an OpenEnv `Environment` behind rl_tpu's OpenEnvTool, named in a verl tools YAML, one
    environment per episode (`lifetime: episode`: created at its first call, released at its end, its calls routed
    to the worker holding it). The policy is a LoRA adapter (a large learning rate, so that each version differs):
    after every adapter-only sync the engine serves the episodes' model tokens with the trainer's logprobs.
    (A reasoning-gym task with the tool: tests/e2e/test_chat_episodes_e2e.py.)"""
    run = episode_run / "openenv"
    tools = yaml.safe_load((REPO / "examples/tools/openenv_calculator.yaml").read_text())
    tools["tools"][0]["config"]["lifetime"] = "episode"
    (run / "tools").mkdir(parents=True)
    tools_file = run / "tools" / "openenv_calculator.yaml"
    tools_file.write_text(yaml.safe_dump(tools))
    for module in ("calculator_env.py", "calculator.py"):  # the workers import them from the YAML's folder
        shutil.copy(REPO / "examples/tools" / module, run / "tools")
    episode_cli(
        run,
        episode_run / "cache",
        "trainer.total_steps=2",
        "data.train_batch_size=8",  # 64 episodes a step
        "episode.function_tool_path=null",  # the recipe's calc function: the OpenEnv tool has its name
        f"trainer.rollout_data_dir={run / 'rollouts'}",
        "actor.lora.lora_rank=8",
        "algorithm.lr=1e-2",
        tool=f"episode.tools_config_file={tools_file}",
    )
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "actor/loss" in r] == [1, 2]
    assert all(r["actor/logprob_diff"] < 1e-5 for r in rows if "actor/loss" in r)  # the served adapter's logprobs
    assert (run / "export" / "adapter_config.json").is_file()  # the export is the adapter
    assert sum(r.get("episode/tool/calc/calls", 0) for r in rows) > 0, "the OpenEnv calculator was never called"
    assert all(r.get("episode/tool/calc/failures", 0) == 0 for r in rows)  # none lost, none refused
    dumped = [json.loads(line) for line in (run / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert dumped and all(" * " in row["input"] for row in dumped)  # the recipe's products
    assert all(0.0 <= row["score"] <= 1.0 for row in dumped)
    assert {row["outcome"] for row in dumped} <= {"scored", "truncated"} and rows[-1]["outcome/tool_failure"] == 0
