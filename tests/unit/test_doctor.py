"""The preflight's checks (rl_tpu/doctor/checks.py): each cause injected in turn is named, with the config key that
changes it; without it the check passes, and without what it reads it is "not available", never passed. Real
tokenizers (Qwen2.5's chat template on a byte-level vocabulary: tests/chat_model.py) and a real reward plugin run by
the grader's worker; plain dicts for step metrics."""

from __future__ import annotations

import math

import pytest
from chat_model import QWEN_SPECIAL, QWEN_TAGS, byte_tokenizer

from rl_tpu.config import RunConfig
from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.doctor import checks
from rl_tpu.doctor.checks import FAILED, NOT_AVAILABLE, PASSED, Check
from rl_tpu.doctor.probe import DOCTOR_STEPS, DoctorWatch, Report, doctor_config, reward_samples, score_rows
from rl_tpu.grader.grader import Grades
from rl_tpu.records import Rollout

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
QUESTION = [{"role": "user", "content": "What is 47 * 83?"}]


@pytest.fixture(scope="module")
def qwen():
    """A byte-level tokenizer with Qwen2.5's special tokens, tool-call tags and chat template."""
    return byte_tokenizer("qwen2_5", QWEN_SPECIAL, QWEN_TAGS, eos="<|im_end|>")


@pytest.fixture(scope="module")
def no_template():
    """A byte-level tokenizer without chat tokens or a chat template (as the tiny preset's)."""
    tokenizer = byte_tokenizer("qwen2_5", ("<|endoftext|>",), (), eos="<|endoftext|>")
    tokenizer.chat_template = None
    return tokenizer


