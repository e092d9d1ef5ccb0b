"""The trainer's memory estimate of itself, for the memory plan (`rl_tpu/controller/memory_plan.py`): each rank's
items on its device and on the host in each phase, from the config and the model's shape."""

from __future__ import annotations

from rl_tpu.cluster.device import Device
from rl_tpu.cluster.memory_items import (
    CPU_PROCESS,
    DEVICE_PROCESS,
    HOST_PROCESS,
    Item,
    checksum_item,
    sends_adapter,
    served_bytes,
    slack,
)
from rl_tpu.config import RunConfig
from rl_tpu.models.logprobs import bucketed
from rl_tpu.models.shape import ModelShape
from rl_tpu.sync.registry import transport_class
from rl_tpu.trainer.worker import attention

# the completions' logits: kept for the chunked log-softmax, their gradient as it accumulates, one chunk's gradient
LOGITS_COPIES = 3
CHUNK_COPIES = 3  # one chunk's fp32 log-softmax, its exponential and its gradient


def activation_items(cfg: RunConfig, shape: ModelShape, kind: str) -> list[Item]:
    """One micro-batch's saved activations (its longest rows), and its logits over the vocabulary.

    A block keeps for its backward what its family's shape says (`ModelShape.block_saved_bytes`), in the compute
    dtype; eager attention also keeps its probabilities over the sequence (fp32 and the compute dtype). Checkpointed, each block keeps its input (the
    residual stream: fp32 with model.fp32_residual) and one block is recomputed at a time."""
    t, dtype = cfg.trainer, cfg.model.torch_dtype
    size = dtype.itemsize
    completion = bucketed(cfg.completion_tokens, t.seq_buckets)
    seq = bucketed(cfg.data.max_prompt_length, t.seq_buckets) + completion
    tokens = t.micro_batch_size * seq
    block = shape.block_saved_bytes(size)
    if attention(t.attn_implementation, Device(kind), dtype) == "eager":
        block += shape.heads * seq * (4 + size)
    if t.activation_checkpointing:
        residual = 4 if cfg.model.fp32_residual else size
        saved = tokens * shape.layers * shape.hidden * residual + tokens * block
    else:
        saved = tokens * shape.layers * block
    rows = t.micro_batch_size * shape.vocab
    logits = rows * (completion * size * LOGITS_COPIES + min(t.logprob_chunk_size, completion) * 4 * CHUNK_COPIES)
    keys = ("trainer.micro_batch_size", "data.max_prompt_length", "sampler.response_length")
    if not t.activation_checkpointing:
        keys += ("trainer.activation_checkpointing",)
    checkpointed = ", checkpointed" if t.activation_checkpointing else ""
    logits_keys = ("trainer.micro_batch_size", "sampler.response_length", "trainer.logprob_chunk_size")
    return [
        Item(f"activations: {t.micro_batch_size} x {seq} tokens{checkpointed}", saved, keys),
        Item(f"logits: {t.micro_batch_size} x {completion} x {shape.vocab}", logits, logits_keys),
    ]


