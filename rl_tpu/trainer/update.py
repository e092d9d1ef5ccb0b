"""The policy update of one rank: PPO mini-batches and epochs, micro-batched forward, verl's loss, backward, clip,
AdamW step; the metrics reduced over the ranks; the per-token KL to the reference model for the KL in the reward."""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist

from rl_tpu.algorithms import core as algorithms
from rl_tpu.cluster.core_loan import Borrower
from rl_tpu.cluster.device import Device
from rl_tpu.cluster.memory import peak_rss_mb
from rl_tpu.config import AlgorithmConfig, RunConfig
from rl_tpu.models.logprobs import forward_positions, pad_batch, token_logprobs
from rl_tpu.records import TrainBatch
from rl_tpu.trainer.lora import adapters_off
from rl_tpu.trainer.recorded import RecordedRows


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    return [batch.shard(i, -(-len(batch) // size)) for i in range(-(-len(batch) // size))]


def rank_share(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """A rank's rows. Unequal shares would run unequal numbers of forwards, whose FSDP collectives pair across the
    ranks: they would wait on each other for good, so such a batch is refused (by every rank alike)."""
    if len(batch) % world_size:
        raise ValueError(f"a batch of {len(batch)} rows does not divide evenly over {world_size} ranks")
    return batch.shard(rank, world_size)


def trains_stochastically(model: torch.nn.Module) -> bool:
    """Whether the model's forward in train mode draws random numbers: a dropout layer (`actor.lora.lora_dropout`
    among them) or attention dropout in its config. Then the logprobs of a fixed policy are taken in eval mode."""
    config = getattr(model, "config", None)
    return (getattr(config, "attention_dropout", 0.0) or 0.0) > 0 or any(
        isinstance(module, torch.nn.Dropout) and module.p > 0 for module in model.modules()
    )


@contextlib.contextmanager
def evaluating(model: torch.nn.Module, stochastic: bool) -> Iterator[None]:
    """The model in eval mode while inside if its train-mode forward is a draw (`stochastic`: dropout, which the
    engine does not apply), then in the mode it was in; otherwise left as it is (a compiled forward keeps its graph)."""
    training = model.training
    model.train(training and not stochastic)
    try:
        yield
    finally:
        model.train(training)


@dataclass
class UpdateTotals:
    """A step's sums over this rank's micro-batches, then over every rank: what the step's metrics divide.

    The sums of device values stay on the device (0-d tensors) until `all_reduce` reads them all at once: a step
    reads the device once for its figures, not several times a micro-batch (each read is a host sync)."""

    loss: float = 0.0  # the updates' losses
    update_tokens: float = 0.0  # tokens in the loss, over every update: the weight of `weighted`
    tokens: float = 0.0  # the batch's tokens in the loss, counted in the first epoch only
    entropy: float = 0.0  # over `tokens`
    logprob_diff: float = 0.0  # |old - sampler| logprob, over `tokens`
    logprob_diff_max: float = 0.0  # the largest |old - sampler| logprob of a token in `tokens`: a max, not a sum
    positions_real: float = 0.0  # prompt and completion positions the forward computed
    positions: float = 0.0  # the same, padding included
    borrowed_s: float = 0.0  # seconds computed on engine cores too (trainer.borrow_idle_cores)
    weighted: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # verl's figures x tokens
    recorded: RecordedRows = field(default_factory=RecordedRows)  # the rollout record's rows: not summed

    def measure(
        self, micro: TrainBatch, t: dict[str, torch.Tensor], entropy: torch.Tensor, old_log_prob: torch.Tensor
    ) -> None:
        """Adds a micro-batch's figures of what the batch is: its tokens in the loss, their entropy and their
        engine-trainer logprob gap (the sum and the largest), the forward's positions."""
        mask = t["response_mask"]
        gap = (old_log_prob - t["sampler_logprobs"]).abs() * mask
        self.tokens += mask.sum()
        self.entropy += (entropy.detach() * mask).sum()
        self.logprob_diff += gap.sum()
        self.logprob_diff_max = gap.max().clamp(min=self.logprob_diff_max)
        self.recorded.keep(micro, old_log_prob, entropy)
        real, computed = forward_positions(t, micro)  # counted on the host
        self.positions_real += real
        self.positions += computed

    def all_reduce(self, rank: int, world_size: int, device: torch.device) -> tuple[UpdateTotals, list[float]]:
        """The sums over every rank, the largest gap of any rank, and each rank's peak resident memory, in one
        all-reduce (each rank's own figures in slots of their own, which the sum keeps apart)."""
        names = [f.name for f in fields(self) if f.name not in ("weighted", "logprob_diff_max", "recorded")]
        keys = sorted(self.weighted)
        local = [getattr(self, name) for name in names] + [self.weighted[key] for key in keys]
        rss, gaps = [0.0] * world_size, [0.0] * world_size
        rss[rank], gaps[rank] = peak_rss_mb(), self.logprob_diff_max
        dtype = torch.float32 if device.type == "tpu" else torch.float64
        # NCCL reduces device tensors only; numbers of the host join the device's sums there
        summed = torch.stack([torch.as_tensor(value, device=device).to(dtype) for value in local + rss + gaps])
        dist.all_reduce(summed)
        values = summed.tolist()  # the step's one read of the device
        rank_rss, rank_gaps = values[len(local) : len(local) + world_size], values[len(local) + world_size :]
        total = UpdateTotals(
            **dict(zip(names, values)),
            logprob_diff_max=max(rank_gaps),
            weighted=dict(zip(keys, values[len(names) : len(local)])),
        )
        return total, rank_rss


def step_metrics(
    total: UpdateTotals, rank_rss: list[float], updates: int, grad_norm: float, lr: float, seconds: float
) -> dict[str, float]:
    """A step's metrics from the totals of every rank."""
    world_size = len(rank_rss)
    tokens, update_tokens = max(total.tokens, 1.0), max(total.update_tokens, 1.0)
    return {
        # seconds of the step a rank computed on engine cores too (trainer.borrow_idle_cores), ranks' mean
        "time/trainer_borrowed_s": total.borrowed_s / world_size,
        "perf/padding_frac": 1.0 - total.positions_real / max(total.positions, 1.0),
        "perf/train_positions": total.positions_real,  # prompt and completion tokens the forward computed
        "actor/loss": total.loss / (world_size * updates),  # the mean of the updates' losses
        "actor/updates": float(updates),
        "actor/entropy": total.entropy / tokens,
        "actor/logprob_diff": total.logprob_diff / tokens,  # the mean per token
        "actor/logprob_diff_max": total.logprob_diff_max,  # the largest of a token
        "actor/grad_norm": grad_norm,
        "actor/lr": lr,
        "time/train_s": seconds,
        "perf/train_tokens": tokens,
        "perf/trainer_peak_rss_mb": max(rank_rss),  # the largest rank's
        **{f"perf/trainer_{rank}_peak_rss_mb": mb for rank, mb in enumerate(rank_rss)},
        **{k: v / update_tokens for k, v in total.weighted.items()},
    }


class PolicyUpdate:
    """The optimizer, its schedule and verl's policy loss over one rank's model; every method is collective."""

    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        device: Device,
        rank: int,
        world_size: int,
        pad_id: int,
        borrower: Borrower,
    ):
        self.cfg, self.model, self.ref_model, self.device = cfg, model, ref_model, device
        self.rank, self.world_size, self.pad_id, self.borrower = rank, world_size, pad_id, borrower
        # the trainable weights: all of them, or a LoRA policy's adapter
        self.trainable = [param for param in model.parameters() if param.requires_grad]
        self.optimizer, self.scheduler = optimizer_and_schedule(self.trainable, cfg.algorithm, device)
        self.policy_loss = algorithms.PolicyLoss(cfg.actor, cfg.completion_tokens)
        # bypass_mode is verl's name for a loss whose old logprobs are the sampler's
        bypass = cfg.actor.policy_loss.loss_mode == "bypass_mode"
        self.old_logprob_source = "sampler" if bypass else cfg.actor.old_logprob_source
        self.stochastic = trains_stochastically(model)  # dropout (the reference model has the same architecture)
        self.skip_zero_advantage_rows = (
            cfg.trainer.skip_zero_advantage_rows is not False
            and algorithms.why_zero_advantage_rows_count(cfg.actor) is None
        )
        self.totals = UpdateTotals()  # the last step's: its rollout record rows wait there for the driver

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """PPO updates on one batch: `actor.ppo_epochs` passes over its mini-batches, one optimizer step each.

        The PPO ratio's old logprobs are those of the weights before the first update (or the sampler's,
        `actor.old_logprob_source`); with a single update they are the current ones, taken from its forward (unless
        dropout makes that forward a draw).
        """
        start = time.perf_counter()
        self.borrower.poll()  # the engines may have work again since the last step
        self.borrower.take_wide_seconds()
        actor = self.cfg.actor
        mini_size = len(batch) if actor.ppo_mini_batch_size is None else actor.ppo_mini_batch_size * self.cfg.sampler.n
        minis = micro_batches(batch, mini_size)
        self.model.train()
        # each update's loss is normalised by its mini-batch's counts, of tokens and sequences in the loss
        counts = [(max(mini.num_tokens(), 1), max(mini.num_seqs(), 1)) for mini in minis]
        # a mini-batch with no token in the loss (its rows masked by their outcomes, filtered, lost) has a zero
        # gradient, yet an AdamW step would move the weights by the earlier updates' momentum: it is not applied
        applies = [mini.num_tokens() > 0 for mini in minis]
        if self.skip_zero_advantage_rows:  # rows that add nothing to the loss or the gradient are not run
            # compiled shapes (seq_buckets): whole micro-batches only, so no step brings a new row count
            multiple = self.world_size * (self.cfg.trainer.micro_batch_size if self.cfg.trainer.seq_buckets else 1)
            minis = [mini.rows_with_signal(multiple) for mini in minis]
        single_update = len(minis) * actor.ppo_epochs == 1 and not self.stochastic
        prepared = [self._prepare(mini, single_update) for mini in minis]
        self.totals = totals = UpdateTotals()
        grad_norms = []
        for epoch in range(actor.ppo_epochs):
            for count, micros, apply in zip(counts, prepared, applies):
                for micro in micros:
                    self._backward(*micro, count, batch, totals, first_epoch=epoch == 0)
                self.borrower.poll()
                grad_norms.append(apply_update(self.optimizer, self.trainable, self.cfg.algorithm.grad_clip, apply))
        totals.borrowed_s = self.borrower.take_wide_seconds()
        finite = [g for g in grad_norms if math.isfinite(g)]
        skipped = len(grad_norms) - len(finite)
        if finite and any(applies):  # the schedule counts steps that changed the weights
            self.scheduler.step()
        total, rank_rss = totals.all_reduce(self.rank, self.world_size, self.device.torch_device)
        grad_norm = sum(finite) / len(finite) if finite else math.nan
        lr = self.scheduler.get_last_lr()[0]
        metrics = step_metrics(total, rank_rss, len(grad_norms), grad_norm, lr, time.perf_counter() - start)
        if skipped:  # a non-finite loss or gradient: that update's figures are not numbers; the rest are kept
            metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        return {
            **metrics,
            "actor/skipped": float(skipped > 0),
            "actor/skipped_updates": float(skipped),
            "perf/rows_skipped_frac": 1.0 - sum(map(len, minis)) / len(batch),
        }

    def _prepare(self, mini: TrainBatch, single_update: bool) -> list[tuple[TrainBatch, dict[str, torch.Tensor]]]:
        """This rank's micro-batches of a mini-batch, each with its tensors, padded, with the logprobs the updates
        compare against: the reference model's, and the old policy's (None: the one update's own forward)."""
        local = rank_share(mini, self.rank, self.world_size)
        if self.cfg.trainer.sort_by_length:
            local = local.sorted_by_length()
        temperature = mini.temperature
        micros = []
        for micro in micro_batches(local, self.cfg.trainer.micro_batch_size):
            t = self._padded(micro)
            with torch.no_grad():
                if self.old_logprob_source == "sampler" or not single_update:
                    t["old_log_probs"] = self._sampling_policy_logprobs(t, temperature)
                if self.cfg.actor.use_kl_loss:
                    t["ref_log_probs"] = self._reference_logprobs(t, temperature)
            micros.append((micro, t))
        return micros

    def _padded(self, micro: TrainBatch) -> dict[str, torch.Tensor]:
        trainer = self.cfg.trainer
        return pad_batch(micro, self.pad_id, self.device.torch_device, trainer.seq_buckets, trainer.share_prompts)

    def _sampling_policy_logprobs(self, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """The logprobs of the policy that sampled the batch: the sampler's (`actor.old_logprob_source=sampler`),
        or these weights' before the batch's first update."""
        if self.old_logprob_source == "sampler":
            return t["sampler_logprobs"]
        return self._fixed_logprobs(self.model, t, temperature)

    def _fixed_logprobs(self, model: torch.nn.Module, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """A fixed policy's logprobs, one value per token (not a draw of dropout)."""
        with evaluating(model, self.stochastic):
            return self._logprobs(model, t, temperature, False)[0]

    def _logprobs(
        self, model: torch.nn.Module, t: dict[str, torch.Tensor], temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        backend = self.device.compile_backend if self.cfg.trainer.compile else None
        return token_logprobs(model, t, temperature, with_entropy, self.cfg.trainer.logprob_chunk_size, backend)

    def _reference_logprobs(self, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """The reference policy's logprobs: the reference model's, or a LoRA policy's base (its adapters off)."""
        if self.ref_model is not None:
            return self._fixed_logprobs(self.ref_model, t, temperature)
        with adapters_off(self.model):
            return self._fixed_logprobs(self.model, t, temperature)

    def token_kl(self, batch: TrainBatch) -> list[list[float]]:
        """This rank's slice of the batch: each completion token's KL (`algorithm.kl_penalty`) between the policy
        that sampled it (these weights, before the update, or the sampler's logprobs) and the reference model."""
        from verl.trainer.ppo.core_algos import kl_penalty

        local = rank_share(batch, self.rank, self.world_size)
        rows = []
        for micro in micro_batches(local, self.cfg.trainer.micro_batch_size):
            t = self._padded(micro)
            with torch.no_grad():
                policy = self._sampling_policy_logprobs(t, batch.temperature)
                ref = self._reference_logprobs(t, batch.temperature)
                kl = kl_penalty(policy, ref, self.cfg.algorithm.kl_penalty).float().cpu()
            rows += [kl[i, : len(ids)].tolist() for i, ids in enumerate(micro.completion_ids)]
        return rows

    def _backward(
        self,
        micro: TrainBatch,
        t: dict[str, torch.Tensor],
        counts: tuple[int, int],
        batch: TrainBatch,
        totals: UpdateTotals,
        first_epoch: bool,
    ) -> None:
        """Forward, loss and backward of one micro-batch of an update; adds its figures to `totals`."""
        log_prob, entropy = self._logprobs(self.model, t, batch.temperature, with_entropy=True)
        old_log_prob = t.get("old_log_probs", log_prob.detach())
        mask = t["response_mask"]
        is_weights, is_metrics = None, {}
        if batch.rollout_is is not None:  # stale (async) or mismatched (bf16) rollouts: truncated IS weights
            is_weights, is_metrics = algorithms.truncated_is_weights(
                old_log_prob, t["sampler_logprobs"], mask, batch.rollout_is_threshold, batch.rollout_is
            )
        loss, metrics = self.policy_loss(
            log_prob,
            old_log_prob,
            t["advantages"],
            mask,
            *counts,
            self.world_size,
            ref_log_prob=t.get("ref_log_probs"),
            entropy=entropy,
            rollout_is_weights=is_weights,
        )
        loss.backward()
        # every figure stays on the device: UpdateTotals.all_reduce reads them once a step
        n_tok = mask.sum()
        totals.loss += loss.detach()
        totals.update_tokens += n_tok
        for key, value in {**metrics, **is_metrics}.items():
            totals.weighted[key] += value * n_tok  # token-weighted average over micro-batches and updates
        if first_epoch:  # what the batch is, measured once: before any update changed the policy
            totals.measure(micro, t, entropy, old_log_prob)


def optimizer_and_schedule(
    trainable: list[torch.nn.Parameter], algo: AlgorithmConfig, device: Device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable weights, with a linear warm-up of `algorithm.warmup_steps`."""
    optimizer = torch.optim.AdamW(
        trainable,
        lr=algo.lr,
        betas=tuple(algo.betas),
        weight_decay=algo.weight_decay,
        # one fused kernel for every parameter's update where PyTorch has one (reference workload: 15 -> 5 ms a step)
        fused=device.kind in ("cpu", "cuda"),
    )
    warmup = algo.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, schedule


def apply_update(
    optimizer: torch.optim.Optimizer, trainable: list[torch.nn.Parameter], grad_clip: float, apply: bool = True
) -> float:
    """Clip and apply the accumulated gradient; a non-finite one is dropped, and so is one with no token in the
    loss (`apply` false: its norm is 0). Returns the gradient norm."""
    if not apply:
        optimizer.zero_grad(set_to_none=True)
        return 0.0
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    norm = grad_norm.item()  # an update's one read of the device: whether to apply it
    if math.isfinite(norm):  # a non-finite loss or gradient: nothing of it reaches the weights
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
