"""What goes wrong during a run, end to end through the CLI: preemption, a lost engine, a lost trainer rank,
a non-finite update. Each recovered run must equal an uninterrupted one (`six_step_run`), step for step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import psutil
from conftest import REPO, actor_pid, cli_command, run_cli, start_cli, wait_for_step
from test_e2e import assert_same_steps

from rl_tpu.outputs.metrics import read_metrics


def finish(process: subprocess.Popen, run_dir, timeout_s: float = 300) -> str:
    """Wait for a background run; returns its output."""
    process.wait(timeout=timeout_s)
    return open(f"{run_dir}.out").read()


def test_sigterm_saves_stops_and_resume_auto_continues_exactly(six_step_run, tmp_path):
    run_dir = tmp_path / "run"
    process = start_cli(run_dir, tmp_path / "cache", "trainer.total_steps=6", "trainer.checkpoint_every=0")
    wait_for_step(run_dir, 2, process)
    stopped_at = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output = finish(process, run_dir, timeout_s=60)
    assert time.monotonic() - stopped_at < 60
    assert process.returncode == 143, output[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    # checkpoint_every=0: the only checkpoint is the one the signal asked for, after the last finished step
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{steps[-1]}"]
    assert 2 <= steps[-1] < 6 and f"SIGTERM after step {steps[-1]}" in output
    assert f"hydra.run.dir={run_dir} trainer.resume=auto" in output

    with open(run_dir / "metrics.jsonl", "a") as metrics:  # what a crash in the middle of a write leaves
        metrics.write('{"step": 9, "reward/me')
    resumed = run_cli(
        run_dir, tmp_path / "cache", "trainer.total_steps=6", "trainer.checkpoint_every=0", "trainer.resume=auto"
    )
    assert "is torn" in resumed.stdout + resumed.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # one file, each step once
    assert_same_steps(rows, six_step_run)


def test_a_killed_engine_restarts_alone_and_a_killed_trainer_rank_restarts_the_run(six_step_run, tmp_path):
    """One 6-step run, two SIGKILLs: the engine after step 1 (Ray restarts it in place, given the served weights,
    and its prompts are generated again), then a trainer rank after step 3 (every actor restarts from the last
    checkpoint). The run still equals one that was never interrupted, step for step."""
    run_dir = tmp_path / "run"
    process = start_cli(run_dir, tmp_path / "cache", "trainer.total_steps=6")
    wait_for_step(run_dir, 1, process)
    os.kill(actor_pid(run_dir, "sampler_0"), signal.SIGKILL)
    wait_for_step(run_dir, 3, process)
    assert read_metrics(run_dir / "metrics.jsonl")[3]["sampler/restarts"] == 1  # the engine alone came back
    os.kill(actor_pid(run_dir, "trainer_1"), signal.SIGKILL)
    output = finish(process, run_dir)
    assert process.returncode == 0, output[-3000:]
    assert output.count("sampler_0 restarted (restart 1 of sampler.max_restarts=2)") == 1
    # one whole restart (the trainer rank's): the engine's loss did not cause one
    assert output.count("restarting every actor from the last checkpoint (restart 1 of trainer.max_restarts=1)") == 1
    assert "restart 2 of trainer.max_restarts" not in output and "resumed from" in output
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert all(r["rollout/samples"] == 16 for r in rows[1:])  # no sample lost
    assert_same_steps(rows, six_step_run)  # the replacements drew the same tokens with the same weights


OVERFLOWING_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "overflow":
        return 1e39  # finite here, infinite in the float32 advantage computation: NaN advantages, NaN loss
    return float(solution_str.strip() == ground_truth)
"""


