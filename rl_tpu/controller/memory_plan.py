"""The memory plan logged at start: what each trainer rank, engine and the driver will hold at its peak, summed per
device (each GPU; on CPU the host's RAM) and on the host, against their memory. A run whose estimate does not fit
is refused, naming its largest items and the keys that shrink them (`trainer.memory_check`: refuse, warn or off).

An estimate made from the config, the model's config.json and its weight files' headers (nothing is loaded), of
what the code holds: fp32 master weights, gradients and AdamW's two states per trainable weight, sharded over the
ranks; a LoRA trainer's frozen base in the served dtype; the largest FSDP unit unsharded; activations; the bundles
a transport keeps and their checksums' working copies; the engines' weights, KV cache and received buckets; on an
accelerator, the caching allocator's slack, and on the host the processes and rank 0's whole model read in fp32.
How close it came to the recorded peaks: docs/performance.md#the-memory-plan. Each role makes its own estimate of
itself (`trainer.memory`, `sampler.memory`, from `cluster.memory_items`); the plan places them on devices and the
host, with the settings the actors start with (a controller module).
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
from rl_tpu.cluster.memory_items import CPU_PROCESS, HOST_PROCESS, GiB, Item
from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import GPU_MEMORY_COLOCATED, GPU_MEMORY_OWN_DEVICE
from rl_tpu.models.families import model_shape
from rl_tpu.models.shape import ModelShape
from rl_tpu.sampler import memory as engine_memory
from rl_tpu.trainer import memory as trainer_memory

log = logging.getLogger(__name__)

RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor stops actors past this share of the host's memory
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v2, v1
DEVICE_WORD = {"cuda": "GPU", "tpu": "TPU chip"}


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
    phases = trainer_memory.phases if kind == "cpu" else trainer_memory.host_phases
    processes = [Process("driver", (Item("process: the loop, tokenizer, data", CPU_PROCESS["driver"]),))]
    processes.append(at_peak("trainer rank 0", phases(cfg, shape, kind, 0)))
    if ranks > 1:
        others = "trainer rank 1" if ranks == 2 else f"trainer ranks 1-{ranks - 1}"
        processes.append(at_peak(others, phases(cfg, shape, kind, 1), ranks - 1))
    if kind == "cpu":
        engine = at_peak(
            "engine worker" if workers > 1 else "engine",
            engine_memory.phases(cfg, shape, kind, None, engine_share(cfg, "disaggregated")),
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
    rank0 = trainer_memory.phases(cfg, shape, kind, 0)
    engine = engine_memory.phases(cfg, shape, kind, capacity, engine_share(cfg, layout))
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


def engine_share(cfg: RunConfig, layout: str) -> float:
    """The share of its device an engine's vLLM is given (`sampler.gpu_memory_utilization`, else by layout)."""
    colocated = layout == "colocated"
    return cfg.sampler.gpu_memory_utilization or (GPU_MEMORY_COLOCATED if colocated else GPU_MEMORY_OWN_DEVICE)


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
