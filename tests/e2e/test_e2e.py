"""End to end through the CLI: Ray, a vLLM engine, two FSDP2 ranks, weight sync, export, checkpoint, resume."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_command, run_cli, tensorboard_scalars

from rl_tpu.outputs.metrics import read_metrics

STEP_KEYS = {
    "reward/mean",
    "sync/transport",
    "sync/bytes",
    "actor/loss",
    "actor/entropy",
    "actor/grad_norm",
    "actor/logprob_diff",
    "actor/logprob_diff_max",
    "time/generate_s",
    "time/reward_s",
    "time/train_s",
    "time/sync_s",
    "time/publish_s",
    "perf/gen_tokens_per_s",
    "perf/train_tokens_per_s",
    "sync/version",
    "rollout/weight_version",
    "sync/mb_per_s",
    "sync/canary_gap",  # the weight canary after each install (rl_tpu/sync/canary.py)
}


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory, installed_cli):
    """The `rl-tpu` command of a wheel, run from a folder outside the checkout, as a user runs it."""
    root = tmp_path_factory.mktemp("e2e")
    (root / "elsewhere").mkdir()
    result = run_cli(
        root / "run",
        root / "cache",
        "trainer.total_steps=3",
        "sync.transport=collective",
        "trainer.logger=[jsonl,tensorboard]",
        "trainer.eval_pass_k=4",
        "trainer.rollout_data_every=1",  # the rollout inspector's record of every sample
        program=[installed_cli],
        cwd=root / "elsewhere",
    )
    return root, result


def test_the_wheel_runs_outside_the_checkout_and_its_help_lists_recipes_and_keys(three_step_run, installed_cli):
    root, result = three_step_run
    where = subprocess.run(
        [installed_cli.parent / "python", "-c", "import rl_tpu; print(rl_tpu.__file__)"],
        cwd=root / "elsewhere",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert Path(where).is_relative_to(installed_cli.parents[1]), where  # the wheel's copy, not the checkout
    assert "held-out accuracy:" in result.stdout
    shown = subprocess.run(
        [installed_cli, "--help"], cwd=root / "elsewhere", capture_output=True, text=True, check=True
    ).stdout
    assert "  grpo_math            GRPO on the synthetic arithmetic task" in shown
    assert any(
        line.startswith("  trainer.total_steps=100 ") and "training steps" in line for line in shown.splitlines()
    )


def test_tensorboard_holds_the_same_scalars_as_metrics_jsonl(three_step_run):
    root, _ = three_step_run
    rows = read_metrics(root / "run" / "metrics.jsonl")
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "timestamp") and isinstance(value, (int, float)):
                expected.setdefault(key, {})[row["step"]] = value
    logged = tensorboard_scalars(root / "run" / "tensorboard")
    assert set(logged) == set(expected) and "eval/accuracy" in logged and "time/elapsed_s" in logged
    for key, by_step in expected.items():
        assert logged[key] == pytest.approx(by_step, rel=1e-6), key  # TensorBoard keeps float32


def test_the_run_plots_itself_with_the_data_behind_each_plot(three_step_run):
    root, result = three_step_run
    plots = root / "run" / "plots"
    assert f"plots in {plots}" in result.stdout
    # each plot's data: one row per step (0 is the evaluation before training) and the series of every step
    for name, steps, series in (
        ("reward", [0, 1, 2, 3], ["reward/mean"]),
        ("time", [1, 2, 3], ["time/generate_s", "time/train_step_s", "time/sync_s"]),
        ("logprob_gap", [1, 2, 3], ["actor/logprob_diff"]),
        ("response_length", [1, 2, 3], ["response/length_mean"]),
        ("outcomes", [1, 2, 3], ["outcome/scored", "outcome/reward_error", "outcome/retries"]),
    ):
        assert (plots / f"{name}.png").stat().st_size > 10_000
        with (plots / f"{name}.csv").open() as f:
            table = list(csv.DictReader(f))
        assert [int(r["step"]) for r in table] == steps, name
        assert all(r[key] != "" for r in table if r["step"] != "0" for key in series), name
    rows = {r["step"]: r for r in read_metrics(root / "run" / "metrics.jsonl")}
    with (plots / "reward.csv").open() as f:
        for r in csv.DictReader(f):
            assert float(r["time/elapsed_s"]) == pytest.approx(rows[int(r["step"])]["time/elapsed_s"])
            if r["eval/accuracy"]:
                assert float(r["eval/accuracy"]) == pytest.approx(rows[int(r["step"])]["eval/accuracy"])


def test_the_rollout_inspector_of_the_wheel_shows_what_each_step_trained_on(three_step_run, installed_cli, tmp_path):
    """`rl-tpu inspect RUN` writes the page from the wheel's own files; a headless Chromium checks it by the DOM
    (tests/browser.py: the step list, each sample's tokens and mask, a filter, a token's figures, no console errors)."""
    from browser import check_page, start_browser

    root, _ = three_step_run
    run = root / "run"
    shown = subprocess.run([installed_cli, "inspect", run], capture_output=True, text=True, check=True, timeout=120)
    assert shown.stdout.strip() == str(run / "inspect.html")
    driver = start_browser()
    try:
        seen = check_page(driver, run, tmp_path / "inspect.png")
    finally:
        driver.quit()
    assert (tmp_path / "inspect.png").stat().st_size > 10_000 and seen["step"] == 3  # the last step, first
    assert all(len(row["output_pieces"]) == len(row["logprobs"]) == len(row["output_ids"]) for row in seen["recorded"])
    assert any("trainer_logprobs" in row for row in seen["recorded"])  # the rows the update ran


def test_metrics_are_well_formed(three_step_run):
    root, result = three_step_run
    rows = read_metrics(root / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3]
    passes = ["eval/pass@1", "eval/pass@2", "eval/pass@4"]  # sampled at the first and the last evaluation only
    assert not any(key in rows[2] for key in passes)
    for row in rows[0], rows[3]:
        assert 0.0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1.0, row
    for step, row in enumerate(rows[1:], start=1):
        assert STEP_KEYS <= set(row), STEP_KEYS - set(row)
        assert row["sync/version"] == step and row["rollout/weight_version"] == step - 1
        assert row["sync/transport"] == "collective"
        assert 0.0 < row["time/publish_s"] < row["time/sync_s"]  # the engines' receive is the rest
        assert 0.0 <= row["reward/mean"] <= 1.0 and row["perf/train_tokens"] > 0
        assert row["actor/logprob_diff"] < 1e-5, "sampler and trainer disagree on the logprobs of the same tokens"
        assert row["actor/logprob_diff_max"] < 1e-4, "a token's logprob differs between sampler and trainer"
    assert "held-out accuracy:" in result.stdout
    assert (root / "run" / "resolved_config.yaml").is_file()


def test_export_loads_in_transformers_with_the_trainer_weights(three_step_run):
    """The export's logits equal those of the trainer's own final state (its DCP checkpoint), and differ from the start."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = three_step_run
    export = root / "run" / "export"
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export)

    dcp_to_torch_save(root / "run" / "checkpoints" / "step_3", root / "trainer_state.pt")
    trainer_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    missing, unexpected = trainer_model.load_state_dict(torch.load(root / "trainer_state.pt")["model"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding

    (initial,) = (root / "cache" / "models").glob("tiny_arith-*")
    start = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer("Q: What is 5 + 9? A: 14")["input_ids"]])
    with torch.no_grad():
        logits = exported(ids).logits
        assert torch.equal(logits, trainer_model(ids).logits)
        assert not torch.equal(logits, start(ids).logits), "three GRPO steps left the weights unchanged"