def test_a_non_finite_loss_skips_that_update_and_the_run_goes_on(tmp_path):
    """One prompt's reward overflows float32: every step whose batch holds it is skipped and counted."""
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(7)]
    rows.insert(3, {"question": "What is 1 + 1?", "answer": "overflow"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (tmp_path / "reward.py").write_text(textwrap.dedent(OVERFLOWING_REWARD))
    run_cli(
        tmp_path / "run",
        tmp_path / "cache",
        "trainer.total_steps=4",
        "trainer.world_size=1",
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
        "data.prompt_key=question",
        "data.answer_key=answer",
        f"reward.custom.path={tmp_path / 'reward.py'}",
    )
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]
    # 8 prompts in batches of 4: the overflowing one is in exactly one batch of each epoch (steps 1-2, 3-4)
    skipped = [r["step"] for r in metrics if r["actor/skipped"]]
    assert len(skipped) == 2 and skipped[0] in (1, 2) and skipped[1] in (3, 4), skipped
    assert [r["actor/skipped_steps"] for r in metrics] == [sum(s <= r["step"] for s in skipped) for r in metrics]
    for row in metrics:
        assert ("actor/loss" in row) != bool(row["actor/skipped"])  # a skipped step logs no loss
    assert metrics[-1]["step"] == 4 and metrics[-1]["sync/version"] == 4  # the run went on to the end


HANGING_REWARD = """
import pathlib, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pathlib.Path({marker!r}).touch()
    time.sleep(3600)
"""


def test_a_second_sigterm_while_a_reward_hangs_ends_the_driver_at_once_and_no_worker_outlives_it(tmp_path):
    """The first signal waits for the step, which waits for a plugin that never answers; the second stops the
    driver at once (not after reward.timeout_s), and its reward workers end with it."""
    marker, plugin, run_dir = tmp_path / "hung", tmp_path / "reward.py", tmp_path / "run"
    plugin.write_text(HANGING_REWARD.format(marker=str(marker)))
    process = start_cli(
        run_dir,
        tmp_path / "cache",
        "trainer.world_size=1",
        f"custom_reward_function.path={plugin}",
        "reward.timeout_s=600",
    )
    deadline = time.monotonic() + 300
    while not marker.exists():  # the first evaluation's grading has started, and hangs
        assert process.poll() is None, open(f"{run_dir}.out").read()[-3000:]
        assert time.monotonic() < deadline, "the reward plugin was never called"
        time.sleep(0.2)
    workers = [
        p for p in psutil.Process(process.pid).children(recursive=True) if "rl_tpu.grader.processes" in p.cmdline()
    ]
    assert workers
    process.send_signal(signal.SIGTERM)
    time.sleep(1)
    second, out = time.monotonic(), Path(f"{run_dir}.out")
    process.send_signal(signal.SIGTERM)
    # the driver's own stop (actors shut down, reward workers killed) ends with this line: seconds, not timeout_s
    while "second SIGTERM: stopping without saving" not in out.read_text():
        assert time.monotonic() - second < 30, out.read_text()[-3000:]
        time.sleep(0.1)
    # then Ray's teardown of its own processes at exit (a second each, more on a loaded host: 33 s once in CI)
    process.wait(timeout=90)
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive, [p.pid for p in alive]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_refused_resume_leaves_the_run_folder_as_it_was(six_step_run, tmp_path):
    """Refused before Ray starts, for changed settings, for another held-out set in the same folder, and for a
    checkpoint missing a file the resume reads: every file of the folder keeps its bytes (resolved_config.yaml and
    .hydra/ among them), and no line offers the refused command as a way to continue."""
    run_dir = tmp_path / "run"
    shutil.copytree(six_step_run, run_dir)  # the session's run stays as it is
    cache = six_step_run.parent / "cache"  # the refusals come before the cache is read
    refusals = [
        ("model.dtype=bfloat16", "model.dtype: 'float32' -> 'bfloat16'. Resume with the checkpoint's values"),
        ("data.val_max_samples=8", "in its own run folder with another held-out set (data.val_max_samples: None -> 8)"),
        ("trainer.total_steps=6", "step_6 has no queued.json (the generations queued ahead)"),
    ]
    for override, message in refusals:
        if "queued.json" in message:
            (run_dir / "checkpoints" / "step_6" / "queued.json").unlink()
        before = folder_bytes(run_dir)
        command = cli_command(run_dir, cache, "trainer.total_steps=6", "trainer.resume=auto", override)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 1 and message in result.stderr, output[-3000:]
        assert "Started a local Ray instance" not in output and "it can continue" not in output
        assert folder_bytes(run_dir) == before
