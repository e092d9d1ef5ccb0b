"""The memory plan logged at start: what each trainer rank, engine and the driver will hold at its peak, summed per
device (each GPU; on CPU the host's RAM) and on the host, against their memory. A run whose estimate does not fit
is refused, naming its largest items and the keys that shrink them (`trainer.memory_check`: refuse, warn or off).

An estimate made from the config, the model's config.json and its weight files' headers (nothing is loaded), of
what the code holds: fp32 master weights, gradients and AdamW's two states per trainable weight, sharded over the
ranks; a LoRA trainer's frozen base in the served dtype; the largest FSDP unit unsharded; activations; the bundles
a transport keeps and their checksums' working copies; the engines' weights, KV cache and received buckets; on an
accelerator, the caching allocator's slack, and on the host the processes and rank 0's whole model read in fp32.
How close it came to the recorded peaks: docs/performance.md#the-memory-plan. It may import the config, the model
families' shapes and the settings the actors start with (a controller module).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_tpu.cluster import placement
from rl_tpu.cluster.device import Device
from rl_tpu.config import RunConfig, value_of
from rl_tpu.controller.actors import GPU_MEMORY_COLOCATED, GPU_MEMORY_OWN_DEVICE
from rl_tpu.models.families import model_shape
from rl_tpu.models.logprobs import bucketed
from rl_tpu.models.shape import ModelShape
from rl_tpu.sampler.engine import CPU_KV_CACHE_GB
from rl_tpu.sync.bundle import CHECKSUM_CHUNK_WORDS
from rl_tpu.sync.registry import transport_class
from rl_tpu.trainer.worker import attention

log = logging.getLogger(__name__)

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
RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor stops actors past this share of the host's memory
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
# the completions' logits: kept for the chunked log-softmax, their gradient as it accumulates, one chunk's gradient
LOGITS_COPIES = 3
CHUNK_COPIES = 3  # one chunk's fp32 log-softmax, its exponential and its gradient
DEVICE_WORD = {"cuda": "GPU", "tpu": "TPU chip"}


@dataclass(frozen=True)
class Item:
    what: str
    bytes: int
    keys: tuple[str, ...] = ()  # the settings that shrink it


@dataclass(frozen=True)
class Process:
    name: str  # and the phase at its peak
    items: tuple[Item, ...]
    count: int = 1  # processes alike (trainer ranks 1..n-1, engines)
    note: str = ""  # its other phases

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.items)


@dataclass(frozen=True)
class Budget:
    """One device's (or the host's) processes against its memory."""

    name: str
    processes: tuple[Process, ...]
    capacity: int | None  # None: not known here, not checked
    capacity_note: str = ""
    advice: tuple[str, ...] = ()  # layout-wide changes: fewer actors on the host, placement

    @property
    def total(self) -> int:
        return sum(p.bytes * p.count for p in self.processes)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.total <= self.capacity


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    budgets: tuple[Budget, ...]

    def lines(self) -> list[str]:
        out = ["memory plan (an estimate; its accuracy: docs/performance.md#the-memory-plan)"]
        for budget in self.budgets:
            of = f"of {gib(budget.capacity)}{budget.capacity_note}" if budget.capacity else "(its memory unknown here)"
            out.append(f"  {budget.name}: {gib(budget.total)} {of}")
            for p in budget.processes:
                each = f"{p.count} x " if p.count > 1 else ""
                out.append(f"    {p.name:<58}{each}{gib(p.bytes)}" + (f"  ({p.note})" if p.note else ""))
                out += [f"      {item.what:<56}{gib(item.bytes)}" for item in p.items if item.bytes]
        return out

    def refusal(self) -> str | None:
        """Why the run cannot fit, naming the largest items and their keys; None when every budget fits."""
        over = [b for b in self.budgets if not b.fits]
        if not over:
            return None
        budget = over[0]
        items = sorted((i for p in budget.processes for i in p.items), key=lambda i: -i.bytes)[:3]
        named = "; ".join(f"{i.what} {gib(i.bytes)}" + (f" ({', '.join(i.keys)})" if i.keys else "") for i in items)
        also = f" Or: {', '.join(budget.advice)}." if budget.advice else ""
        return (
            f"the memory plan (an estimate) puts {gib(budget.total)} on {budget.name}, more than its "
            f"{gib(budget.capacity)}{budget.capacity_note}. Largest items: {named}.{also} Change those settings, or set "
            "trainer.memory_check=warn to start anyway (or off: no plan)"
        )


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


def trainer_phases(cfg: RunConfig, shape: ModelShape, kind: str, rank: int) -> dict[str, list[Item]]:
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
        weights = [Item(f"frozen base, {value_of(cfg.model.dtype)}", size * params // ranks, shards)]
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
    if transport_class(value_of(cfg.sync.transport)).on_device and rank == 0:
        publishing.append(checksum_item(bucket))
    if kind == "cpu" and rank == 0:
        loading = [process, *weights, Item("the whole model in fp32, once", 4 * (params + adapter))]
    else:  # torch broadcasts the state dict a tensor at a time, each whole on every rank's device
        loading = [process, *weights, Item("a weight being loaded, in fp32", 4 * shape.largest_weight)]
    phases = {"between steps": resident, "training": training, "publishing": publishing, "loading": loading}
    if kind == "cpu":
        return phases
    return {phase: [*items, slack(items[1:])] for phase, items in phases.items()}  # the process's own is not torch's


def checksum_item(bucket: int) -> Item:
    """`bundle.device_checksum`'s working copies of one bucket, on the device where the bucket is checked."""
    return Item("a bucket's checksum, its int64 words", CHECKSUM_COPIES * bucket + CHECKSUM_WORK, ("sync.bucket_mb",))