EXACT_KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/logprob_diff", "eval/accuracy")


def assert_same_steps(rows: list[dict], reference_run, keys: tuple[str, ...] = ()) -> None:
    """Each row equals the reference run's row of the same step, bit for bit, on the keys that decide learning
    (and `keys`)."""
    whole = {r["step"]: r for r in read_metrics(reference_run / "metrics.jsonl")}
    exact = EXACT_KEYS + keys
    for row in rows:
        assert {k: row.get(k) for k in exact} == {k: whole[row["step"]].get(k) for k in exact}, row["step"]
    last, before = sorted(whole)[-1], sorted(whole)[-2]
    assert whole[last]["actor/grad_norm"] != whole[before]["actor/grad_norm"]  # the steps differ: it can fail


def logits_of(folder, ids):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits


def test_the_export_cli_turns_any_checkpoint_into_a_hugging_face_folder(three_step_run):
    """Mid-run (step 2): the logits equal the trainer state's, read by torch's own DCP converter. Final (step 3):
    they equal the trainer's own export, bit for bit. In bf16: half the bytes, and a model card."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, _ = three_step_run
    run = root / "run"
    for step in (2, 3):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rl_tpu.export",
                str(run / "checkpoints" / f"step_{step}"),
                str(root / f"exported_{step}"),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
    ids = torch.tensor([AutoTokenizer.from_pretrained(root / "exported_2")("Q: What is 5 + 9? A: 14")["input_ids"]])

    dcp_to_torch_save(run / "checkpoints" / "step_2", root / "step_2.pt")
    reference = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).eval()
    reference.load_state_dict(torch.load(root / "step_2.pt")["model"], strict=False)
    with torch.no_grad():
        mid_run, final = logits_of(root / "exported_2", ids), logits_of(root / "exported_3", ids)
        assert torch.equal(mid_run, reference(ids).logits)
        assert torch.equal(final, logits_of(run / "export", ids))
        assert not torch.equal(mid_run, final)  # the steps differ: the comparisons can fail

    subprocess.run(
        [sys.executable, "-m", "rl_tpu.export", str(run), str(root / "exported_bf16"), "--dtype", "bfloat16"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    size = lambda folder: sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # noqa: E731
    assert abs(size(root / "exported_bf16") * 2 - size(root / "exported_3")) < 1e5
    card = (root / "exported_bf16" / "README.md").read_text()
    assert "recipe: `grpo_math`" in card and "checkpoint step_3" in card and "weights in bfloat16" in card
    assert "rl-tpu +recipe=grpo_math" in card and "trainer.total_steps=3" in card
    assert "recipe: `grpo_math`; exported from the end of the run" in (run / "export" / "README.md").read_text()


def test_resume_continues_exactly_where_the_run_stopped(three_step_run, six_step_run):
    """Stopped after step 3 of 6 and resumed in a new folder: steps 4-6 equal those of a run that never stopped."""
    root, _ = three_step_run
    run_cli(
        root / "resumed",
        root / "cache",
        "trainer.total_steps=6",
        f"trainer.resume_from={root / 'run'}",
        "sync.transport=shm_file",
        f"sync.shm_dir={root / 'shm'}",
    )
    rows = read_metrics(root / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [3, 4, 5, 6]
    assert rows[0]["sync/version"] == 3 and rows[1]["rollout/weight_version"] == 3 and rows[3]["sync/version"] == 6
    assert rows[3]["sync/transport"] == "shm_file" and rows[3]["sync/buckets"] >= 1
    assert_same_steps(rows[1:], six_step_run)
    log = (root / "resumed" / "main.log").read_text()  # settings that change nothing learned: logged, accepted
    assert "with trainer.total_steps=6 (it was written with 3)" in log and "with sync.transport='shm_file'" in log


def test_resuming_with_a_changed_dtype_is_refused_before_ray_starts(three_step_run, tmp_path):
    root, _ = three_step_run
    command = cli_command(
        tmp_path / "run", root / "cache", f"trainer.resume_from={root / 'run'}", "model.dtype=bfloat16"
    )
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "Started a local Ray instance" not in result.stdout + result.stderr
    assert "model.dtype: 'float32' -> 'bfloat16'. Resume with the checkpoint's values" in result.stderr
    assert "trainer.resume_allow_changes=[model.dtype]" in result.stderr


def test_an_evaluation_only_run_of_the_export_repeats_the_runs_last_evaluation(three_step_run, tmp_path):
    """`trainer.total_steps=0` evaluates a model folder as a run evaluates its policy: the 3-step run's export
    gets that run's last greedy accuracy and pass@k (the same weights, held-out prompts and sampling seeds)."""
    root, _ = three_step_run
    result = run_cli(
        tmp_path / "eval",
        root / "cache",
        f"model.path={root / 'run' / 'export'}",
        "trainer.total_steps=0",
        "trainer.eval_pass_k=4",
        "trainer.world_size=1",
        "trainer.export=false",
    )
    (only,) = read_metrics(tmp_path / "eval" / "metrics.jsonl")
    last = read_metrics(root / "run" / "metrics.jsonl")[-1]
    keys = ["eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4"]
    assert {key: only[key] for key in keys} == {key: last[key] for key in keys}
    assert "(evaluation only)" in result.stdout and not (tmp_path / "eval" / "checkpoints").exists()


