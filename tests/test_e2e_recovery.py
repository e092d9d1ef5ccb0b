"""What goes wrong during a run, end to end through the CLI: preemption, a lost engine, a lost trainer rank,
a non-finite update. Each recovered run must equal an uninterrupted one (`six_step_run`), step for step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time

import pytest

from conftest import actor_pid, run_cli, start_cli, wait_for_step
from rl_tpu.metrics import read_metrics
from test_e2e import assert_same_steps

pytestmark = pytest.mark.e2e


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

    run_cli(run_dir, tmp_path / "cache", "trainer.total_steps=6", "trainer.checkpoint_every=0", "trainer.resume=auto")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # one file, each step once
    assert_same_steps(rows, six_step_run)


def kill_mid_run(tmp_path, actor: str, after_step: int) -> tuple[str, list[dict]]:
    """A 6-step run whose `actor` process is SIGKILLed once step `after_step` is logged; its output and metrics."""
    run_dir = tmp_path / "run"
    process = start_cli(run_dir, tmp_path / "cache", "trainer.total_steps=6")
    wait_for_step(run_dir, after_step, process)
    os.kill(actor_pid(run_dir, actor), signal.SIGKILL)
    output = finish(process, run_dir)
    assert process.returncode == 0, output[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    return output, rows


def test_a_killed_engine_is_restarted_in_place_and_no_sample_is_lost(six_step_run, tmp_path):
    output, rows = kill_mid_run(tmp_path, "sampler_0", after_step=1)
    assert output.count("sampler_0 restarted (restart 1 of sampler.max_restarts=2)") == 1
    assert "restarting every actor" not in output  # the trainer ranks kept going
    assert all(r["rollout/samples"] == 16 for r in rows[1:]) and rows[-1]["sampler/restarts"] == 1
    assert_same_steps(rows, six_step_run)  # the replacement drew the same tokens with the same weights


def test_a_killed_trainer_rank_restarts_the_run_from_its_last_checkpoint(six_step_run, tmp_path):
    output, rows = kill_mid_run(tmp_path, "trainer_1", after_step=2)
    assert output.count("restarting every actor from the last checkpoint (restart 1 of trainer.max_restarts=1)") == 1
    assert "resumed from" in output
    assert_same_steps(rows, six_step_run)


OVERFLOWING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "overflow":
        return 1e39  # finite here, infinite in the float32 advantage computation: NaN advantages, NaN loss
    return float(solution_str.strip() == ground_truth)
'''


def test_a_non_finite_loss_skips_that_update_and_the_run_goes_on(tmp_path):
    """One prompt's reward overflows float32: every step whose batch holds it is skipped and counted."""
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(7)]
    rows.insert(3, {"question": "What is 1 + 1?", "answer": "overflow"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    (tmp_path / "reward.py").write_text(textwrap.dedent(OVERFLOWING_REWARD))
    run_cli(tmp_path / "run", tmp_path / "cache", "trainer.total_steps=4", "trainer.world_size=1",
            f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'val.jsonl'}",
            "data.prompt_key=question", "data.answer_key=answer", f"reward.custom.path={tmp_path / 'reward.py'}")
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]
    # 8 prompts in batches of 4: the overflowing one is in exactly one batch of each epoch (steps 1-2, 3-4)
    skipped = [r["step"] for r in metrics if r["actor/skipped"]]
    assert len(skipped) == 2 and skipped[0] in (1, 2) and skipped[1] in (3, 4), skipped
    assert [r["actor/skipped_steps"] for r in metrics] == [sum(s <= r["step"] for s in skipped) for r in metrics]
    for row in metrics:
        assert ("actor/loss" in row) != bool(row["actor/skipped"])  # a skipped step logs no loss
    assert metrics[-1]["step"] == 4 and metrics[-1]["sync/version"] == 4  # the run went on to the end