def slack(allocated: list[Item]) -> Item:
    """On an accelerator, the caching allocator's slack over what the items allocate through it."""
    allocated_bytes = sum(item.bytes for item in allocated)
    return Item(f"the caching allocator's slack, {ALLOCATOR_SLACK:.0%}", int(ALLOCATOR_SLACK * allocated_bytes))


def host_phases(cfg: RunConfig, shape: ModelShape, kind: str, rank: int) -> dict[str, list[Item]]:
    """A trainer rank's host memory on an accelerator run: its process, its share of a host transport's bundles,
    and on rank 0, while loading, the whole model read in fp32 (`trainer_phases`), a reference model's in turn."""
    adapter = shape.adapter_parameters(cfg.actor.lora) if cfg.actor.lora.enabled else 0
    process = Item("process: torch, accelerator libraries, Ray", HOST_PROCESS["trainer"])
    phases = {"running": [process, *published_items(cfg, shape, kind, rank, on_host=True)]}
    if rank == 0:
        phases["loading"] = [process, Item("the whole model in fp32, once", 4 * (shape.parameters + adapter))]
    return phases


def sends_adapter(cfg: RunConfig, kind: str) -> bool:
    """Whether each sync sends a LoRA policy's adapter alone (`cfg.lora_sync`, decided with the device resolved)."""
    return dataclasses.replace(cfg, device=kind).lora_sync == "adapter"


def served_bytes(cfg: RunConfig, shape: ModelShape, kind: str) -> int:
    """A weight bundle in the served dtype: the full weights, or a LoRA policy's adapter alone."""
    served = shape.adapter_parameters(cfg.actor.lora) if sends_adapter(cfg, kind) else shape.parameters
    return cfg.model.torch_dtype.itemsize * served


