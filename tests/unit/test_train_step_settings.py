"""The train-step settings that make it faster change nothing they should not: sequences sorted by length give
the padded loss and gradients (fp32, 1e-6), so do prompts run once per group (`share_prompts`) and rows left
out for having no advantage, and bf16 stays within stated tolerances of fp32 (the compiled step and two ranks in processes of their own:
tests/e2e/test_train_step_processes.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import one_step, shared_prompt_batch


@pytest.fixture(scope="module")
def batch():
    return shared_prompt_batch()


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


def test_an_update_with_no_token_in_the_loss_leaves_the_weights_as_they_were(tiny_model_dir, batch):
    """Every row out of the loss (outcomes masked, overlong filtered, lost): its gradient is zero, but an AdamW step
    would still move the weights, by the momentum of the earlier updates; the update is not applied."""
    from conftest import free_port

    from rl_tpu.config import RunConfig
    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.trainer.micro_batch_size = "cpu", "float32", 4
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        worker.train_step(batch)  # momentum to carry
        before = {name: p.detach().clone() for name, p in worker.model.named_parameters()}
        empty = worker.train_step(dataclasses.replace(batch, loss_mask=[False] * len(batch)))
        for name, param in worker.model.named_parameters():
            assert torch.equal(param.detach(), before[name]), name
        assert empty["actor/grad_norm"] == 0.0
        moved = worker.train_step(batch)  # and a batch with tokens in the loss still trains
        assert moved["actor/grad_norm"] > 0.0
        assert any(not torch.equal(p.detach(), before[n]) for n, p in worker.model.named_parameters())
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
