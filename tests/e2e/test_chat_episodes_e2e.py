"""The chat renderer inside real runs (vLLM engine, FSDP2 trainer, Ray, the calculator in tool workers), on a tiny
model with Qwen2.5's chat template (tests/chat_model.py): `tool_gsm8k` on GSM8K fixture rows and a reasoning-gym task
with `renderer: chat`. From the rollout dump of each step: the model called the tool and read its result; each
episode's ids, as the engine and the renderer made them, are what `apply_chat_template` gives for the episode's
conversation, token for token; the reward read the final turn (its right answer scores 1, a final turn without one
scores 0 though the tool's result holds the answer)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from chat_model import NO_NUMBER, REASONING_GYM, calculator_schemas, final_answer, gsm8k_rows, reasoning_gym_rows
from conftest import MODULE_CLI, REPO

from rl_tpu.outputs.metrics import read_metrics
from rl_tpu.outputs.rollout_log import read_steps

# the suite's small settings: 2 prompts x 4 episodes a step, 2 steps, one trainer rank, fp32 (exact logprobs)
SMALL = (
    "model.dtype=float32",
    "data.train_batch_size=2",
    "sampler.n=4",
    "trainer.total_steps=2",
    "trainer.world_size=1",
    "data.max_prompt_length=160",
    "sampler.response_length=96",
    "episode.max_tokens=224",
    "ray.object_store_mb=256",
    "trainer.checkpoint_final=false",
    "trainer.export=false",
    "trainer.plots=false",
)
END = "<|im_end|>"
# the model turns the warm start taught: one calculator call, or a final answer; the episodes whose every model turn
# has one of these forms are checked token for token (a turn sampled otherwise has text the template may not write)
CALL_TURN = re.compile(r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": "[^"\\]*"\}\}\n</tool_call>')
FINAL_TURN = re.compile(r"[^<>]*|<answer>[^<>]*</answer>")


def chat_run(run_dir, model_dir, *overrides: str) -> None:
    command = [
        *MODULE_CLI,
        *overrides,
        f"model.path={model_dir}",
        *SMALL,
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
        f"hydra.run.dir={run_dir}",
        f"cache_dir={run_dir.parent / 'cache'}",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-5000:] + done.stderr[-5000:])
    assert done.returncode == 0, f"chat run failed (rc {done.returncode})"


def conversation(row: dict, prompt: list[dict], tokenizer) -> list[dict] | None:
    """The episode's chat messages, read from its dumped turns; None if a model turn is not of a taught form."""
    messages, ids = list(prompt), row["output_ids"]
    for turn in row["turns"]:
        text = tokenizer.decode(ids[turn["start"] : turn["end"]])
        if turn["role"] == "environment":
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
            messages += [{"role": "tool", "content": result} for result in results]
        elif not text.endswith(END):
            return None  # cut by a limit
        elif CALL_TURN.fullmatch(text[: -len(END)]):
            call = json.loads(text[len("<tool_call>\n") : -len(f"\n</tool_call>{END}")])
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
            )
        elif FINAL_TURN.fullmatch(text[: -len(END)]):
            messages.append({"role": "assistant", "content": text[: -len(END)]})
        else:
            return None
    return messages


def check_episodes(run_dir, rows: list[dict], reward: str) -> None:
    """The rollout dump's episodes against the chat template and the reward (see the module's docstring)."""
    from transformers import AutoTokenizer

    metrics = [r for r in read_metrics(run_dir / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in metrics] == [1, 2]
    for step in metrics:
        assert step["episode/tool/calculator/calls"] > 0 and step["episode/tool_failures_mean"] == 0.0
        assert step["actor/logprob_diff"] < 1e-5, "sampler and trainer disagree on the logprobs of the same tokens"
    tokenizer = AutoTokenizer.from_pretrained(run_dir.parent / "model")
    tools = calculator_schemas()
    dumped = [row for step_rows in read_steps(run_dir / "rollouts").values() for row in step_rows]
    checked, scored = 0, {1.0: 0, 0.0: 0}
    for row in dumped:
        source = rows[row["index"]]  # its row in the training file
        messages = conversation(row, source["prompt"], tokenizer)
        if messages is None:
            continue
        checked += 1
        whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        episode = row["input_ids"] + row["output_ids"]
        # the template ends the last message with "<|im_end|>\n"; the engine stopped at <|im_end|>
        assert episode == whole[:-1] and tokenizer.decode(whole[-1:]) == "\n", row["output"][-200:]
        final, results = messages[-1], [m["content"] for m in messages if m["role"] == "tool"]
        if "tool_calls" in final or not results:
            continue  # no answer, or no tool result before it
        truth = source["reward_model"]["ground_truth"]
        assert row["answer"] == final["content"]  # what the reward read: the final turn
        if final["content"] == final_answer(source):
            assert row["score"] == 1.0, row
            scored[1.0] += 1
        elif final["content"] == NO_NUMBER and truth in results:  # the answer is the tool's, never the model's
            assert row["score"] == 0.0, row
            scored[0.0] += 1
    assert checked >= len(dumped) // 2, f"only {checked} of {len(dumped)} episodes have the taught form"
    assert min(scored.values()) > 0, f"{reward}: episodes scored 1 and 0 with the tool's answer: {scored}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, chat_model_dir):
    root = tmp_path_factory.mktemp("chat")
    (root / "model").symlink_to(chat_model_dir)
    return root


def test_tool_gsm8k_with_the_chat_template(runs):
    data = runs / "gsm8k.jsonl"
    rows = gsm8k_rows()
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = runs / "gsm8k"
    chat_run(run, runs / "model", "+recipe=tool_gsm8k", f"data.train_files={data}", f"data.val_files={data}")
    check_episodes(run, rows, "gsm8k")


def test_a_reasoning_gym_task_with_the_chat_renderer(runs):
    rg = REASONING_GYM
    run = runs / "reasoning_gym"
    chat_run(
        run,
        runs / "model",
        "+recipe=grpo_reasoning_gym",
        f"data.reasoning_gym.task={rg['task']}",
        "+data.reasoning_gym.config={" + ", ".join(f"{k}: {v}" for k, v in rg["config"].items()) + "}",
        f"data.reasoning_gym.size={rg['size']}",
        f"data.num_eval={rg['num_eval']}",
        "data.reasoning_gym.system_prompt=null",
        "episode.enable=true",
        "episode.renderer=chat",
        "episode.tool_parser=hermes",
        "episode.max_turns=4",
        f"episode.tools_config_file={REPO / 'examples/tools/calculator.yaml'}",
    )
    check_episodes(run, reasoning_gym_rows(), "reasoning_gym")
