"""The memory plan's items (`rl_tpu/controller/memory_plan.py`) that every role's estimate of itself is made of
(`trainer.memory`, `sampler.memory`): a named size and the settings that shrink it, a process's own memory besides
its model's, the caching allocator's slack, and what a weight bundle takes where a transport keeps or checks it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_tpu.config import RunConfig
from rl_tpu.models.shape import ModelShape
from rl_tpu.sync.bundle import CHECKSUM_CHUNK_WORDS

GiB = 2**30
# A process's memory besides its model's, on CPU: its peak resident memory on the 3.3M reference model less that
# model's weights, AdamW state and KV cache (benchmarks/results/grpo_step.json: trainer 0.85 GiB, engine 1.75 with a
# 1 GiB cache); the driver's is the largest recorded, a 0.5B GSM8K run's (lora_sync.json: 1.25 GiB)
CPU_PROCESS = {"trainer": int(0.80 * GiB), "engine": int(0.75 * GiB), "driver": int(1.25 * GiB)}
DEVICE_PROCESS = GiB // 2  # on an accelerator: a CUDA context and library workspaces (typical; not measured here)
# an accelerator process's host memory: its CPU figure and 1 GiB for the accelerator libraries (typical; not measured)
HOST_PROCESS = {name: n + GiB for name, n in CPU_PROCESS.items() if name != "driver"}
# torch's caching allocator reserves more than it allocates (blocks cached, split, fragmented): a share of what a
# process allocates on an accelerator (typical; not measured here: the recorded peaks are allocations)
ALLOCATOR_SLACK = 0.10
# `bundle.device_checksum` of a bucket of b bytes: its b/2 16-bit words widened to int64 (4b), and the offset words
# made from them (4b more) while both exist; then two int64 chunks at a time (the words' weights and products)
CHECKSUM_COPIES, CHECKSUM_WORK = 8, 2 * 8 * CHECKSUM_CHUNK_WORDS


@dataclass(frozen=True)
class Item:
    what: str
    bytes: int
    keys: tuple[str, ...] = ()  # the settings that shrink it


def checksum_item(bucket: int) -> Item:
    """`bundle.device_checksum`'s working copies of one bucket, on the device where the bucket is checked."""
    return Item("a bucket's checksum, its int64 words", CHECKSUM_COPIES * bucket + CHECKSUM_WORK, ("sync.bucket_mb",))


def slack(allocated: list[Item]) -> Item:
    """On an accelerator, the caching allocator's slack over what the items allocate through it."""
    allocated_bytes = sum(item.bytes for item in allocated)
    return Item(f"the caching allocator's slack, {ALLOCATOR_SLACK:.0%}", int(ALLOCATOR_SLACK * allocated_bytes))


def sends_adapter(cfg: RunConfig, kind: str) -> bool:
    """Whether each sync sends a LoRA policy's adapter alone (`cfg.lora_sync`, decided with the device resolved)."""
    return dataclasses.replace(cfg, device=kind).lora_sync == "adapter"


def served_bytes(cfg: RunConfig, shape: ModelShape, kind: str) -> int:
    """A weight bundle in the served dtype: the full weights, or a LoRA policy's adapter alone."""
    served = shape.adapter_parameters(cfg.actor.lora) if sends_adapter(cfg, kind) else shape.parameters
    return cfg.model.torch_dtype.itemsize * served
