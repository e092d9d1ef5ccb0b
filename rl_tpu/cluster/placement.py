"""Where the actors run: the device kind, the layout, and Ray placement groups that are ready or fail in time.

The driver decides from the *cluster's* resources, never from its own host: a CPU head node
with GPU workers trains on the GPUs. A `Plan` is pure data (bundles and each actor's share of
its bundle), made before anything is reserved, so it can be checked and printed; `reserve`
turns it into placement groups and stops with the resources asked for and those the cluster
has when they are not ready within `ray.placement_timeout_s`.

Layouts:
- `disaggregated`: one bundle per trainer rank and one per engine, each with a device of its own.
- `colocated`: one bundle per trainer rank; engine i shares trainer rank i's bundle and device
  (half of an accelerator each, in Ray's accounting; on CUDA the engine sleeps while the trainer
  trains). On CPU the "device" is the bundle's cores, which trainer and engine then share.
- `auto`: disaggregated when the cluster's devices can hold both apart, else colocated.
TPU is always disaggregated: the TPU engine plugin has no sleep mode.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from rl_tpu.config import RayConfig, RunConfig, value_of

log = logging.getLogger(__name__)

# device kind -> the Ray resource that counts its devices
ACCELERATOR_RESOURCE = {"cuda": "GPU", "tpu": "TPU"}
COLOCATED_SHARE = 0.5  # of an accelerator, for a trainer rank and for the engine beside it


class PlacementError(RuntimeError):
    pass


def describe(resources: dict[str, float]) -> str:
    """`{CPU: 3, GPU: 1}`, leaving out Ray's bookkeeping resources (memory, node:..., object store)."""
    shown = {k: v for k, v in sorted(resources.items()) if k in ("CPU", "GPU", "TPU") or k.isupper()}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def device_kind(requested: str, cluster: dict[str, float]) -> str:
    """The device the actors use: `auto` takes the cluster's accelerators (GPU, then TPU), else the CPU."""
    requested = value_of(requested)
    if requested == "auto":
        return next((kind for kind, res in ACCELERATOR_RESOURCE.items() if cluster.get(res, 0) > 0), "cpu")
    resource = ACCELERATOR_RESOURCE.get(requested)
    if resource and cluster.get(resource, 0) <= 0:
        raise PlacementError(
            f"device={requested} needs {resource} resources, but the Ray cluster has "
            f"{describe(cluster)}: start the Ray nodes on the accelerator hosts, or use device=cpu"
        )
    return requested