def rendered(tokenizer, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_names(check: Check, status: str, *words: str) -> None:
    assert check.status == status, check.line()
    for word in words:
        assert word in check.line(), (word, check.line())


def step(**figures) -> dict:
    """One step's metrics as the run logs them, with these figures changed."""
    return {
        "response/truncated_frac": 0.25,
        "actor/grad_norm": 0.5,
        "actor/logprob_diff_max": 1e-6,
        "actor/logprob_diff": 1e-7,
        "rollout/staleness": 0.0,
        **figures,
    }


# 1. the chat template


def test_prompts_without_the_models_chat_template_are_named(qwen):
    raw = qwen.encode(QUESTION[0]["content"], add_special_tokens=False)
    assert_names(checks.chat_template(qwen, [rendered(qwen), raw]), FAILED, "1 of 2 prompts", "data.prompt_key")
    assert_names(checks.chat_template(qwen, [rendered(qwen)] * 2), PASSED, "<|im_start|>assistant")


def test_a_chat_tokenizer_without_a_template_is_named(qwen, no_template):
    stripped = byte_tokenizer("qwen2_5", QWEN_SPECIAL, QWEN_TAGS, eos="<|im_end|>")
    stripped.chat_template = None
    prompt = stripped.encode("What is 47 * 83?", add_special_tokens=False)
    assert_names(checks.chat_template(stripped, [prompt]), FAILED, "<|im_start|>", "model.path")
    assert_names(checks.chat_template(no_template, [prompt]), PASSED, "no chat template")


# 2. EOS reachable


def test_completions_that_all_hit_the_length_are_named():
    cut = [step(**{"response/truncated_frac": 1.0})] * 2
    assert_names(checks.eos_reachable(cut, 8, "sampler.response_length"), FAILED, "8-token", "sampler.response_length")
    ended = [step(**{"response/truncated_frac": 1.0}), step()]
    assert_names(checks.eos_reachable(ended, 8, "sampler.response_length"), PASSED)
    assert checks.eos_reachable([], 8, "sampler.response_length").status == NOT_AVAILABLE


# 3. reward variance, 4. the gradient


def test_groups_with_zero_reward_variance_are_named():
    assert_names(checks.reward_variance([[1.0, 1.0], [0.0, 0.0]]), FAILED, "every advantage is zero", "sampler.n")
    assert_names(checks.reward_variance([[0.0, 0.0], [0.0, 1.0]]), PASSED, "1 of 2")
    assert_names(checks.reward_variance([[1.0], [0.0]]), FAILED, "1 completion(s) a group", "sampler.n")
    assert checks.reward_variance([]).status == NOT_AVAILABLE


def test_a_zero_gradient_norm_is_named_with_its_cause():
    zero = [step(**{"actor/grad_norm": 0.0})] * 2
    assert_names(checks.gradient(zero, rewards_varied=False), FAILED, "reward variance", "sampler.n")
    assert_names(checks.gradient(zero, rewards_varied=True), FAILED, "actor.policy_loss.loss_mode")
    assert_names(checks.gradient([step(**{"actor/grad_norm": math.nan})], True), FAILED, "not finite", "model.dtype")
    assert_names(checks.gradient([*zero, step()], True), PASSED, "0.5")


# 5. the canary


def test_a_canary_gap_past_its_bound_is_named_and_a_missing_one_is_not_available():
    assert_names(checks.canary([step(**{checks.CANARY: 0.3})], "float32"), FAILED, "0.3", "sync.transport")
    assert_names(checks.canary([step(**{checks.CANARY: math.nan})], "float32"), FAILED, "sync.transport")
    assert_names(checks.canary([step(**{checks.CANARY: 0.3})], "bfloat16"), PASSED)
    assert_names(checks.canary([step(), step()], "float32"), NOT_AVAILABLE, checks.CANARY)


# 6. the tool-call parser


def test_a_parser_that_reads_no_call_of_the_prompted_format_is_named(qwen):
    prompt = rendered(qwen, [CALCULATOR])
    assert_names(checks.tool_calls("glm", qwen, [CALCULATOR], prompt, []), FAILED, "episode.tool_parser=glm")
    assert_names(checks.tool_calls("hermes", qwen, [CALCULATOR], prompt, []), PASSED, "calculator")
    unnamed = rendered(qwen)  # the template shows no tools when it is given none
    assert_names(checks.tool_calls("hermes", qwen, [CALCULATOR], unnamed, []), FAILED, "calculator", "model.path")
    assert checks.tool_calls(None, qwen, None, prompt, []).status == NOT_AVAILABLE


def test_without_a_template_the_short_runs_calls_decide(no_template):
    prompt = no_template.encode("Q: What is 47 * 83? A:", add_special_tokens=False)
    lost = [{"episode/tool_calls_mean": 0.0, "episode/malformed_calls_mean": 0.5}]
    assert_names(checks.tool_calls("hermes", no_template, [CALCULATOR], prompt, lost), FAILED, "episode.tool_parser")
    read = [{"episode/tool_calls_mean": 0.5, "episode/malformed_calls_mean": 0.5}]
    assert checks.tool_calls("hermes", no_template, [CALCULATOR], prompt, read).status == PASSED
    assert checks.tool_calls("hermes", no_template, [CALCULATOR], prompt, []).status == NOT_AVAILABLE


# 7. the logprob gap


def test_a_logprob_gap_past_the_dtypes_bound_is_named():
    wide = [step(**{"actor/logprob_diff_max": 0.01})]
    assert_names(checks.logprob_gap(wide, "float32", "trainer"), FAILED, "0.01", "model.dtype=float32")
    assert checks.logprob_gap(wide, "bfloat16", "trainer").status == PASSED
    stale = [step(**{"actor/logprob_diff_max": 0.01, "rollout/staleness": 1.0})]
    assert checks.logprob_gap(stale, "float32", "trainer").status == NOT_AVAILABLE  # older weights' gap is not one
    assert checks.logprob_gap(wide, "float32", "sampler").status == NOT_AVAILABLE
    untrained = [step(**{"actor/logprob_diff_max": 0.0, "perf/train_tokens": 0.0})]  # every row skipped
    assert checks.logprob_gap(untrained, "float32", "trainer").status == NOT_AVAILABLE


# 8. the reward plugin, run by the grader's worker on real rows

PLUGIN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth == "none":
        return None
    if ground_truth == "text":
        return "1.0"
    if ground_truth == "raise":
        raise KeyError("answer")
    return float(solution_str == ground_truth)
"""


def rows(*truths: str) -> list:
    from rl_tpu.data.datasets import Example

    return [Example([1, 2], "plugin_test", truth, {"index": i}, row=i) for i, truth in enumerate(truths)]


def test_a_reward_plugin_returning_none_a_string_or_raising_is_named_by_row(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(PLUGIN)
    cfg = RunConfig()
    cfg.reward.custom.path = str(plugin)
    labels, samples = reward_samples(rows("7", "none", "text", "raise"), episodes=False)
    grades = score_rows(cfg, samples, None)
    check = checks.reward_plugin(labels, grades.scores, grades.failures, "reward.custom.path")
    assert_names(check, FAILED, "6 of 8", "row 1 (the reference answer)", "None", "'1.0'", "reward.custom.path")
    assert "KeyError" in checks.reward_plugin(labels, [], grades.failures[4:], "k").line()
    good = checks.reward_plugin(labels[:2], grades.scores[:2], [], "reward.custom.path")
    assert_names(good, PASSED, "1, 0")


def test_the_rows_are_scored_as_the_reference_answer_and_an_empty_completion():
    labels, samples = reward_samples(rows("7"), episodes=True)
    assert [s.solution_str for s in samples] == ["7", ""]
    assert labels == ["row 0 (the reference answer)", "row 0 (an empty completion)"]
    assert samples[0].extra_info["episode"]["turns"] == [{"role": "model", "text": "7"}]


# the short run and its report


def test_the_short_run_keeps_the_runs_settings_but_its_length_and_outputs():
    cfg = RunConfig()
    cfg.trainer.world_size, cfg.sampler.n, cfg.trainer.preflight = 4, 2, True
    short = doctor_config(cfg)
    assert (short.trainer.total_steps, short.trainer.preflight, short.trainer.export) == (DOCTOR_STEPS, False, False)
    assert short.data.train_batch_size == 8 and short.data.val_max_samples == 1
    assert (short.sampler, short.model, short.reward, short.actor) == (cfg.sampler, cfg.model, cfg.reward, cfg.actor)
    cfg.sampler.n, cfg.actor.ppo_mini_batch_size = 1, 6  # 8 prompts: not a multiple of the mini-batch, nor 4 ranks
    assert doctor_config(cfg).data.train_batch_size == 12
    assert cfg.trainer.total_steps == 100  # the run's own settings are not touched


def test_the_watch_reads_each_groups_scores_and_a_failure_fails_the_report():
    rollouts = [Rollout([1], [2], [0.0], 0, "stop", group=g) for g in (0, 0, 1, 1)]
    batch = GradedBatch([None, None], rollouts, Grades([1.0, 0.0, 1.0, 1.0], {}, {}))
    watch = DoctorWatch(RunConfig(), None)
    watch.step(1, step(), batch)
    assert watch.groups == [[1.0, 0.0], [1.0, 1.0]]
    report = Report(watch.report(), None, 1, 1.0)
    assert [c.name for c in report.checks][:4] == ["chat template", "EOS reachable", "reward variance", "gradient"]
    assert report.checks[0].status == NOT_AVAILABLE  # its inputs were never shown to the watch
    assert report.passed and "doctor: passed" in report.lines()[-1]
    assert not Report(report.checks, "RewardError: boom", 1, 1.0).passed
    failing = [*report.checks, Check("x", FAILED, "cause", "a.key")]
    assert not Report(failing, None, 1, 1.0).passed and "[change: a.key]" in Report(failing, None, 1, 1.0).lines()[-2]


def test_a_failed_preflight_stops_the_run_naming_each_failure(monkeypatch, tmp_path):
    from rl_tpu.doctor import probe

    found = [Check("reward variance", FAILED, "all equal", "sampler.n"), Check("canary", NOT_AVAILABLE, "none")]
    monkeypatch.setattr(probe, "diagnose", lambda cfg, folder: Report(found, None, 2, 1.0))
    with pytest.raises(probe.PreflightFailed, match=r"(?s)did not start.*reward variance +FAILED: all equal"):
        probe.preflight(RunConfig(), tmp_path)
    found[0] = Check("reward variance", PASSED, "3 of 16 groups' rewards varied")
    assert probe.preflight(RunConfig(), tmp_path).passed