def published_items(cfg: RunConfig, shape: ModelShape, kind: str, rank: int, on_host: bool = False) -> list[Item]:
    """The rank's share of the bundles its transport keeps until the engines have loaded them (`kept_versions`: the
    last, or the one before too), where they lie: on its device (a device transport's) or in the host's shared
    memory, which on CPU is counted in the rank's resident memory, as the benchmarks measure it. A transport that
    sends bucket by bucket (collective) keeps none."""
    transport = transport_class(value_of(cfg.sync.transport))
    senders = cfg.trainer.world_size if transport.any_rank_sends else 1
    in_host_memory = not transport.on_device
    if rank >= senders or in_host_memory != (on_host or kind == "cpu"):  # counted in the other budget
        return []
    kept = transport.kept_versions
    what = "its share of the weights it published" + (f", the last {kept} versions" if kept > 1 else "")
    return [Item(what, kept * served_bytes(cfg, shape, kind) // senders, ("sync.transport",))]


def engine_phases(
    cfg: RunConfig, shape: ModelShape, kind: str, layout: str, capacity: int | None
) -> dict[str, list[Item]]:
    """An engine's items generating, installing a bundle, and asleep (a colocated CUDA engine while the trainer
    trains), on CPU loading too; with tensor parallelism, one of its worker processes' (each device holds a shard of
    the weights and a cache of its own)."""
    s, dtype = cfg.sampler, cfg.model.torch_dtype
    process = Item("process: vLLM", CPU_PROCESS["engine"] if kind == "cpu" else DEVICE_PROCESS)
    weights = dtype.itemsize * shape.parameters
    what = f"weights, {value_of(cfg.model.dtype)}"
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
            Item(f"weights, {value_of(cfg.model.dtype)}, as loaded", loaded, ("model.dtype",)),
            Item("weight files, mapped while loading", loaded, ("model.dtype",)),
        ]
    if s.kv_cache_gb is not None or kind == "cpu":
        items.append(Item("KV cache", int((s.kv_cache_gb or CPU_KV_CACHE_GB) * GiB), ("sampler.kv_cache_gb",)))
    elif capacity is not None:  # vLLM takes its share of the device and keeps for its cache what its weights leave
        share = s.gpu_memory_utilization or (GPU_MEMORY_COLOCATED if layout == "colocated" else GPU_MEMORY_OWN_DEVICE)
        rest = max(0, int(share * capacity) - process.bytes - weights)
        keys = ("sampler.gpu_memory_utilization", "sampler.kv_cache_gb")
        items.append(Item(f"KV cache and buffers: the rest of {share:g} of the device", rest, keys))
    if transport_class(value_of(cfg.sync.transport)).on_device:
        phases["installing"] = [*items, *installing_items(cfg, shape, kind)]
    return phases


def installing_items(cfg: RunConfig, shape: ModelShape, kind: str) -> list[Item]:
    """What an engine allocates through torch, outside vLLM's share, to install a device transport's bundle: each
    bucket's checksum, taken where it lies, one at a time, and the buckets themselves where the transport gives the
    engine copies of its own (nccl), all received before any is checked or loaded (`endpoints.unpack`)."""
    served = served_bytes(cfg, shape, kind)
    outside = [checksum_item(min(int(cfg.sync.bucket_mb * 2**20), served))]
    if transport_class(value_of(cfg.sync.transport)).copies:
        outside.insert(0, Item("the bundle's buckets, as received", served, ("sync.transport",)))
    return [*outside, slack(outside)]


def at_peak(name: str, phases: dict[str, list[Item]], count: int = 1, among: tuple[str, ...] = ()) -> Process:
    """The process at its largest phase (of `among`, default all but the idle ones), its other phases noted."""
    among = among or tuple(p for p in phases if p not in ("between steps", "asleep"))
    total = {phase: sum(i.bytes for i in phases[phase]) for phase in among}
    peak = max(among, key=total.get)
    note = ", ".join(f"{phase} {gib(total[phase])}" for phase in among if phase != peak)
    return Process(f"{name}, {peak}", tuple(phases[peak]), count, note)


def build(
    cfg: RunConfig,
    shape: ModelShape,
    kind: str,
    capacity: int | None,
    layout: str = "disaggregated",
    host: int | None = None,
) -> MemoryPlan:
    """The plan for `kind` (cpu, cuda, tpu) and a `layout` of accelerators (on CPU every actor is on the host).
    `capacity`: each device's memory, on CPU the host's; `host`: the host's on an accelerator run (None: unknown).
    Every actor of a local cluster is on this host."""
    if kind == "cpu":
        return MemoryPlan((host_budget(cfg, shape, kind, capacity),))
    return MemoryPlan((*device_budgets(cfg, shape, kind, capacity, layout), host_budget(cfg, shape, kind, host)))


def host_budget(cfg: RunConfig, shape: ModelShape, kind: str, memory: int | None) -> Budget:
    """Every process on the host, each at its own peak, against the share of its memory Ray's monitor allows."""
    ranks, engines, workers = cfg.trainer.world_size, cfg.sampler.num_engines, cfg.sampler.tensor_parallel_size
    phases = trainer_phases if kind == "cpu" else host_phases
    processes = [Process("driver", (Item("process: the loop, tokenizer, data", CPU_PROCESS["driver"]),))]
    processes.append(at_peak("trainer rank 0", phases(cfg, shape, kind, 0)))
    if ranks > 1:
        others = "trainer rank 1" if ranks == 2 else f"trainer ranks 1-{ranks - 1}"
        processes.append(at_peak(others, phases(cfg, shape, kind, 1), ranks - 1))
    if kind == "cpu":
        engine = at_peak(
            "engine worker" if workers > 1 else "engine", engine_phases(cfg, shape, kind, "disaggregated", None)
        )
    else:
        engine = Process("engine worker" if workers > 1 else "engine", (Item("process: vLLM", HOST_PROCESS["engine"]),))
    processes.append(dataclasses.replace(engine, count=engines * workers))
    advice = tuple(key for key, n in (("trainer.world_size", ranks), ("sampler.num_engines", engines)) if n > 1)
    share = f" ({RAY_MEMORY_THRESHOLD:.0%} of its memory: past that Ray's memory monitor stops actors)"
    capacity = int(RAY_MEMORY_THRESHOLD * memory) if memory is not None else None
    return Budget("this host", tuple(processes), capacity, share, advice)


def device_budgets(cfg: RunConfig, shape: ModelShape, kind: str, capacity: int | None, layout: str) -> list[Budget]:
    """Rank 0's device and an engine's, or (colocated) the one they share."""
    rank0 = trainer_phases(cfg, shape, kind, 0)
    engine = engine_phases(cfg, shape, kind, layout, capacity)
    device = DEVICE_WORD.get(kind, kind)
    if layout == "disaggregated":
        return [
            Budget(f"the {device} of trainer rank 0", (at_peak("trainer rank 0", rank0),), capacity),
            Budget(f"each engine's {device}", (at_peak("engine", engine),), capacity),
        ]
    # colocated (CUDA only: a TPU engine cannot sleep): the engine sleeps while the trainer trains, and wakes beside
    # the trainer's state between steps
    asleep = [at_peak("trainer rank 0", rank0), at_peak("engine 0", engine, among=("asleep",))]
    awake = [at_peak("trainer rank 0", rank0, among=("between steps",)), at_peak("engine 0", engine)]
    together = max(asleep, awake, key=lambda ps: sum(p.bytes for p in ps))
    name = f"the {device} of trainer rank 0 and engine 0"
    return [Budget(name, tuple(together), capacity, advice=("placement=disaggregated",))]


def host_memory() -> int:
    """This host's RAM, or its container's memory limit where that is lower (cgroup v2 or v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in map(Path, CGROUP_LIMITS):
        limit = path.read_text().strip() if path.is_file() else ""
        total = min(total, int(limit)) if limit.isdigit() else total
    return total


def local_layout(cfg: RunConfig, kind: str) -> tuple[str, int | None]:
    """Before Ray starts, on a local cluster (this host): the layout the placement will choose, and each device's
    memory (CPU: the host's; CUDA: device 0's; else unknown)."""
    if kind == "cpu":
        return "disaggregated", host_memory()
    devices = {placement.ACCELERATOR_RESOURCE[kind]: float(torch.accelerator.device_count())}
    layout = placement.make_plan(cfg, kind, devices).layout
    return layout, Device(kind).total_memory()  # device 0's: the driver allocates nothing on it


def enforce(plan: MemoryPlan, mode: str) -> None:
    """Log the plan; past a device's memory refuse (`refuse`, a ValueError naming the keys) or warn (`warn`)."""
    log.info("%s", "\n".join(plan.lines()))
    why = plan.refusal()
    if why and mode == "refuse":
        raise ValueError(why)
    if why:
        log.warning("%s", why)


def check(cfg: RunConfig, model_path: Path) -> None:
    """The plan for this run, logged and enforced before Ray starts (`trainer.memory_check`); a remote cluster's
    devices are not known here, so its plan is not made."""
    if cfg.trainer.memory_check == "off":
        return
    if cfg.ray.address is not None:
        log.info(
            "memory plan: not made for ray.address=%s (its nodes are not known before Ray starts)", cfg.ray.address
        )
        return
    try:
        shape = model_shape(model_path)
    except KeyError as missing:  # not a plain decoder's config (its sizes under text_config, say)
        log.info("memory plan: not made: %s has no %s", model_path / "config.json", missing)
        return
    if not shape.parameters:  # weights in .bin files only: their sizes are not read without loading them
        log.info("memory plan: not made: %s has no safetensors weights", model_path)
        return
    kind = Device.resolve(cfg.device).kind
    layout, capacity = local_layout(cfg, kind)
    enforce(build(cfg, shape, kind, capacity, layout, host_memory()), cfg.trainer.memory_check)
