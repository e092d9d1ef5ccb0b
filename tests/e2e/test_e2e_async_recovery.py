"""An async run stopped by SIGTERM and resumed, end to end through the CLI: the steps after the stop equal an
uninterrupted run's, on the batches it had queued ahead. Apart from test_e2e_recovery.py so that the suite's two
workers share the recovery tests' time (one file runs on one worker)."""

from __future__ import annotations

import json
import signal

from conftest import run_cli, start_cli, wait_for_step
from test_e2e import assert_same_steps
from test_e2e_recovery import finish

from rl_tpu.outputs import rollout_log
from rl_tpu.outputs.metrics import read_metrics


def async_run(staleness: int, dynamic: bool, run_dir) -> tuple[str, ...]:
    return (
        f"trainer.max_staleness={staleness}",
        f"algorithm.filter_groups.enable={str(dynamic).lower()}",
        "custom_reward_function.path=tests/fixtures/rewards/digits.py",  # learnable from random weights: they move
        "trainer.world_size=1",
        "trainer.total_steps=6",
        "trainer.checkpoint_every=0",
        "trainer.eval_every=6",  # evaluations at the start and the end only: they are not what is compared
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
    )


def trained_prompts(run_dir) -> dict[int, list[int]]:
    """Each step's trained prompts, by their row in the training file (a prompt once per sample)."""
    return {step: [row["index"] for row in rows] for step, rows in rollout_log.read_steps(run_dir / "rollouts").items()}


def test_an_async_run_stopped_by_sigterm_resumes_exactly_on_the_generations_it_had_queued(tmp_path):
    """Async (with dynamic sampling at staleness 2), stopped by SIGTERM and resumed with `trainer.resume=auto`: the steps after the
    stop equal those of the run that never stopped, and so do the prompts trained over the run, since the
    checkpoint saved the batches queued ahead (generated with older weights than its own) and the prompt stream's
    position counts generation batches, not steps.

    One case, three runs: staleness 2 with dynamic sampling queues the most and restores the generation-batch count
    too; staleness 1 without dynamic sampling takes the same path with less queued (the suite ran both until
    2026-12-07, 150-300 s each)."""
    staleness, dynamic = 2, True
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    run_cli(whole, tmp_path / "cache", *async_run(staleness, dynamic, whole))
    process = start_cli(run_dir, tmp_path / "cache", *async_run(staleness, dynamic, run_dir))
    wait_for_step(run_dir, 2, process)
    process.send_signal(signal.SIGTERM)
    output = finish(process, run_dir, timeout_s=120)
    assert process.returncode == 143, output[-3000:]
    stopped = read_metrics(run_dir / "metrics.jsonl")[-1]["step"]
    assert 2 <= stopped < 6
    queued = json.loads((run_dir / "checkpoints" / f"step_{stopped}" / "queued.json").read_text())
    assert len(queued) == min(staleness + 1, 6 - stopped) and all(batch["rollouts"] for batch in queued)

    run_cli(run_dir, tmp_path / "cache", *async_run(staleness, dynamic, run_dir), "trainer.resume=auto")
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    # the first step after the stop trained on what the stopped run queued: weights older than the checkpoint's,
    # which a batch made again after the resume would have come from
    assert rows[stopped + 1]["rollout/weight_version"] < stopped
    assert_same_steps(rows, whole, keys=("data/gen_batches", "rollout/weight_version"))
    # no prompt skipped or trained twice: each step trained the same prompts (so the run, the same multiset)
    assert trained_prompts(run_dir) == trained_prompts(whole)
    assert len(trained_prompts(whole)) == 6 and min(map(min, trained_prompts(whole).values())) >= 0
