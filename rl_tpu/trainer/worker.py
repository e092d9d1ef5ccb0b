"""The FSDP2 trainer: one instance per rank (a Ray actor), TorchTitan style (a single fp32 rank runs unsharded).

Owns the trainer's part of the run and imports no other role (sampler, grader, controller): the model
built and sharded (`parallelize`), the update (`update.PolicyUpdate`), the weights leaving as a
bundle or a Hugging Face folder (`weights`), and checkpoints (`checkpoint`). May import
`rl_tpu.algorithms`, `rl_tpu.cluster`, `rl_tpu.models`, `rl_tpu.sync`, `rl_tpu.config` and `rl_tpu.records`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from rl_tpu.cluster import placement, rendezvous
from rl_tpu.cluster.actor_logs import actor_name, send_output_to_file
from rl_tpu.cluster.core_loan import Borrower
from rl_tpu.cluster.cores import CpuBinding
from rl_tpu.cluster.device import Device
from rl_tpu.config import RunConfig
from rl_tpu.models.hf import hf_name
from rl_tpu.models.logprobs import next_token_logprobs
from rl_tpu.records import Canary, CanaryTokens, TrainBatch, WeightBundle
from rl_tpu.sync.endpoints import pack_buckets
from rl_tpu.sync.registry import make_transport
from rl_tpu.trainer import canary, checkpoint, lora, weights
from rl_tpu.trainer.parallelize import materialize, parallelize
from rl_tpu.trainer.update import PolicyUpdate


def attention(implementation: str | None, device: Device, param_dtype: torch.dtype) -> str:
    """`trainer.attn_implementation`, or by default eager for bf16 on CPU: PyTorch's bf16 CPU flash-attention
    backward took 0.42 of a 1.7 s reference train step (eager attention: 1.05 s in all), else sdpa."""
    if implementation:
        return implementation
    return "eager" if device.kind == "cpu" and param_dtype == torch.bfloat16 else "sdpa"


def pad_id(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    pad = config.get("pad_token_id")
    eos = config.get("eos_token_id") or 0
    # Llama 3 lists several end tokens; any of them pads (padded positions are masked out)
    return int(pad if pad is not None else (eos[0] if isinstance(eos, list) else eos))


class TrainerWorker:
    """One FSDP2 rank. Ray runs one per rank; every public method is collective across ranks."""

    def __init__(
        self,
        cfg: RunConfig,
        model_path: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        log_dir: str | None = None,
        binding: CpuBinding | None = None,
    ):
        """`master_addr:master_port` is on rank 0's node; `cfg.device` is resolved on this actor's own node.

        `binding`: the rank's threads and cores (rl_tpu/cluster/cores.py); None: `trainer.threads_per_rank`, unpinned."""
        self.name = actor_name("trainer", rank)
        send_output_to_file(log_dir, self.name)
        placement.require_model_on_node(self.name, model_path)
        rendezvous.set_rank_env(master_addr, master_port, rank, world_size)
        # before the process group starts its threads, which inherit the pinning
        binding = binding or CpuBinding(cfg.trainer.threads_per_rank)
        self.borrower = Borrower(binding, binding.apply(self.name))
        self.cfg, self.rank, self.world_size, self.model_path = cfg, rank, world_size, model_path
        self.device = Device.resolve(cfg.device, rendezvous.local_device_index())
        self.device.select()
        if self.device.dist_backend == "gloo":
            rendezvous.bind_gloo_to_node_ip()
        dist.init_process_group(self.device.dist_backend, rank=rank, world_size=world_size)
        mesh = init_device_mesh(self.device.kind, (world_size,))
        self.lora_sync = cfg.lora_sync  # None: full fine-tuning
        self.adapter_config: dict | None = None  # a LoRA policy's adapter_config.json, set by _load_model
        self.model = self._load_model(mesh)
        # a LoRA policy's reference is its own base, the adapters bypassed (lora.adapters_off): no second model
        with_ref = (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and self.lora_sync is None
        self.ref_model = self._load_model(mesh).requires_grad_(False) if with_ref else None
        self.update = PolicyUpdate(
            cfg, self.model, self.ref_model, self.device, rank, world_size, pad_id(model_path), self.borrower
        )
        self.optimizer = self.update.optimizer
        self.served_dtype = cfg.model.torch_dtype
        self.served = weights.served_params(self.model, self.lora_sync)  # what each sync sends, by served name
        # a LoRA policy's base never changes: its checksum, taken once, goes with every adapter for the engines to
        # compare, and with every checkpoint for a resumed run to compare
        self.base_checksum = weights.base_checksum(self.model, self.served_dtype, rank) if self.lora_sync else None
        # a sender that engines connect to (collective, on rank 0) listens on its own node's address
        self.transport = make_transport(
            cfg.sync.transport,
            cfg.sync.shm_dir,
            host=master_addr,
            receivers=cfg.sampler.num_engines,
            device=self.device,
        )
        if rank == 0 or self.transport.any_rank_sends:
            specs = weights.served_specs(self.served, self.served_dtype)
            self.transport.prepare(sum(spec.nbytes for spec in specs.values()))

    def _load_model(self, mesh) -> torch.nn.Module:
        """Shard first, then fill: the model is built on the meta device and sharded, rank 0 reads the
        checkpoint and each rank receives only its shard, so no rank but 0 ever holds a full copy."""
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(self.cfg.seed)
        param_dtype = self.cfg.model.torch_dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(self.model_path),
                dtype=torch.float32,
                attn_implementation=attention(self.cfg.trainer.attn_implementation, self.device, param_dtype),
            )
        if self.lora_sync is not None:  # before sharding, once: a LoRA run loads no reference model
            self.adapter_config = lora.add_adapters(model, self.cfg.actor.lora, param_dtype)
        model = parallelize(
            model,
            self.device,
            mesh,
            param_dtype,
            self.cfg.trainer.activation_checkpointing,
            self.cfg.trainer.compile,
            self.cfg.model.fp32_residual,
        )
        materialize(model, self.device.torch_device)
        full = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32) if self.rank == 0 else None
        if self.lora_sync is not None and full is not None:
            # PEFT's initialisation (B = 0: the policy starts as the base), drawn once on rank 0 from the seed, so
            # every world size starts from the same adapter
            torch.manual_seed(self.cfg.seed)
            lora.add_adapters(full, self.cfg.actor.lora, torch.float32)
        set_model_state_dict(
            model,
            full.state_dict() if full is not None else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        # buffers outside the state dict (rotary frequencies) were left uninitialised by to_empty
        loaded = dict(full.named_buffers()) if full is not None else {}
        for name, buffer in model.named_buffers():
            if self.rank == 0:
                buffer.copy_(loaded[hf_name(name)])
            dist.broadcast(buffer, src=0)
        self.borrower.attach(model)
        return model

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.update.train_step(batch)

    def token_kl(self, batch: TrainBatch) -> list[list[float]]:
        return self.update.token_kl(batch)

    def take_recorded(self) -> dict[int, dict[str, list[float]]]:
        """This rank's per-token figures of the last step's recorded rows (`TrainBatch.recorded`)."""
        return self.update.totals.recorded.take()

    def next_token_logprobs(self, sequences: list[list[int]]) -> torch.Tensor:
        """The policy's full next-token log-softmax rows (`rl_tpu.consistency`); world size 1 only."""
        return next_token_logprobs(self.model.eval(), sequences, self.device.torch_device)

    def score_canary(self, version: int, tokens: CanaryTokens) -> Canary:
        """The weight canary under the policy's weights now, as `version` (`rl_tpu/trainer/canary.py`)."""
        return canary.score_canary(self.model, tokens, version, str(self.cfg.model.dtype), self.device.torch_device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights in Hugging Face names on every rank's CPU (collective: all ranks call it)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def served_buckets(self, senders: int = 1) -> Iterator[dict[str, torch.Tensor] | None]:
        device = self.device.torch_device if self.transport.on_device else torch.device("cpu")
        return weights.served_buckets(
            self.served, self.served_dtype, self.cfg.sync.bucket_mb, self.rank, senders, device
        )

    def publish_weights(self, version: int, release_memory: bool = False) -> WeightBundle:
        """Stream the served weights (a LoRA policy's adapter alone, `actor.lora.sync=adapter`) into the transport;
        returns this rank's part of the bundle.

        Where the transport lets any rank send (`object_store`), the ranks share the buckets, so
        that checksums and staging are split and no rank holds the whole bundle's staged bytes;
        otherwise rank 0 sends them all and the other ranks' parts are empty."""
        senders = self.world_size if self.transport.any_rank_sends else 1
        bundle = pack_buckets(self.served_buckets(senders), version, self.transport)
        if release_memory:  # colocated: the engine wakes on this device next
            self.device.release_cached_memory()
        if self.lora_sync == "adapter" and self.rank == 0:
            bundle = replace(bundle, adapter=self.adapter_config, base_checksum=self.base_checksum)
        return bundle

    def handshake(self, samplers: list) -> None:
        """The transport's start-up handshake (`Transport.handshake`), which the controller runs once: rank 0
        makes its offer, every engine listens for it, and rank 0 connects to what they answer."""
        if self.rank != 0:
            return
        import ray

        specs = weights.served_specs(self.served, self.served_dtype)
        offer = self.transport.offer(specs, int(self.cfg.sync.bucket_mb * 2**20))
        answers = ray.get([sampler.listen.remote(offer) for sampler in samplers], timeout=self.cfg.ray.start_timeout_s)
        self.transport.connect(offer, answers, self.device.torch_device)

    def export(self, folder: str) -> str | None:
        """A Hugging Face folder of the policy in `model.dtype`, streamed bucket by bucket (`weights.export_hf_folder`).

        A LoRA policy: its adapter as a PEFT folder (fp32), and with `actor.lora.export_merged` the merged model
        as a Hugging Face folder beside it (FOLDER_merged)."""
        if self.lora_sync is None:
            return self._export_hf(self.served, folder)
        if self.cfg.actor.lora.export_merged:
            self._export_hf(lora.merged_params(self.model), f"{folder}_merged")
        adapter = lora.adapter_params(self.model)
        return weights.export_adapter_folder(adapter, self.adapter_config, self.model_path, folder, self.rank)

    def _export_hf(self, params: dict, folder: str) -> str | None:
        buckets = weights.served_buckets(params, self.served_dtype, self.cfg.sync.bucket_mb, self.rank)
        return weights.export_hf_folder(buckets, self.model_path, folder, self.rank, self.cfg.model.dtype)

    def save_checkpoint(self, folder: str, driver_files: dict[str, str] | None = None) -> None:
        """`driver_files`: {name: text} of the driver's part, written into the checkpoint before it is complete."""
        state = (self.model, self.optimizer, self.update.scheduler)
        checkpoint.save_checkpoint(folder, *state, self.model_path, self.rank, self.base_checksum, driver_files)

    def load_checkpoint(self, folder: str) -> None:
        checkpoint.load_checkpoint(folder, self.model, self.optimizer, self.update.scheduler, self.base_checksum)

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