def phases(cfg: RunConfig, shape: ModelShape, kind: str, rank: int) -> dict[str, list[Item]]:
    """A trainer rank's items on its device (on CPU, the host) in each phase: between steps, training, publishing,
    loading. Rank 0 reads the checkpoint into a whole fp32 model in host memory and sends each rank its shard a
    tensor at a time (`TrainerWorker._load_model`): on CPU that model is in the rank's memory; on an accelerator a
    device holds one weight in fp32 at a time, and the whole model is on the host (`host_phases`)."""
    lora, size = cfg.actor.lora, cfg.model.torch_dtype.itemsize
    ranks, params = cfg.trainer.world_size, shape.parameters
    adapter = shape.adapter_parameters(lora) if lora.enabled else 0
    trainable = adapter or params
    shards = ("trainer.world_size",) if kind != "cpu" else ()  # on CPU the ranks share the host's memory
    fewer = ("actor.lora.lora_rank", *shards)
    process = Item("process: torch, transformers, Ray", CPU_PROCESS["trainer"] if kind == "cpu" else DEVICE_PROCESS)
    if lora.enabled:
        weights = [Item(f"frozen base, {cfg.model.dtype}", size * params // ranks, shards)]
        weights.append(Item("LoRA adapter, fp32", 4 * adapter // ranks, ("actor.lora.lora_rank",)))
    else:
        weights = [Item("fp32 master weights", 4 * params // ranks, fewer)]
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not lora.enabled:
        ref_keys = ("actor.use_kl_loss", "algorithm.use_kl_in_reward", "actor.lora.lora_rank")
        weights.append(Item("reference model, fp32", 4 * params // ranks, ref_keys))
    resident = [process, *weights, Item("AdamW's two fp32 states", 8 * trainable // ranks, fewer)]
    resident += published_items(cfg, shape, kind, rank)
    training = [*resident, Item("fp32 gradients", 4 * trainable // ranks, fewer)]
    if ranks > 1 or size < 4:  # FSDP2 (one fp32 rank trains without it): a unit is gathered whole in turn
        grads = 0 if lora.enabled else (size + 4 if size < 4 else 4)  # its gradient, reduced in fp32
        training.append(Item("FSDP: the largest unit unsharded, its gradient", shape.largest_unit * (size + grads)))
    training += activation_items(cfg, shape, kind)
    bucket = min(int(cfg.sync.bucket_mb * 2**20), served_bytes(cfg, shape, kind))
    gather = 0 if sends_adapter(cfg, kind) else 4 * shape.largest_weight
    publishing = [*resident, Item("a bucket, and a weight gathered in fp32", bucket + gather, ("sync.bucket_mb",))]
    if transport_class(cfg.sync.transport).on_device and rank == 0:
        publishing.append(checksum_item(bucket))
    if kind == "cpu" and rank == 0:
        loading = [process, *weights, Item("the whole model in fp32, once", 4 * (params + adapter))]
    else:  # torch broadcasts the state dict a tensor at a time, each whole on every rank's device
        loading = [process, *weights, Item("a weight being loaded, in fp32", 4 * shape.largest_weight)]
    phases = {"between steps": resident, "training": training, "publishing": publishing, "loading": loading}
    if kind == "cpu":
        return phases
    return {phase: [*items, slack(items[1:])] for phase, items in phases.items()}  # the process's own is not torch's


def host_phases(cfg: RunConfig, shape: ModelShape, kind: str, rank: int) -> dict[str, list[Item]]:
    """A trainer rank's host memory on an accelerator run: its process, its share of a host transport's bundles,
    and on rank 0, while loading, the whole model read in fp32 (`phases`), a reference model's in turn."""
    adapter = shape.adapter_parameters(cfg.actor.lora) if cfg.actor.lora.enabled else 0
    process = Item("process: torch, accelerator libraries, Ray", HOST_PROCESS["trainer"])
    phases = {"running": [process, *published_items(cfg, shape, kind, rank, on_host=True)]}
    if rank == 0:
        phases["loading"] = [process, Item("the whole model in fp32, once", 4 * (shape.parameters + adapter))]
    return phases


def published_items(cfg: RunConfig, shape: ModelShape, kind: str, rank: int, on_host: bool = False) -> list[Item]:
    """The rank's share of the bundles its transport keeps until the engines have loaded them (`kept_versions`: the
    last, or the one before too), where they lie: on its device (a device transport's) or in the host's shared
    memory, which on CPU is counted in the rank's resident memory, as the benchmarks measure it. A transport that
    sends bucket by bucket (collective) keeps none."""
    transport = transport_class(cfg.sync.transport)
    senders = cfg.trainer.world_size if transport.any_rank_sends else 1
    in_host_memory = not transport.on_device
    if rank >= senders or in_host_memory != (on_host or kind == "cpu"):  # counted in the other budget
        return []
    kept = transport.kept_versions
    what = "its share of the weights it published" + (f", the last {kept} versions" if kept > 1 else "")
    return [Item(what, kept * served_bytes(cfg, shape, kind) // senders, ("sync.transport",))]
