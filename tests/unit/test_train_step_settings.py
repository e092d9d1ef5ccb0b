"""The train-step settings that make it faster change nothing they should not: sequences sorted by length give
the padded loss and gradients (fp32, 1e-6), so do prompts run once per group (`share_prompts`) and rows left
out for having no advantage, bf16 stays within stated tolerances of fp32, and the compiled step gives the
eager loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import make_batch, one_step


@pytest.fixture(scope="module")
def batch():
    """Prompts of 3-9 and completions of 1-7 tokens; the three groups of 4 share their prompts, as in GRPO."""
    batch = make_batch(seed=11, size=12, temperature=1.0)
    return dataclasses.replace(batch, prompt_ids=[batch.prompt_ids[i - i % 4] for i in range(len(batch))])


@pytest.fixture(scope="module")
def fp32_step(tiny_model_dir, batch):
    return one_step(tiny_model_dir, batch, sort_by_length=False)


def test_sorting_by_length_cuts_padding_and_changes_neither_loss_nor_gradients(tiny_model_dir, batch, fp32_step):
    padded, padded_grads = fp32_step
    sorted_, sorted_grads = one_step(tiny_model_dir, batch, sort_by_length=True)
    assert sorted_["perf/padding_frac"] < padded["perf/padding_frac"]
    assert sorted_["perf/train_positions"] == padded["perf/train_positions"]
    assert sorted_["actor/loss"] == pytest.approx(padded["actor/loss"], rel=1e-5, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(sorted_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "checkpointing,buckets",
    [(False, []), (True, []), (False, [16])],
    ids=["", "activation_checkpointing", "seq_buckets"],
)
def test_prompts_run_once_per_group_give_the_whole_sequence_loss_and_gradients(
    tiny_model_dir, batch, fp32_step, checkpointing, buckets
):
    """One micro-batch holds the three groups, so each row must get its own group's prompt back; a block that
    activation checkpointing runs again must see the keys and values it saw the first time; with length
    buckets the prompts' forward runs four rows, the last prompt twice, and the repeat must change nothing."""
    whole, whole_grads = fp32_step
    shared, shared_grads = one_step(
        tiny_model_dir,
        batch,
        sort_by_length=False,
        share_prompts=True,
        micro_batch_size=len(batch),
        activation_checkpointing=checkpointing,
        seq_buckets=buckets,
    )
    prompt_tokens = sum(map(len, batch.prompt_ids))
    lengths = list(map(len, batch.completion_ids))
    assert whole["perf/train_positions"] == prompt_tokens + sum(lengths)
    # each group's prompt once; the last completion column predicts nothing, so it is not run (with buckets it
    # is padding, and every completion token is run)
    last = 16 if buckets else max(lengths) - 1
    assert shared["perf/train_positions"] == prompt_tokens / 4 + sum(min(n, last) for n in lengths)
    assert shared["actor/loss"] == pytest.approx(whole["actor/loss"], rel=1e-5, abs=1e-6)
    assert shared["actor/entropy"] == pytest.approx(whole["actor/entropy"], rel=1e-5, abs=1e-6)
    assert shared["actor/logprob_diff"] == pytest.approx(whole["actor/logprob_diff"], rel=1e-5, abs=1e-6)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_training_stays_within_tolerance_of_fp32(tiny_model_dir, batch, fp32_step):
    """bf16 compute (fp32 master weights, the fp32 residual stream, eager attention on CPU) against fp32: loss
    and entropy within 1e-2, each parameter's gradient within 5% in norm and at cosine > 0.999 (measured on
    this batch: 2.4% and 0.9997 at worst). On-policy the loss is -mean(advantage) whatever the logprobs,
    so the gradients and the entropy are what tell the precisions apart."""
    reference, reference_grads = fp32_step
    bf16, bf16_grads = one_step(tiny_model_dir, batch, dtype="bfloat16", sort_by_length=False)
    assert bf16["actor/loss"] == pytest.approx(reference["actor/loss"], abs=1e-2)
    assert bf16["actor/entropy"] == pytest.approx(reference["actor/entropy"], abs=1e-2)
    # against the batch's made-up sampler logprobs: what fp32 gives, to bf16's own error
    assert bf16["actor/logprob_diff"] == pytest.approx(reference["actor/logprob_diff"], abs=2e-2)
    for name, grad in reference_grads.items():
        other = bf16_grads[name]
        assert torch.linalg.vector_norm(other - grad) <= 0.05 * torch.linalg.vector_norm(grad), name
        assert torch.nn.functional.cosine_similarity(other.flatten(), grad.flatten(), dim=0) > 0.999, name


def test_the_compiled_step_gives_the_eager_loss(tiny_model_dir, batch, fp32_step):
    """Compiled with the prompts run once per group (the default), against eager whole sequences."""
    eager, eager_grads = fp32_step
    compiled, compiled_grads = one_step(tiny_model_dir, batch, sort_by_length=False, compile=True, share_prompts=True)
    assert compiled["actor/loss"] == pytest.approx(eager["actor/loss"], rel=1e-5, abs=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_rows_without_advantage_are_not_run_and_change_neither_loss_nor_gradients(tiny_model_dir, batch):
    """The second group scored alike (all-zero advantages) and one row is out of the loss: with the default
    (skip_zero_advantage_rows unset) the step runs the other seven rows only, to the full batch's loss and
    gradients; with sequence-level importance weights, as async mode can ask for."""
    advantages = [[0.0] * len(a) if 4 <= i < 8 else a for i, a in enumerate(batch.advantages)]
    quiet = dataclasses.replace(
        batch, advantages=advantages, loss_mask=[i != 9 for i in range(len(batch))], rollout_is="sequence"
    )
    every_row, every_grads = one_step(tiny_model_dir, quiet, sort_by_length=False)
    skipping, skipping_grads = one_step(tiny_model_dir, quiet, sort_by_length=False, skip_zero_advantage_rows=None)
    assert every_row["perf/rows_skipped_frac"] == 0.0 and skipping["perf/rows_skipped_frac"] == pytest.approx(5 / 12)
    trained = [i for i in range(len(batch)) if i < 4 or i in (8, 10, 11)]
    lengths = [len(batch.prompt_ids[i]) + len(batch.completion_ids[i]) for i in trained]
    assert skipping["perf/train_positions"] == sum(lengths) < every_row["perf/train_positions"]
    assert skipping["actor/loss"] == pytest.approx(every_row["actor/loss"], rel=1e-5, abs=1e-6)
    assert skipping["actor/grad_norm"] == pytest.approx(every_row["actor/grad_norm"], rel=1e-5)
    for name, grad in every_grads.items():
        torch.testing.assert_close(skipping_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # with compiled shapes (seq_buckets), whole micro-batches of 4 only: the seven rows and one more
    bucketed, _ = one_step(tiny_model_dir, quiet, sort_by_length=False, skip_zero_advantage_rows=None, seq_buckets=[16])
    assert bucketed["perf/rows_skipped_frac"] == pytest.approx(4 / 12)
    assert bucketed["actor/loss"] == pytest.approx(every_row["actor/loss"], rel=1e-5, abs=1e-6)


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