@dataclass(frozen=True)
class Plan:
    layout: str  # "colocated" | "disaggregated"
    why: str  # how the layout was chosen, for the log
    trainer_bundles: tuple[dict[str, float], ...]  # one per trainer rank
    sampler_bundles: tuple[dict[str, float], ...]  # one per engine; empty when engines share the trainer bundles
    trainer_share: dict[str, float]  # what each trainer actor takes from its bundle
    sampler_share: dict[str, float]
    num_engines: int
    engines_sleep: bool = False  # engines release the device while the trainer trains (CUDA, colocated)
    trainer_labels: dict[str, str] = field(default_factory=dict)  # Ray node labels each bundle must match
    sampler_labels: dict[str, str] = field(default_factory=dict)

    @property
    def asked(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for bundle in (*self.trainer_bundles, *self.sampler_bundles):
            for key, value in bundle.items():
                total[key] = total.get(key, 0) + value
        return total

    def summary(self) -> str:
        parts = [f"trainer {len(self.trainer_bundles)} x {describe(self.trainer_bundles[0])}"]
        if self.sampler_bundles:
            parts.append(f"sampler {len(self.sampler_bundles)} x {describe(self.sampler_bundles[0])}")
        else:
            parts.append(f"{self.num_engines} engine(s) in the trainer's bundles")
        return f"{self.layout} ({'; '.join(parts)}; in all {describe(self.asked)})"


def make_plan(cfg: RunConfig, kind: str, cluster: dict[str, float], accelerator: str | None = None) -> Plan:
    """The layout and bundles for `kind`; `accelerator` (the Ray resource counting devices) defaults to the kind's.

    Passing `accelerator="GPU"` with `kind="cpu"` plans with GPU accounting on CPU nodes (tests do).
    """
    accelerator = accelerator or ACCELERATOR_RESOURCE.get(kind)
    ranks, engines, engine_devices = cfg.trainer.world_size, cfg.sampler.num_engines, cfg.sampler.tensor_parallel_size
    trainer_cpus, engine_cpus = float(cfg.trainer.threads_per_rank), float(cfg.sampler.num_cpus)
    layout, why = value_of(cfg.placement), "asked for"
    labels = {"trainer_labels": dict(cfg.trainer.node_labels), "sampler_labels": dict(cfg.sampler.node_labels)}
    if layout == "auto":
        layout, why = _choose_layout(
            kind,
            accelerator,
            cluster,
            ranks,
            engines,
            engine_devices,
            ranks * trainer_cpus + engines * engine_cpus,
        )
    if layout == "disaggregated":
        trainer, engine = {"CPU": trainer_cpus}, {"CPU": engine_cpus}
        if accelerator:  # an engine holds its tensor-parallel devices in one bundle, so on one node
            trainer[accelerator], engine[accelerator] = 1.0, float(engine_devices)
        return Plan(layout, why, (trainer,) * ranks, (engine,) * engines, trainer, engine, engines, **labels)
    check_colocated(cfg, kind)
    if accelerator:
        bundle = {"CPU": trainer_cpus + engine_cpus, accelerator: 1.0}
        trainer = {"CPU": trainer_cpus, accelerator: COLOCATED_SHARE}
        engine = {"CPU": engine_cpus, accelerator: COLOCATED_SHARE}
    else:  # the device is the cores: both actors are given the same ones
        bundle = {"CPU": max(trainer_cpus, engine_cpus)}
        trainer = engine = {"CPU": bundle["CPU"] * COLOCATED_SHARE}
    labels["sampler_labels"] = labels["trainer_labels"]  # the engines sit in the trainer's bundles
    return Plan(layout, why, (bundle,) * ranks, (), trainer, engine, engines, engines_sleep=kind == "cuda", **labels)


def check_request(cfg: RunConfig) -> None:
    """The placement settings that can be checked before Ray starts; each error names the key."""
    s, r = cfg.sampler, cfg.ray
    if s.num_engines < 1 or s.num_cpus <= 0 or cfg.trainer.threads_per_rank < 1 or (s.threads or 1) < 1:
        raise ValueError(
            f"sampler.num_engines={s.num_engines}, trainer.threads_per_rank="
            f"{cfg.trainer.threads_per_rank} and sampler.threads={s.threads} must be >= 1 (threads: "
            f"or null) and sampler.num_cpus={s.num_cpus} > 0"
        )
    if s.gpu_memory_utilization is not None and not 0 < s.gpu_memory_utilization <= 1:
        raise ValueError(f"sampler.gpu_memory_utilization={s.gpu_memory_utilization} must be in (0, 1]")
    if min(r.placement_timeout_s, r.start_timeout_s, r.call_timeout_s) <= 0:
        raise ValueError(
            f"ray.placement_timeout_s={r.placement_timeout_s}, ray.start_timeout_s={r.start_timeout_s} "
            f"and ray.call_timeout_s={r.call_timeout_s} must be > 0"
        )
    if value_of(cfg.placement) == "colocated":
        check_colocated(cfg, value_of(cfg.device))


def check_colocated(cfg: RunConfig, kind: str) -> None:
    """What colocation cannot do, for the device kind (`auto`: only what holds on every device)."""
    engines, ranks = cfg.sampler.num_engines, cfg.trainer.world_size
    if cfg.sampler.tensor_parallel_size > 1:
        raise PlacementError(
            f"placement=colocated puts an engine in one trainer rank's bundle, which cannot hold "
            f"sampler.tensor_parallel_size={cfg.sampler.tensor_parallel_size} devices: use placement=disaggregated"
        )
    if kind == "tpu":
        raise PlacementError(
            "placement=colocated is not possible on TPU: the TPU engine has no sleep mode, so "
            "trainer and engines need chips of their own (placement=disaggregated)"
        )
    if kind == "cuda" and cfg.trainer.is_async:
        raise PlacementError(
            f"placement=colocated on CUDA puts each engine to sleep while the trainer trains, so it "
            f"cannot generate ahead: trainer.max_staleness={cfg.trainer.max_staleness} needs "
            "placement=disaggregated (a GPU for each trainer rank and each engine)"
        )
    if engines > ranks:
        raise PlacementError(
            f"placement=colocated puts engine i beside trainer rank i: sampler.num_engines={engines} "
            f"must be at most trainer.world_size={ranks}"
        )


def _choose_layout(
    kind: str,
    accelerator: str | None,
    cluster: dict[str, float],
    ranks: int,
    engines: int,
    devices_per_engine: int,
    cpus_apart: float,
) -> tuple[str, str]:
    if kind == "tpu":
        return "disaggregated", "TPU engines cannot sleep, so they never share chips with the trainer"
    have_what = accelerator or "CPU"
    have = cluster.get(have_what, 0)
    need = ranks + engines * devices_per_engine if accelerator else cpus_apart
    if have >= need:
        return "disaggregated", (
            f"the cluster's {have:g} {have_what} hold {ranks} trainer rank(s) and {engines} "
            f"engine(s) apart (they need {need:g})"
        )
    return "colocated", (
        f"the cluster's {have:g} {have_what} cannot hold {ranks} trainer rank(s) and {engines} "
        f"engine(s) apart (they need {need:g}): engines share the trainer's devices"
    )


def actor_options(share: dict[str, float]) -> dict:
    """Ray actor options for a resource share: CPU and GPU have their own keywords, others go in `resources`."""
    options: dict = {"num_cpus": share.get("CPU", 0), "num_gpus": share.get("GPU", 0)}
    others = {k: v for k, v in share.items() if k not in ("CPU", "GPU")}
    if others:
        options["resources"] = others
    return options


@dataclass
class Reservation:
    """The placement groups of a plan, ready; hands out each actor's scheduling options and node."""

    plan: Plan
    trainer_group: object
    sampler_group: object | None
    nodes: dict[str, list[str]] = field(default_factory=dict)  # role -> node id of each bundle

    def trainer_options(self, rank: int) -> dict:
        return self._options(self.trainer_group, rank, self.plan.trainer_share)

    def sampler_options(self, engine: int) -> dict:
        group = self.sampler_group if self.sampler_group is not None else self.trainer_group
        return self._options(group, engine, self.plan.sampler_share)

    def trainer_node(self, rank: int) -> str:
        return self.nodes["trainer"][rank]

    def sampler_node(self, engine: int) -> str:
        return self.nodes["sampler"][engine]

    @staticmethod
    def _options(group, bundle: int, share: dict[str, float]) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False
        )
        return {**actor_options(share), "scheduling_strategy": strategy}

    def release(self) -> None:
        from ray.util import remove_placement_group

        for group in (self.trainer_group, self.sampler_group):
            if group is not None:
                remove_placement_group(group)