def test_export_loads_in_vllm_with_the_same_greedy_output(three_step_run, ray_cluster):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_tpu.sampler.engine import SamplingSettings, launch_sampler

    export = three_step_run[0] / "run" / "export"
    tokenizer = AutoTokenizer.from_pretrained(export)
    prompt = tokenizer("Q: What is 31 + 4? A:")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=0, pad_token_id=1
    )[0, len(prompt) :].tolist()
    sampler = launch_sampler(str(export), "float32", 64, 0.25, seed=0)
    (rollout,) = ray_cluster.get(
        sampler.generate.remote([prompt], SamplingSettings(n=1, temperature=0.0, max_tokens=6))
    )
    ray_cluster.get(sampler.shutdown.remote())
    assert rollout.completion_ids == expected[: len(rollout.completion_ids)]
    assert len(rollout.completion_ids) == len(expected) or rollout.completion_ids[-1] == 0


def test_verl_gsm8k_parquet_trains_two_steps(tmp_path, monkeypatch):
    """verl's GSM8K parquet (from the prepare script) through the CLI, with the gsm8k + format rewards; and a loss
    and an estimator by import path from a module in the folder the run starts in (tests/fixtures/custom_losses.py):
    the driver registers the estimator for the advantages, the trainer rank, a Ray actor that imports afresh, the
    loss, whose own figure reaches metrics.jsonl."""
    from recipes.grpo_gsm8k.prepare import main as prepare

    prepare(["--input_dir", str(REPO / "tests" / "fixtures" / "gsm8k"), "--output_dir", str(tmp_path / "data")])
    # the checkout on the path: tests/fixtures/rewards, a folder of plugins, would otherwise stand for the package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    run_cli(
        tmp_path / "run",
        tmp_path / "cache",
        "trainer.total_steps=2",
        "model.tiny.max_position_embeddings=1024",
        f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
        f"data.val_files={tmp_path / 'data' / 'test.parquet'}",
        "data.max_prompt_length=512",
        "reward.name=gsm8k",
        "+reward.combine={gsm8k: 1.0, format: 0.1}",
        "trainer.world_size=1",
        "actor.policy_loss.loss_mode=custom_losses:halved_vanilla",
        "algorithm.adv_estimator=custom_losses:doubled_rloo",
        cwd=REPO / "tests" / "fixtures",
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert {"reward/gsm8k", "reward/format", "reward/failed", "time/reward_s"} <= set(row)
        assert row["reward/failed"] == 0 and row["sync/version"] == row["step"] and row["actor/halved_vanilla"] == 1.0
        assert row["reward/mean"] == pytest.approx(row["reward/gsm8k"] + 0.1 * row["reward/format"])
    assert {"eval/accuracy", "eval/gsm8k", "eval/format"} <= set(rows[2])


