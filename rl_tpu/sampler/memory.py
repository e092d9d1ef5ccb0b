"""An engine's memory estimate of itself, for the memory plan (`rl_tpu/controller/memory_plan.py`): its items in
each phase, from the config, the model's shape and the share of its device vLLM is given."""

from __future__ import annotations

from rl_tpu.cluster.memory_items import CPU_PROCESS, DEVICE_PROCESS, GiB, Item, checksum_item, served_bytes, slack
from rl_tpu.config import RunConfig
from rl_tpu.models.shape import ModelShape
from rl_tpu.sampler.engine import CPU_KV_CACHE_GB
from rl_tpu.sync.registry import transport_class


def phases(cfg: RunConfig, shape: ModelShape, kind: str, capacity: int | None, share: float) -> dict[str, list[Item]]:
    """An engine's items generating, installing a bundle, and asleep (a colocated CUDA engine while the trainer
    trains), on CPU loading too; with tensor parallelism, one of its worker processes' (each device holds a shard of
    the weights and a cache of its own). `capacity`: its device's memory (None: not known); `share`: of it, what
    vLLM is given."""
    s, dtype = cfg.sampler, cfg.model.torch_dtype
    process = Item("process: vLLM", CPU_PROCESS["engine"] if kind == "cpu" else DEVICE_PROCESS)
    weights = dtype.itemsize * shape.parameters
    what = f"weights, {cfg.model.dtype}"
    if kind == "cpu" and shape.tied:  # vLLM's CPU backend packs a tied head into storage of its own
        weights, what = weights + dtype.itemsize * shape.embedding, f"{what}, and the tied head's own copy"
    if s.tensor_parallel_size > 1:
        weights, what = weights // s.tensor_parallel_size, f"{what}, a 1/{s.tensor_parallel_size} shard"
    spread = ("sampler.tensor_parallel_size",) if kind != "cpu" else ()  # on CPU the shards share the host
    items = [process, Item(what, weights, ("model.dtype", *spread))]
    phases = {"generating": items, "asleep": [process]}
    if kind == "cpu":
        # measured at 0.5B and 1.5B (docs/performance.md#the-memory-plan): vLLM's CPU backend keeps a packed copy of
        # the embedding beside it, and while loading (before packing) the weight files' mapped pages count besides
        # the weights read from them (files in the served dtype; one in another maps its own size)
        tp = s.tensor_parallel_size
        items.append(Item("the embedding's packed copy", dtype.itemsize * shape.embedding // tp, ("model.dtype",)))
        loaded = dtype.itemsize * shape.parameters // tp
        phases["loading"] = [
            process,
            Item(f"weights, {cfg.model.dtype}, as loaded", loaded, ("model.dtype",)),
            Item("weight files, mapped while loading", loaded, ("model.dtype",)),
        ]
    if s.kv_cache_gb is not None or kind == "cpu":
        items.append(Item("KV cache", int((s.kv_cache_gb or CPU_KV_CACHE_GB) * GiB), ("sampler.kv_cache_gb",)))
    elif capacity is not None:  # vLLM takes its share of the device and keeps for its cache what its weights leave
        rest = max(0, int(share * capacity) - process.bytes - weights)
        keys = ("sampler.gpu_memory_utilization", "sampler.kv_cache_gb")
        items.append(Item(f"KV cache and buffers: the rest of {share:g} of the device", rest, keys))
    if transport_class(cfg.sync.transport).on_device:
        phases["installing"] = [*items, *installing_items(cfg, shape, kind)]
    return phases


def installing_items(cfg: RunConfig, shape: ModelShape, kind: str) -> list[Item]:
    """What an engine allocates through torch, outside vLLM's share, to install a device transport's bundle: each
    bucket's checksum, taken where it lies, one at a time, and the buckets themselves where the transport gives the
    engine copies of its own (nccl), all received before any is checked or loaded (`endpoints.unpack`)."""
    served = served_bytes(cfg, shape, kind)
    outside = [checksum_item(min(int(cfg.sync.bucket_mb * 2**20), served))]
    if transport_class(cfg.sync.transport).copies:
        outside.insert(0, Item("the bundle's buckets, as received", served, ("sync.transport",)))
    return [*outside, slack(outside)]