@dataclass(frozen=True)
class Node:
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def holds(self, bundle: dict[str, float], labels: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in labels.items()) and all(
            self.resources.get(k, 0) + 1e-9 >= v for k, v in bundle.items()
        )


def cluster_nodes() -> list[Node]:
    import ray

    return [Node(node["Resources"], node.get("Labels") or {}) for node in ray.nodes() if node.get("Alive")]


def check_fits(plan: Plan, cluster: dict[str, float], nodes: list[Node]) -> None:
    """Fail at once when no waiting could help: more than the cluster has, or a bundle no node can hold."""
    short = {k: v - cluster.get(k, 0) for k, v in plan.asked.items() if v > cluster.get(k, 0) + 1e-9}
    if short:
        raise PlacementError(
            f"cannot place the run: it asks for {plan.summary()}, but the Ray cluster has "
            f"{describe(cluster)} in all; missing {describe(short)}. "
            f"{_advice(short)}"
        )
    for role, bundles, labels in (
        ("trainer", plan.trainer_bundles, plan.trainer_labels),
        ("sampler", plan.sampler_bundles, plan.sampler_labels),
    ):
        if bundles and not any(node.holds(bundles[0], labels) for node in nodes):
            where = f" with labels {labels} ({role}.node_labels)" if labels else ""
            raise PlacementError(
                f"cannot place the run: each {role} actor needs {describe(bundles[0])} on a single "
                f"node{where}, but no node has that (nodes: "
                f"{', '.join(f'{describe(n.resources)} {n.labels or {}}' for n in nodes)}). "
                f"{_advice(bundles[0])}"
            )


