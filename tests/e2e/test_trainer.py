"""The trainer's update equals a plain single-process AdamW step, with and without activation checkpointing; two FSDP2
ranks train like one; a checkpoint moves between world sizes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import free_port, make_batch
from torch.distributed.tensor import DTensor

from rl_tpu.algorithms import core as algorithms
from rl_tpu.config import RunConfig
from rl_tpu.models.logprobs import pad_batch, token_logprobs
from rl_tpu.outputs import checkpoints
from rl_tpu.trainer.update import micro_batches
from rl_tpu.trainer.worker import TrainerWorker


def trainer_after_steps(
    model_dir, batch, steps: int, actor: dict | None = None, metrics_out: list | None = None, **trainer_overrides
) -> dict[str, torch.Tensor]:
    """The weights after `steps` train steps of an in-process FSDP2 rank; each step's metrics go to `metrics_out`."""
    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.trainer.micro_batch_size, cfg.sampler.n = "cpu", 1e-3, 4, 4
    for key, value in (actor or {}).items():
        setattr(cfg.actor, key, value)
    # the plain step's micro-batch order and whole-sequence forward: a new summation order moves AdamW's first
    # update of near-zero gradients (g / (|g| + eps)); sorting and shared prompts are checked on the gradients,
    # test_train_step_settings.py
    cfg.trainer.sort_by_length = cfg.trainer.share_prompts = False
    for key, value in trainer_overrides.items():
        setattr(cfg.trainer, key, value)
    threads = torch.get_num_threads()  # the worker sets its own; give the test process its count back
    worker = TrainerWorker(cfg, str(model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        for _ in range(steps):
            metrics = worker.train_step(batch)
            (metrics_out if metrics_out is not None else []).append(metrics)
        assert metrics["actor/grad_norm"] > 0
        return worker.full_state_dict()
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


def plain_after_steps(model_dir, batch, steps: int, micro_size: int = 4, whole=None) -> dict[str, torch.Tensor]:
    """`whole`: the batch whose token and sequence counts normalise the loss, where `batch` holds some of its rows."""
    from transformers import AutoModelForCausalLM

    whole = whole or batch

    cfg = RunConfig()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=cfg.algorithm.betas, weight_decay=0.0)
    policy_loss = algorithms.PolicyLoss(cfg.actor, cfg.sampler.response_length)
    for _ in range(steps):
        optimizer.zero_grad()
        for micro in micro_batches(batch, micro_size):
            t = pad_batch(micro, pad_id=1, device=torch.device("cpu"))
            log_prob, entropy = token_logprobs(model, t, batch.temperature)
            loss, _ = policy_loss(
                log_prob,
                log_prob.detach(),
                t["advantages"],
                t["response_mask"],
                whole.num_tokens(),
                len(whole),
                1,
                entropy=entropy,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algorithm.grad_clip)
        optimizer.step()
    return model.state_dict()


def plain_ppo_after_step(model_dir, batch, mini_size: int, epochs: int) -> dict[str, torch.Tensor]:
    """PPO by hand: old logprobs of the initial weights, then `epochs` passes of one AdamW step per mini-batch
    (each mini-batch one forward, normalised by its own token count)."""
    from transformers import AutoModelForCausalLM

    cfg = RunConfig()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=cfg.algorithm.betas, weight_decay=0.0)
    policy_loss = algorithms.PolicyLoss(cfg.actor, cfg.sampler.response_length)
    minis = [pad_batch(mini, pad_id=1, device=torch.device("cpu")) for mini in micro_batches(batch, mini_size)]
    with torch.no_grad():
        old = [token_logprobs(model, t, batch.temperature, with_entropy=False)[0] for t in minis]
    for _ in range(epochs):
        for t, old_log_prob in zip(minis, old):
            optimizer.zero_grad()
            log_prob, entropy = token_logprobs(model, t, batch.temperature)
            mask = t["response_mask"]
            loss, _ = policy_loss(
                log_prob, old_log_prob, t["advantages"], mask, int(mask.sum()), len(mask), 1, entropy=entropy
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algorithm.grad_clip)
            optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def batch():
    return make_batch(seed=5, size=8, temperature=1.0)