def test_async_mode_generates_ahead_with_stale_weights_and_corrects_them(tmp_path):
    """trainer.max_staleness=1: batch t comes from weights t-2 (after the first), reweighted by TIS. The run also
    puts the KL to the initial weights in the reward, with verl's adaptive controller, and lends the idle engine's
    core to the trainer."""
    run_cli(
        tmp_path / "run",
        tmp_path / "cache",
        "trainer.total_steps=4",
        "trainer.max_staleness=1",
        "trainer.world_size=1",
        "trainer.borrow_idle_cores=true",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=100",
    )
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert [r["sync/version"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert 0.5 < row["actor/rollout_is_mean"] < 1.5 and 0.0 <= row["actor/rollout_is_ratio_fraction_high"] <= 1.0
    # pinned (2 CPUs: one each), the trainer computes on the engine's core while the engine waits for weights
    borrowed = [r["time/trainer_borrowed_s"] for r in rows]
    assert all(0.0 <= b <= r["time/train_s"] for b, r in zip(borrowed, rows))
    assert (sum(borrowed) > 0.0) == (len(os.sched_getaffinity(0)) >= 2), borrowed
    # fresh rollouts agree with the trainer to float precision; stale ones were made by other weights
    assert rows[0]["actor/logprob_diff"] < 1e-5 and all(r["actor/logprob_diff"] > 1e-5 for r in rows[1:])
    # step 1 trains the initial weights, the reference itself (k3 is positive for any other policy; k1 can be
    # negative on a batch); the coefficient moves by verl's rule, counting 16 sequences
    kl, coef = [r["actor/reward_kl_penalty"] for r in rows], [r["actor/reward_kl_penalty_coeff"] for r in rows]
    assert kl[0] == 0.0 and all(k > 0.0 for k in kl[1:]) and coef[0] == 0.001
    for step in range(3):
        error = min(max(kl[step] / 0.1 - 1, -0.2), 0.2)
        assert coef[step + 1] == pytest.approx(coef[step] * (1 + error * 16 / 100), rel=1e-9)


TRANSPORT_PLUGIN = "handshake_transport:HandshakeStore"  # tests/fixtures/handshake_transport.py


def test_bf16_run_with_a_verl_plugin_and_a_transport_plugin(three_step_run, tmp_path, monkeypatch):
    """model.dtype=bfloat16 (the real-model recipes' setting): bf16 engine, bf16 bundles of half the bytes;
    examples/custom_reward's plugin, written for verl, given with verl's custom_reward_function keys; and a weight
    transport defined outside rl_tpu, named by import path: the controller runs its handshake, the engines attach
    it, and every sync goes through it (an engine refuses a bucket that skipped a hook). One run for the three: each
    CLI run costs the suite its start-up."""
    # the transport's module importable in the driver and, through the environment Ray's workers inherit, in every
    # actor
    path = [str(REPO / "tests" / "fixtures"), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    run_cli(
        tmp_path / "run",
        three_step_run[0] / "cache",
        "trainer.total_steps=2",
        "model.dtype=bfloat16",
        "trainer.world_size=1",
        "custom_reward_function.path=examples/custom_reward/reward.py",
        "custom_reward_function.name=compute_score",
        f"sync.transport={TRANSPORT_PLUGIN}",
    )
    fp32 = read_metrics(three_step_run[0] / "run" / "metrics.jsonl")[1]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for step, row in enumerate(rows[1:], start=1):
        assert row["sync/transport"] == TRANSPORT_PLUGIN and row["sync/version"] == step
        assert row["sync/bytes"] * 2 == fp32["sync/bytes"]
        # bf16 rounding on both sides: far above fp32's 1e-7, far below a mismatched model's ~1
        assert 1e-5 < row["actor/logprob_diff"] < 0.05
        assert row["reward/failed"] == 0 and "reward/custom" in row
        # the plugin's dict fields: exact-match rate and answer rate, next to its partial-credit score
        assert 0.0 <= row["reward/extra/custom/exact"] <= row["reward/custom"] + 1e-9
        assert row["reward/extra/custom/answered"] >= row["reward/extra/custom/exact"]
    assert "eval/extra/custom/exact" in rows[2]


def test_a_failing_plugin_stops_the_run_with_its_name_and_traceback(tmp_path):
    plugin = tmp_path / "broken_reward.py"
    plugin.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    raise KeyError('answer_field')\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "rl_tpu.main",
        "+recipe=grpo_math",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"cache_dir={tmp_path / 'cache'}",
        "model.tiny.warm_start_steps=0",
        "data.num_eval=16",
        "trainer.total_steps=2",
        f"reward.custom.path={plugin}",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "RewardError" in result.stderr and f"{plugin}:compute_score" in result.stderr
    # judged as results arrive: it stops once more than 10% of the 16 failed, the rest not scored
    assert (
        re.search(r"\d+ of 16 samples failed to score", result.stderr) and "KeyError: 'answer_field'" in result.stderr
    )
