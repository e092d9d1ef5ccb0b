"""The train-step settings that need processes of their own or a compiler (the rest, in one process:
tests/unit/test_train_step_settings.py): the compiled step gives the eager loss, and two FSDP2 ranks whose
completions differ in length run the same forwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import one_step, shared_prompt_batch


@pytest.fixture(scope="module")
def batch():
    return shared_prompt_batch()


def test_the_compiled_step_gives_the_eager_loss(tiny_model_dir, batch):
    """Compiled with the prompts run once per group (the default), against eager whole sequences."""
    eager, eager_grads = one_step(tiny_model_dir, batch, sort_by_length=False)
    compiled, compiled_grads = one_step(tiny_model_dir, batch, sort_by_length=False, compile=True, share_prompts=True)
    assert compiled["actor/loss"] == pytest.approx(eager["actor/loss"], rel=1e-5, abs=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def rank_step(rank: int, port: int, model_dir: str, batch, results) -> None:
    """One rank of a two-rank trainer (gloo) in a process of its own: its step's metrics, or its error."""
    from rl_tpu.config import RunConfig
    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.trainer.micro_batch_size, cfg.trainer.sort_by_length = "cpu", "float32", 2, False
    try:
        worker = TrainerWorker(cfg, model_dir, rank, 2, "127.0.0.1", port)
        results.put((rank, worker.train_step(batch)))
        worker.shutdown()
    except Exception as err:  # reported to the test, which would otherwise wait for a rank that is gone
        results.put((rank, repr(err)))


def test_ranks_whose_completions_differ_in_length_run_the_same_forwards(tiny_model_dir, batch):
    """Shared prompts (the default) run the prompts, then the completions: a rank whose micro-batch held only
    one-token completions once skipped the second forward, and FSDP's collectives, paired across the ranks,
    deadlocked the step (seen when the rows without advantage were topped up with the shortest ones). Each rank
    here gets such a micro-batch against the other's longer ones; both must finish the same step."""
    import multiprocessing
    import queue

    from conftest import free_port

    mixed = dataclasses.replace(
        batch,
        completion_ids=[c[:1] if i < 6 else c for i, c in enumerate(batch.completion_ids)],
        sampler_logprobs=[s[:1] if i < 6 else s for i, s in enumerate(batch.sampler_logprobs)],
        advantages=[a[:1] if i < 6 else a for i, a in enumerate(batch.advantages)],
    )
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    ranks = [context.Process(target=rank_step, args=(r, port, str(tiny_model_dir), mixed, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        finished = dict(results.get(timeout=180) for _ in ranks)
    except queue.Empty:
        finished = None
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert finished is not None, "a rank did not finish its step within 180 s: the ranks' collectives deadlocked"
    assert all(isinstance(m, dict) for m in finished.values()), finished
    assert finished[0]["actor/loss"] == finished[1]["actor/loss"]  # summed over both ranks: the same step
    # the largest engine-trainer gap of any token, whichever rank holds it: that of one rank given every row
    single = one_step(tiny_model_dir, mixed, sort_by_length=False)[0]["actor/logprob_diff_max"]
    assert finished[0]["actor/logprob_diff_max"] == finished[1]["actor/logprob_diff_max"]
    assert finished[0]["actor/logprob_diff_max"] == pytest.approx(single, rel=1e-5)
    assert single > finished[0]["actor/logprob_diff"] > 0