def test_fsdp2_step_equals_plain_adamw_step(tiny_model_dir, batch):
    fsdp = trainer_after_steps(tiny_model_dir, batch, steps=2)
    plain = plain_after_steps(tiny_model_dir, batch, steps=2)
    for name, tensor in plain.items():
        torch.testing.assert_close(fsdp[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_ppo_mini_batches_and_epochs_equal_ppo_by_hand(tiny_model_dir, batch):
    """Two mini-batches of one prompt's 4 completions, two epochs: four AdamW steps, each with the PPO ratio
    taken against the weights before the first (the trainer computes them once, in micro-batches of 4)."""
    metrics = []
    fsdp = trainer_after_steps(
        tiny_model_dir, batch, steps=1, actor={"ppo_mini_batch_size": 1, "ppo_epochs": 2}, metrics_out=metrics
    )
    plain = plain_ppo_after_step(tiny_model_dir, batch, mini_size=4, epochs=2)
    assert metrics[0]["actor/updates"] == 4.0
    for name, tensor in plain.items():
        torch.testing.assert_close(fsdp[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_the_second_ppo_epoch_clips(tiny_model_dir):
    """With one update the ratio is 1 and nothing clips; a large step moves the policy past the clip range, so
    the second epoch's ratios (against the same old logprobs) clip. The first epoch contributes exactly 0."""
    strong = make_batch(seed=7, size=8, temperature=1.0)
    one, two = [], []
    trainer_after_steps(tiny_model_dir, strong, steps=1, actor={"ppo_epochs": 1}, metrics_out=one)
    trainer_after_steps(tiny_model_dir, strong, steps=1, actor={"ppo_epochs": 2, "clip_ratio": 0.05}, metrics_out=two)
    assert one[0]["actor/pg_clipfrac"] == 0.0 and one[0]["actor/ppo_kl"] == 0.0
    assert two[0]["actor/updates"] == 2.0
    assert two[0]["actor/pg_clipfrac"] > 0.0, two[0]  # the mean of epoch 1 (0) and epoch 2


def test_activation_checkpointing_changes_nothing_but_memory(tiny_model_dir, batch):
    reference = trainer_after_steps(tiny_model_dir, batch, steps=1)
    checkpointed = trainer_after_steps(tiny_model_dir, batch, steps=1, activation_checkpointing=True)
    assert set(checkpointed) == set(reference)  # Hugging Face names, no wrapper prefixes
    for name, tensor in reference.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("alike", [False, True], ids=["", "first_group_scored_alike"])
def test_two_fsdp_ranks_train_like_one_process_and_publish_full_weights(ray_cluster, tiny_model_dir, batch, alike):
    """Each rank holds a shard and trains on half the batch; the published bundle is the whole, updated model.
    With the first group scored alike (zero advantages), the ranks train two rows each of the second group: a
    plain process training those rows in micro-batches of two, with the whole batch's counts, is the reference
    (AdamW's first update of near-zero gradients moves with their summation order; that leaving the rows out
    changes the gradient only by rounding is checked in test_algorithms.py and test_train_step_settings.py)."""
    from rl_tpu.records import WeightBundle
    from rl_tpu.sync.endpoints import unpack

    if alike:
        batch = dataclasses.replace(
            batch, advantages=[[0.0] * len(a) if i < 4 else a for i, a in enumerate(batch.advantages)]
        )

    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.trainer.micro_batch_size, cfg.trainer.world_size = "cpu", 1e-3, 4, 2
    cfg.sync.bucket_mb = 1.0  # several buckets, each gathered from the shards in turn
    cfg.trainer.sort_by_length = cfg.trainer.share_prompts = False  # the plain step's order (see trainer_after_steps)
    port = free_port()
    ranks = [
        ray_cluster.remote(TrainerWorker).options(num_cpus=1).remote(cfg, str(tiny_model_dir), r, 2, "127.0.0.1", port)
        for r in range(2)
    ]
    metrics = ray_cluster.get([r.train_step.remote(batch) for r in ranks])
    assert [m["perf/rows_skipped_frac"] for m in metrics] == [0.5 if alike else 0.0] * 2
    parts = ray_cluster.get([r.publish_weights.remote(1) for r in ranks])
    gathered = ray_cluster.get([r.full_state_dict.remote() for r in ranks])[0]  # one full gather, for comparison
    ray_cluster.get([r.shutdown.remote() for r in ranks])
    # both ranks staged buckets (object_store), in shares within one bucket's size of each other
    shares = [part.num_bytes for part in parts]
    largest_bucket = max(sum(s.num_bytes for s in b.specs) for part in parts for b in part.buckets)
    assert min(shares) > 0 and abs(shares[0] - shares[1]) <= largest_bucket
    bundle = WeightBundle.merge(parts)
    assert len(bundle.buckets) > 5 and [b.index for b in bundle.buckets] == list(range(len(bundle.buckets)))
    published = dict(unpack(bundle)[0])
    # streamed bucket by bucket from the shards: bit for bit the full gather, the tied head once (the embedding)
    assert set(published) == set(gathered) - {"lm_head.weight"}
    assert bundle.num_bytes == sum(t.nbytes for t in published.values())
    assert torch.equal(gathered["lm_head.weight"], gathered["model.embed_tokens.weight"])  # tied
    assert all(torch.equal(published[name], gathered[name]) for name in published)
    plain = (
        plain_after_steps(tiny_model_dir, batch.rows_with_signal(2), 1, micro_size=2, whole=batch)
        if alike
        else plain_after_steps(tiny_model_dir, batch, steps=1)
    )
    assert set(plain) - set(published) == {"lm_head.weight"}
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoint_moves_between_one_unsharded_rank_and_two_fsdp_ranks(ray_cluster, tiny_model_dir, batch, tmp_path):
    """One fp32 rank trains without FSDP (plain tensors); its checkpoint resumes on two FSDP2 ranks, which take
    the same next step it takes (model and optimizer state), and theirs loads back into one rank."""
    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.trainer.micro_batch_size = "cpu", 1e-3, 4
    cfg.trainer.sort_by_length = cfg.trainer.share_prompts = False  # the two layouts' order (trainer_after_steps)
    threads = torch.get_num_threads()
    one = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        assert not any(isinstance(p, DTensor) for p in one.model.parameters())
        one.train_step(batch)
        one.save_checkpoint(str(tmp_path / "one"), {"data.json": '{"gen_batches_taken": 3}'})
        # the driver's part is inside the checkpoint once it is complete (written before the rename)
        assert checkpoints.data_position(tmp_path / "one") == 3
        one.train_step(batch)
        after_two_steps = {name: t.clone() for name, t in one.full_state_dict().items()}
        cfg.trainer.world_size, port = 2, free_port()
        ranks = [
            ray_cluster.remote(TrainerWorker)
            .options(num_cpus=1)
            .remote(cfg, str(tiny_model_dir), r, 2, "127.0.0.1", port)
            for r in range(2)
        ]
        ray_cluster.get([r.load_checkpoint.remote(str(tmp_path / "one")) for r in ranks])
        ray_cluster.get([r.train_step.remote(batch) for r in ranks])
        ray_cluster.get([r.save_checkpoint.remote(str(tmp_path / "two")) for r in ranks])
        sharded = ray_cluster.get([r.full_state_dict.remote() for r in ranks])[0]
        ray_cluster.get([r.shutdown.remote() for r in ranks])
        for name, tensor in after_two_steps.items():
            torch.testing.assert_close(sharded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        one.load_checkpoint(str(tmp_path / "two"))
        assert all(torch.equal(one.full_state_dict()[name], tensor) for name, tensor in sharded.items())
    finally:
        one.shutdown()
        torch.set_num_threads(threads)


def test_a_non_finite_loss_skips_the_update_and_training_goes_on(tiny_model_dir, batch):
    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.trainer.micro_batch_size = "cpu", 1e-3, 4
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        before = {name: t.clone() for name, t in worker.full_state_dict().items()}  # (at world size 1: views)
        poisoned = dataclasses.replace(batch, advantages=[[math.nan] * len(batch.advantages[0])] + batch.advantages[1:])
        skipped = worker.train_step(poisoned)
        assert skipped["actor/skipped"] == 1.0 and "actor/loss" not in skipped
        assert all(math.isfinite(v) for v in skipped.values())  # what is left can be logged
        after = worker.full_state_dict()
        assert all(torch.equal(before[name], after[name]) for name in before)  # nothing of it reached the weights
        trained = worker.train_step(batch)
        assert trained["actor/skipped"] == 0.0 and trained["actor/grad_norm"] > 0
        assert not torch.equal(worker.full_state_dict()["model.norm.weight"], before["model.norm.weight"])
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_sharded_in_the_served_dtype_and_loads_in_transformers(tiny_model_dir, tmp_path, dtype):
    """Bucket-sized shards with save_pretrained's names and index; transformers loads the trainer's weights."""
    import json

    from transformers import AutoModelForCausalLM

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.sync.bucket_mb = "cpu", dtype, 1.0
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        expected = {name: t.to(getattr(torch, dtype)) for name, t in worker.full_state_dict().items()}
        folder = tmp_path / "export"
        assert worker.export(str(folder)) == str(folder)
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files) and "lm_head.weight" not in index["weight_map"]
    assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
    assert not (folder.parent / "export.partial").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
