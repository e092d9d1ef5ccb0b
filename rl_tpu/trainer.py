"""The FSDP2 trainer: one instance per rank (a Ray actor), TorchTitan style (a single fp32 rank runs unsharded).

`train_step` is the whole update on one screen: mini-batches and epochs (PPO), each rank's
micro-batches forward, the loss from verl's core_algos, backward, clip, step. Weights leave through `publish_weights`
(a versioned bundle for the sampler) and `export` (a Hugging Face folder).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from rl_tpu import algorithms, placement, sync
from rl_tpu.actor_logs import actor_name, send_output_to_file
from rl_tpu.config import RunConfig, value_of
from rl_tpu.core_loan import Borrower
from rl_tpu.cpu_binding import CpuBinding
from rl_tpu.device import Device
from rl_tpu.export import MODEL_FILES, copy_model_files
from rl_tpu.logprobs import forward_positions, pad_batch, token_logprobs
from rl_tpu.metrics import peak_rss_mb
from rl_tpu.parallelize import hf_name, materialize, parallelize
from rl_tpu.rollout import TrainBatch


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    return [batch.shard(i, -(-len(batch) // size)) for i in range(-(-len(batch) // size))]


def name_shards(folder: Path, shards: list[tuple[list[str], int]]) -> None:
    """Rename `shard-i.safetensors` as `save_pretrained` names its files: `model.safetensors` when there
    is one, else `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`."""
    if len(shards) == 1:
        os.replace(folder / "shard-0.safetensors", folder / "model.safetensors")
        return
    weight_map = {}
    for i, (names, _) in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / f"shard-{i}.safetensors", folder / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(size for _, size in shards)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class TrainerWorker:
    """One FSDP2 rank. Ray runs one per rank; every public method is collective across ranks."""

    def __init__(self, cfg: RunConfig, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 log_dir: str | None = None, binding: CpuBinding | None = None):
        """`master_addr:master_port` is on rank 0's node; `cfg.device` is resolved on this actor's own node.

        `binding`: the rank's threads and cores (rl_tpu/cpu_binding.py); None: `trainer.threads_per_rank`, unpinned."""
        self.name = actor_name("trainer", rank)
        send_output_to_file(log_dir, self.name)
        placement.require_model_on_node(self.name, model_path)
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        # before the process group starts its threads, which inherit the pinning
        binding = binding or CpuBinding(cfg.trainer.threads_per_rank)
        self.borrower = Borrower(binding, binding.apply(self.name))
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        self.device = Device.resolve(cfg.device)
        if self.device.dist_backend == "gloo":
            placement.bind_gloo_to_node_ip()
        dist.init_process_group(self.device.dist_backend, rank=rank, world_size=world_size)
        mesh = init_device_mesh(self.device.kind, (world_size,))
        self.model = self._load_model(mesh)
        with_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref_model = self._load_model(mesh).requires_grad_(False) if with_ref else None
        algo = cfg.algorithm
        # one fused kernel for every parameter's update where PyTorch has one (reference workload: 15 -> 5 ms a step)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, betas=tuple(algo.betas),
                                           weight_decay=algo.weight_decay, fused=self.device.kind in ("cpu", "cuda"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / algo.warmup_steps) if algo.warmup_steps else 1.0)
        self.pad_id = self._pad_id()
        self.policy_loss = algorithms.PolicyLoss(cfg.actor, cfg.sampler.response_length)
        # bypass_mode is verl's name for a loss whose old logprobs are the sampler's
        bypass = value_of(cfg.actor.policy_loss.loss_mode) == "bypass_mode"
        self.old_logprob_source = "sampler" if bypass else value_of(cfg.actor.old_logprob_source)
        self.skip_zero_advantage_rows = (cfg.trainer.skip_zero_advantage_rows is not False
                                         and algorithms.why_zero_advantage_rows_count(cfg.actor) is None)
        # the collective sender (rank 0) listens on its own node's address, where the engines connect
        self.transport = sync.make_transport(value_of(cfg.sync.transport), cfg.sync.shm_dir, host=master_addr,
                                             receivers=cfg.sampler.num_engines)

    def _load_model(self, mesh) -> torch.nn.Module:
        """Shard first, then fill: the model is built on the meta device and sharded, rank 0 reads the
        checkpoint and each rank receives only its shard, so no rank but 0 ever holds a full copy."""
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(self.cfg.seed)
        param_dtype = getattr(torch, value_of(self.cfg.model.dtype))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path), dtype=torch.float32,
                                                     attn_implementation=self._attention(param_dtype))
        model = parallelize(model, self.device, mesh, param_dtype, self.cfg.trainer.activation_checkpointing,
                            self.cfg.trainer.compile, self.cfg.model.fp32_residual)
        materialize(model, self.device.torch_device)
        full = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32) if self.rank == 0 else None
        set_model_state_dict(model, full.state_dict() if full is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        # buffers outside the state dict (rotary frequencies) were left uninitialised by to_empty
        loaded = dict(full.named_buffers()) if full is not None else {}
        for name, buffer in model.named_buffers():
            if self.rank == 0:
                buffer.copy_(loaded[hf_name(name)])
            dist.broadcast(buffer, src=0)
        self.borrower.attach(model)
        return model

    def _attention(self, param_dtype: torch.dtype) -> str:
        """`trainer.attn_implementation`, or by default eager for bf16 on CPU: PyTorch's bf16 CPU flash-attention
        backward took 0.42 of a 1.7 s reference train step (eager attention: 1.05 s in all), else sdpa."""
        if self.cfg.trainer.attn_implementation:
            return self.cfg.trainer.attn_implementation
        return "eager" if self.device.kind == "cpu" and param_dtype == torch.bfloat16 else "sdpa"

    def _pad_id(self) -> int:
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        pad = config.get("pad_token_id")
        eos = config.get("eos_token_id") or 0
        # Llama 3 lists several end tokens; any of them pads (padded positions are masked out)
        return int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos))

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """PPO updates on one batch: `actor.ppo_epochs` passes over its mini-batches, one optimizer step each.

        The PPO ratio's old logprobs are those of the weights before the first update (or the sampler's,
        `actor.old_logprob_source`); with a single update they are the current ones, taken from its forward.
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
        if self.skip_zero_advantage_rows:  # rows that add nothing to the loss or the gradient are not run
            # compiled shapes (seq_buckets): whole micro-batches only, so no step brings a new row count
            multiple = self.world_size * (self.cfg.trainer.micro_batch_size if self.cfg.trainer.seq_buckets else 1)
            minis = [mini.rows_with_signal(multiple) for mini in minis]
        prepared = [self._prepare(mini, single_update=len(minis) * actor.ppo_epochs == 1) for mini in minis]
        sums: dict[str, float] = defaultdict(float)
        grad_norms = []
        for epoch in range(actor.ppo_epochs):
            for count, micros in zip(counts, prepared):
                for t in micros:
                    self._backward(t, count, batch, sums, first_epoch=epoch == 0)
                self.borrower.poll()
                grad_norms.append(self._optimizer_step())
        sums["borrowed_s"] = self.borrower.take_wide_seconds()
        finite = [g for g in grad_norms if math.isfinite(g)]
        skipped = len(grad_norms) - len(finite)
        if finite:  # the schedule counts steps that changed the weights
            self.scheduler.step()
        metrics = self._reduce_metrics(sums, sum(finite) / len(finite) if finite else math.nan, len(grad_norms),
                                       time.perf_counter() - start)
        if skipped:  # a non-finite loss or gradient: that update's figures are not numbers; the rest are kept
            metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        return {**metrics, "actor/skipped": float(skipped > 0), "actor/skipped_updates": float(skipped),
                "perf/rows_skipped_frac": 1.0 - sum(map(len, minis)) / len(batch)}

    def _prepare(self, mini: TrainBatch, single_update: bool) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of a mini-batch, padded, with the logprobs the updates compare against:
        the reference model's, and the old policy's (None: the one update's own forward gives them)."""
        local = mini.shard(self.rank, self.world_size)
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
                    t["ref_log_probs"] = self._logprobs(self.ref_model, t, temperature, False)[0]
            micros.append(t)
        return micros

    def _padded(self, micro: TrainBatch) -> dict[str, torch.Tensor]:
        trainer = self.cfg.trainer
        return pad_batch(micro, self.pad_id, self.device.torch_device, trainer.seq_buckets, trainer.share_prompts)

    def _sampling_policy_logprobs(self, t: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """The logprobs of the policy that sampled the batch: the sampler's (`actor.old_logprob_source=sampler`),
        or these weights' before the batch's first update."""
        if self.old_logprob_source == "sampler":
            return t["sampler_logprobs"]
        return self._logprobs(self.model, t, temperature, False)[0]

    def _logprobs(self, model: torch.nn.Module, t: dict[str, torch.Tensor], temperature: float,
                  with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        backend = self.device.compile_backend if self.cfg.trainer.compile else None
        return token_logprobs(model, t, temperature, with_entropy, self.cfg.trainer.logprob_chunk_size, backend)

    def token_kl(self, batch: TrainBatch) -> list[list[float]]:
        """This rank's slice of the batch: each completion token's KL (`algorithm.kl_penalty`) between the policy
        that sampled it (these weights, before the update, or the sampler's logprobs) and the reference model."""
        from verl.trainer.ppo.core_algos import kl_penalty

        local = batch.shard(self.rank, self.world_size)
        rows = []
        for micro in micro_batches(local, self.cfg.trainer.micro_batch_size):
            t = self._padded(micro)
            with torch.no_grad():
                policy = self._sampling_policy_logprobs(t, batch.temperature)
                ref = self._logprobs(self.ref_model, t, batch.temperature, False)[0]
                kl = kl_penalty(policy, ref, self.cfg.algorithm.kl_penalty).float().cpu()
            rows += [kl[i, :len(ids)].tolist() for i, ids in enumerate(micro.completion_ids)]
        return rows

    def _backward(self, t: dict[str, torch.Tensor], counts: tuple[int, int], batch: TrainBatch,
                  sums: dict[str, float], first_epoch: bool) -> None:
        """Forward, loss and backward of one micro-batch of an update; adds its figures to `sums`."""
        log_prob, entropy = self._logprobs(self.model, t, batch.temperature, with_entropy=True)
        old_log_prob = t.get("old_log_probs", log_prob.detach())
        mask = t["response_mask"]
        is_weights, is_metrics = None, {}
        if batch.rollout_is is not None:  # stale (async) or mismatched (bf16) rollouts: truncated IS weights
            is_weights, is_metrics = algorithms.truncated_is_weights(
                old_log_prob, t["sampler_logprobs"], mask, batch.rollout_is_threshold, batch.rollout_is)
        loss, metrics = self.policy_loss(log_prob, old_log_prob, t["advantages"], mask, *counts, self.world_size,
                                         ref_log_prob=t.get("ref_log_probs"), entropy=entropy,
                                         rollout_is_weights=is_weights)
        loss.backward()
        n_tok = mask.sum().item()
        sums["loss"] += loss.item()
        sums["update_tokens"] += n_tok
        for key, value in {**metrics, **is_metrics}.items():
            sums[key] += value * n_tok  # token-weighted average over micro-batches and updates
        if first_epoch:  # what the batch is, measured once: before any update changed the policy
            sums["entropy_sum"] += (entropy.detach() * mask).sum().item()
            sums["logprob_diff_sum"] += ((old_log_prob - t["sampler_logprobs"]).abs() * mask).sum().item()
            sums["tokens"] += n_tok
            real, computed = forward_positions(t)
            sums["positions_real"] += real
            sums["positions"] += computed  # padding included

    def _optimizer_step(self) -> float:
        """Clip and apply the accumulated gradient; a non-finite one is dropped. Returns the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.algorithm.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):  # a non-finite loss or gradient: nothing of it reaches the weights
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.item()

    def _reduce_metrics(self, sums: dict[str, float], grad_norm: float, updates: int,
                        seconds: float) -> dict[str, float]:
        keys = sorted(sums)
        rss = torch.zeros(self.world_size, dtype=torch.float64)
        rss[self.rank] = peak_rss_mb()
        totals = torch.cat([torch.tensor([sums[k] for k in keys], dtype=torch.float64), rss])
        totals = totals.to(self.device.torch_device)  # NCCL reduces device tensors only
        dist.all_reduce(totals)
        total = dict(zip(keys, totals[: len(keys)].tolist()))
        rank_rss = totals[len(keys):].tolist()
        tokens, update_tokens = max(total.pop("tokens"), 1.0), max(total.pop("update_tokens"), 1.0)
        positions_real, positions = total.pop("positions_real"), max(total.pop("positions"), 1.0)
        out = {
            # seconds of the step a rank computed on engine cores too (trainer.borrow_idle_cores), ranks' mean
            "time/trainer_borrowed_s": total.pop("borrowed_s") / self.world_size,
            "perf/padding_frac": 1.0 - positions_real / positions,
            "perf/train_positions": positions_real,  # prompt and completion tokens the forward computed
            "actor/loss": total.pop("loss") / (self.world_size * updates),  # the mean of the updates' losses
            "actor/updates": float(updates),
            "actor/entropy": total.pop("entropy_sum") / tokens,
            "actor/logprob_diff": total.pop("logprob_diff_sum") / tokens,
            "actor/grad_norm": grad_norm,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "time/train_s": seconds,
            "perf/train_tokens": tokens,
            "perf/trainer_peak_rss_mb": max(rank_rss),  # the largest rank's
            **{f"perf/trainer_{rank}_peak_rss_mb": mb for rank, mb in enumerate(rank_rss)},
        }
        out.update({k: v / update_tokens for k, v in total.items()})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights in Hugging Face names on every rank's CPU (collective: all ranks call it)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def served_buckets(self, senders: int = 1) -> Iterator[dict[str, torch.Tensor] | None]:
        """The full weights bucket by bucket, on the host, in the dtype the sampler serves (`model.dtype`).

        Collective: every rank iterates, gathering one bucket's parameters from their shards at a
        time, so no process holds more than one bucket beyond its shard. Bucket i goes to rank
        `sync.assign_senders(...)[i]` among the first `senders` ranks; the others get None for it.
        bf16 halves what a sync moves; the engine would round the fp32 master weights to its dtype
        on load anyway, so rounding here gives it the same values.
        """
        dtype = getattr(torch, value_of(self.cfg.model.dtype))
        # tied weights under each of their names: vLLM's CPU backend keeps its own copy of a tied head
        params = {hf_name(name): param for name, param in self.model.named_parameters(remove_duplicate=False)}
        sizes = {name: param.numel() * dtype.itemsize for name, param in params.items()}
        plan = sync.plan_buckets(sizes, int(self.cfg.sync.bucket_mb * 2**20))
        owners = sync.assign_senders([sum(sizes[name] for name in names) for names in plan], senders)
        for names, owner in zip(plan, owners):
            bucket = {}
            for name in names:
                param = params[name].detach()
                full = param.full_tensor() if isinstance(param, DTensor) else param  # all-gather of the shards
                if self.rank == owner:
                    bucket[name] = full.to("cpu", dtype)
            yield bucket if self.rank == owner else None

    def served_specs(self) -> dict[str, torch.Tensor]:
        """Names, shapes and dtypes of what `served_buckets` yields, as meta tensors, in the same order."""
        dtype = getattr(torch, value_of(self.cfg.model.dtype))
        return {hf_name(name): torch.empty(param.shape, dtype=dtype, device="meta")
                for name, param in self.model.named_parameters(remove_duplicate=False)}

    def publish_weights(self, version: int) -> sync.WeightBundle:
        """Stream the full weights into the transport; returns this rank's part of the bundle.

        Where the transport lets any rank send (`object_store`), the ranks share the buckets, so
        that checksums and staging are split and no rank holds the whole bundle's staged bytes;
        otherwise rank 0 sends them all and the other ranks' parts are empty."""
        senders = self.world_size if self.transport.any_rank_sends else 1
        return sync.pack_buckets(self.served_buckets(senders), version, self.transport)

    def connect_tpu_sync(self, samplers: list) -> list[str] | None:
        """`sync.transport=tpu_sync` handshake: rank 0 plans the slots, every engine listens, rank 0 connects."""
        from rl_tpu.sync_tpu import SlotPlan

        if self.rank != 0:
            return None
        import ray

        plan = SlotPlan.of(self.served_specs(), int(self.cfg.sync.bucket_mb * 2**20))
        endpoints = ray.get([sampler.open_tpu_sync.remote(plan) for sampler in samplers],
                            timeout=self.cfg.ray.start_timeout_s)
        self.transport.connect(plan, endpoints, self.device.torch_device)
        return endpoints

    def export(self, folder: str) -> str | None:
        """Write a Hugging Face folder (config, tokenizer, sharded safetensors in `model.dtype`) atomically.

        Streamed like a weight sync: the ranks gather one bucket (`sync.bucket_mb`) at a time and rank 0
        writes it as one shard, so no process holds the full weights; the shards are named and indexed
        as `save_pretrained` names them. Collective: every rank calls it; rank 0 writes.
        """
        from safetensors.torch import save_file

        final = Path(folder)
        tmp = final.with_name(final.name + ".partial")
        config = json.loads((Path(self.model_path) / "config.json").read_text())
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            copy_model_files(self.model_path, tmp)
        shards: list[tuple[list[str], int]] = []  # (names, bytes) of each shard written
        for bucket in self.served_buckets():
            if config.get("tie_word_embeddings") and bucket:
                bucket.pop("lm_head.weight", None)  # the embedding under its other name: stored once
            if bucket:  # rank 0's; the other ranks only took part in the gathers
                save_file(bucket, str(tmp / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
                shards.append((list(bucket), sum(t.nbytes for t in bucket.values())))
        if self.rank != 0:
            return None
        name_shards(tmp, shards)
        config["dtype"] = value_of(self.cfg.model.dtype)  # what the shards hold
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return str(final)

    def save_checkpoint(self, folder: str) -> None:
        """Sharded model + optimizer state with torch.distributed.checkpoint; reloadable at any world size.

        Written to `folder.partial` and renamed by rank 0 once every rank has finished, so a crash
        mid-save never leaves something that looks like a complete checkpoint.
        """
        final = Path(folder)
        tmp = final.with_name(final.name + ".partial")
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict()}
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if self.rank == 0:
            copy_model_files(self.model_path, tmp / MODEL_FILES)  # so that the checkpoint alone can be exported
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()

    def load_checkpoint(self, folder: str) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])

    def where(self) -> dict:
        return {**placement.where_am_i(), "actor": self.name, "device": str(self.device.torch_device)}

    def touch(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.name)

    def sees(self, path: str) -> bool:
        """Whether this rank's node sees `path` (a marker another rank wrote: shared storage)."""
        return Path(path).exists()

    def shutdown(self) -> None:
        self.transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()