def _advice(short: dict[str, float]) -> str:
    if "CPU" in short:
        return (
            "Lower trainer.threads_per_rank, sampler.num_cpus, trainer.world_size or sampler.num_engines, or add nodes."
        )
    return "Lower trainer.world_size or sampler.num_engines, use placement=colocated, or add nodes."


def reserve(plan: Plan, timeout_s: float) -> Reservation:
    """Placement groups for the trainer ranks (packed, so ranks share nodes) and then the engines.

    The trainer's group is made first so that its ranks get the nodes that can hold them together.
    Raises `PlacementError` naming what was asked and what the cluster has if either group is
    not ready within `timeout_s` (the groups are removed again).
    """
    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group

    cluster, free = ray.cluster_resources(), ray.available_resources()
    check_fits(plan, cluster, cluster_nodes())
    deadline = time.monotonic() + timeout_s
    groups = []
    for role, bundles, labels in (
        ("trainer", plan.trainer_bundles, plan.trainer_labels),
        ("sampler", plan.sampler_bundles, plan.sampler_labels),
    ):
        if not bundles:
            groups.append(None)
            continue
        group = placement_group(
            list(bundles), strategy="PACK", bundle_label_selector=[labels] * len(bundles) if labels else None
        )
        groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for made in groups:
                if made is not None:
                    remove_placement_group(made)
            short = {k: v - free.get(k, 0) for k, v in plan.asked.items() if v > free.get(k, 0) + 1e-9}
            missing = (
                f"missing {describe(short)} (held by another job, or a node has left)"
                if short
                else "enough in all, but no node has room for a whole bundle"
            )
            raise PlacementError(
                f"the {role} actors could not be placed within ray.placement_timeout_s={timeout_s:g} s: asked for "
                f"{plan.summary()}; the cluster has {describe(cluster)} in all and had {describe(free)} free, "
                f"{missing}. Nodes: {', '.join(describe(n.resources) for n in cluster_nodes())}. "
                f"{_advice(short or plan.asked)}"
            )
    reservation = Reservation(plan, groups[0], groups[1])
    trainer_nodes = placement_group_table(groups[0])["bundles_to_node_id"]
    reservation.nodes["trainer"] = [trainer_nodes[i] for i in range(len(plan.trainer_bundles))]
    if groups[1] is not None:
        sampler_nodes = placement_group_table(groups[1])["bundles_to_node_id"]
        reservation.nodes["sampler"] = [sampler_nodes[i] for i in range(len(plan.sampler_bundles))]
    else:
        reservation.nodes["sampler"] = reservation.nodes["trainer"][: plan.num_engines]
    return reservation


def where_am_i() -> dict[str, str | int]:
    """Called inside an actor: the node it runs on, as Ray sees it, and its process."""
    import os

    import ray

    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "resources": context.get_assigned_resources(),
    }


def require_model_on_node(actor: str, model_path: str) -> None:
    """Inside an actor: stop, naming the actor, when its node has no model folder at `model_path`."""
    from pathlib import Path

    if not (Path(model_path) / "config.json").is_file():
        raise FileNotFoundError(
            f"{actor}: no model folder at {model_path} on this node; every node needs the model "
            "at the same path (shared storage or a copy)"
        )


def object_store_bytes(cfg: RayConfig, bundle_bytes: int) -> int:
    """`ray.object_store_mb`, or two weight bundles and 256 MiB (512 MiB at least): the object_store transport keeps
    the bundle being installed while the next one is put."""
    if cfg.object_store_mb is not None:
        return cfg.object_store_mb * 2**20
    return max(512 * 2**20, 2 * bundle_bytes + 256 * 2**20)


def start_ray(cfg: RayConfig, bundle_bytes: int = 0) -> None:
    """Join `ray.address`, or start a local cluster (its object store sized for weight bundles of `bundle_bytes`);
    a sweep's trial runs inside the sweep's cluster already."""
    import ray

    if ray.is_initialized():
        return
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=False)
        return
    # "local": a cluster of this run's own, even when another process on this host runs one (plain ray.init()
    # would join that one, and then refuse the CPU count)
    ray.init(
        address="local",
        num_cpus=cfg.num_cpus or (os.cpu_count() or 1) + 1,
        include_dashboard=False,
        object_store_memory=object_store_bytes(cfg, bundle_bytes),
        log_to_driver=False,
    )
