"""The actors of a run: placed, started, checked, and called with deadlines.

`start_actors` plans and reserves the placement (rl_tpu/cluster/placement.py), starts the trainer
ranks (rendezvous at rank 0's node) and the engines in their bundles, and checks what a run on
several hosts needs before the first step: transports that can reach, a run folder that every
rank sees. `ActorHandles` is what the controller's loop calls; every call waits with a deadline
and names the actor that failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray

from rl_tpu.cluster import cores as cpu_binding
from rl_tpu.cluster import placement, rendezvous
from rl_tpu.cluster.actor_logs import actor_name
from rl_tpu.cluster.calls import ActorError, gather
from rl_tpu.config import RunConfig, TrainerConfig
from rl_tpu.episodes.build import EpisodeOptions
from rl_tpu.episodes.episode import EpisodeLimits
from rl_tpu.episodes.tools import ToolSettings
from rl_tpu.records import CanaryTokens, TrainBatch, WeightBundle
from rl_tpu.sampler.adapters import AdapterServing
from rl_tpu.sampler.engine import EngineOptions, launch_sampler
from rl_tpu.sampler.pool import SamplerPool
from rl_tpu.sampler.restarts import EngineRecovery
from rl_tpu.sync.base import Placed
from rl_tpu.sync.canary import CanaryWatch, canary_tokens
from rl_tpu.sync.registry import transport_class
from rl_tpu.trainer.worker import TrainerWorker

log = logging.getLogger(__name__)

# vLLM's share of an accelerator's memory when sampler.gpu_memory_utilization is unset
GPU_MEMORY_OWN_DEVICE, GPU_MEMORY_COLOCATED = 0.85, 0.4


@dataclass
class ActorHandles:
    trainers: list  # Ray actor handles of TrainerWorker, rank order
    samplers: SamplerPool
    reservation: placement.Reservation
    cfg: RunConfig
    log_dir: str
    rendezvous: rendezvous.RendezvousStore | None = None  # the trainer ranks', held while they run
    core_leases: cpu_binding.CoreLeases | None = None  # pinned runs: the cores this run holds on each node
    canary: CanaryTokens | None = None  # the weight canary's tokens (rl_tpu/sync/canary.py); None: sync.canary off

    @property
    def trainer_names(self) -> list[str]:
        return [actor_name("trainer", rank) for rank in range(len(self.trainers))]

    def named(self) -> list[tuple[str, object]]:
        """(name, handle) of every trainer rank, then every engine."""
        return [*zip(self.trainer_names, self.trainers), *zip(self.samplers.names, self.samplers.engines)]

    def on_trainers(self, method: str, what: str, *args, timeout_s: float | None = None) -> list:
        """The same call on every rank (they are collective), waited for together."""
        calls = [(name, getattr(t, method).remote(*args)) for name, t in zip(self.trainer_names, self.trainers)]
        return gather(calls, what, timeout_s or self.cfg.ray.call_timeout_s, self.log_dir)

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One update on every rank; rank 0's metrics (they are reduced over ranks)."""
        return self.on_trainers("train_step", "train step", ray.put(batch))[0]

    def recorded_figures(self) -> dict[int, dict[str, list[float]]]:
        """The trainer's per-token logprobs and entropy of the last step's recorded rows (`TrainBatch.recorded`), by
        their number, from every rank (each holds its own rows)."""
        figures = {}
        for part in self.on_trainers("take_recorded", "taking the recorded rows' figures"):
            figures.update(part)
        return figures

    def token_kl(self, batch: TrainBatch) -> list[list[float]]:
        """Each completion token's KL between the policy and the reference model, in batch order."""
        shards = self.on_trainers("token_kl", "KL to the reference model", ray.put(batch))
        return [row for shard in shards for row in shard]  # ranks hold contiguous slices, in rank order

    def publish(self, version: int) -> WeightBundle:
        """Every rank sends its share of the buckets; the engines get them as one bundle. Colocated, the ranks then
        give the memory their allocators keep back to the device, where the engines wake next."""
        release = self.reservation.plan.engines_sleep
        return WeightBundle.merge(
            self.on_trainers("publish_weights", f"publishing weights v{version}", version, release)
        )

    def install(self, bundle: WeightBundle, wait: bool = True) -> dict[str, float]:
        """Every engine installs the bundle (woken first if it slept while the trainer trained); its figures. The
        weight canary's answers are held until `SamplerPool.settle_canary` checks them against the trainer's.

        Without waiting (wait=False) it sends the bundle and returns at once, with the figures of the install
        before if that one was not waited for (none at first); generations sent after it wait for it on their
        engines."""
        timeout, trainer = self.cfg.ray.call_timeout_s, []
        if self.reservation.plan.engines_sleep:
            self.samplers.call("wake_up", "waking the engines", timeout)
        if self.canary is not None:  # the engines score it after their load; the trainer ranks meanwhile
            bundle, trainer = dataclasses.replace(bundle, canary=self.canary), self.trainer_canary(bundle.version)
        if wait:
            return self.samplers.install(bundle, timeout, trainer)
        return self.samplers.start_install(bundle, timeout, trainer)

    def trainer_canary(self, version: int) -> list[tuple[str, object]]:
        """Every rank scores the canary under its weights now, as `version` (an FSDP forward is collective): the
        calls, rank 0's first. Sent before any later call, so that they score the weights just published."""
        return [(n, t.score_canary.remote(version, self.canary)) for n, t in zip(self.trainer_names, self.trainers)]

    def start_canary(self) -> dict[str, float]:
        """Before anything is generated: every engine's canary against trainer rank 0's as version 0, so that an
        engine that started with other weights than the trainer's is named before the first evaluation (no figures
        with `sync.canary.enable=false`)."""
        if self.canary is None:
            return {}
        return self.samplers.check_canary(self.canary, self.trainer_canary(0), self.cfg.ray.call_timeout_s)

    def release_devices(self) -> None:
        """Colocated on CUDA: the engines hand the GPU to the trainer until the next install."""
        if self.reservation.plan.engines_sleep:
            self.samplers.call("sleep", "putting the engines to sleep", self.cfg.ray.call_timeout_s)

    def locations(self) -> list[dict]:
        calls = [(name, actor.where.remote()) for name, actor in self.named()]
        return gather(calls, "reporting locations", self.cfg.ray.start_timeout_s, self.log_dir)

    def shutdown(self) -> None:
        """The engines, then the trainer ranks, each group at once, 60 s at most per group."""
        engines = list(zip(self.samplers.names, self.samplers.engines))
        for group in (engines, list(zip(self.trainer_names, self.trainers))):
            calls = {handle.shutdown.remote(): name for name, handle in group}
            if not calls:  # the run stopped before this group started
                continue
            done, late = ray.wait(list(calls), num_returns=len(calls), timeout=60)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as err:  # a dead actor has nothing left to release
                    log.warning("shutdown of %s failed: %s", calls[ref], err)
            for ref in late:
                log.warning("shutdown of %s: no answer within 60 s; its placement is released anyway", calls[ref])
        self.reservation.release()  # also ends the actors placed in it
        self.rendezvous = None  # closes the store's port
        if self.core_leases is not None:
            self.core_leases.release()


def start_actors(
    cfg: RunConfig, model_path: Path, run_dir: Path, kind: str, plan: placement.Plan | None = None
) -> ActorHandles:
    """Place and start the trainer ranks and engines on device `kind`; the run folder gets placement.json."""
    plan = plan or placement.make_plan(cfg, kind, ray.cluster_resources())
    log.info("placement: %s; %s", plan.summary(), plan.why)
    reservation = placement.reserve(plan, cfg.ray.placement_timeout_s)
    log_dir = str(run_dir / "logs")
    pool = SamplerPool([], log_dir, canary=CanaryWatch(cfg.sync.canary.max_gap))
    actors = ActorHandles([], pool, reservation, cfg, log_dir, canary=run_canary(cfg, model_path))
    if restarts_in_place(cfg):
        actors.samplers.restarts.recovery = EngineRecovery(
            actors.publish, cfg.sampler.max_restarts, cfg.ray.start_timeout_s
        )
    try:
        check_transport_reach(cfg, reservation)
        actor_cfg = dataclasses.replace(cfg, device=kind)  # resolved again on each actor's node
        actors.core_leases = cpu_binding.CoreLeases(ray.get_runtime_context().get_node_id())
        trainer_cores, engine_cores = bind_cores(cfg, kind, reservation, actors.core_leases)
        _start_engines(actors, actor_cfg, model_path, log_dir, engine_cores)
        if plan.engines_sleep:  # colocated: each engine sizes its KV cache by the device memory free at its start
            wait_ready(actors, actors.samplers.names, cfg.ray.start_timeout_s)
        _start_trainers(actors, actor_cfg, model_path, log_dir, trainer_cores)
        # start-up errors (a bad model folder, a missing device) surface here, named, not at the first step
        wait_ready(actors, [name for name, _ in actors.named()], cfg.ray.start_timeout_s)
        if transport_class(cfg.sync.transport).handshake:
            what = f"the sync.transport={cfg.sync.transport} handshake"
            actors.on_trainers("handshake", what, actors.samplers.engines, timeout_s=cfg.ray.start_timeout_s)
        check_shared_run_dir(actors, run_dir)
        write_placement(actors, run_dir)
    except BaseException:
        actors.shutdown()
        raise
    return actors


def run_canary(cfg: RunConfig, model_path: Path) -> CanaryTokens | None:
    """The weight canary's tokens in the model's own tokenizer (`sync.canary.enable`), else None."""
    from transformers import AutoTokenizer

    return canary_tokens(AutoTokenizer.from_pretrained(model_path)) if cfg.sync.canary.enable else None


def wait_ready(actors: ActorHandles, names: list[str], timeout_s: float) -> None:
    """Until the named actors have started (their constructors returned), with a deadline naming who failed."""
    handles = dict(actors.named())
    calls = [(name, handles[name].__ray_ready__.remote()) for name in names]
    gather(calls, "starting the actors", timeout_s, actors.log_dir)


def bind_cores(
    cfg: RunConfig, kind: str, reservation: placement.Reservation, leases: cpu_binding.CoreLeases
) -> tuple[list, list]:
    """Each trainer rank's and engine's `CpuBinding` (threads, and cores when `pin_cores` pins them, from the
    blocks `leases` takes for this run)."""
    plan = reservation.plan
    trainer_nodes = [reservation.trainer_node(r) for r in range(cfg.trainer.world_size)]
    engine_nodes = [reservation.sampler_node(e) for e in range(plan.num_engines)]
    here = ray.get_runtime_context().get_node_id()
    node_cores = {node["NodeID"]: int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node["Alive"]}
    if here in node_cores:  # this host's real cores (a local cluster counts one more CPU than it has)
        node_cores[here] = len(os.sched_getaffinity(0))
    one_host = set(trainer_nodes + engine_nodes) == {here}
    pin = cpu_binding.should_pin(cfg, kind, one_host)
    folder = f"rl_tpu-{uuid.uuid4().hex[:12]}"
    return cpu_binding.bind(cfg, trainer_nodes, engine_nodes, pin, node_cores, folder, leases.take)


def _start_trainers(actors: ActorHandles, cfg: RunConfig, model_path: Path, log_dir: str, bindings: list) -> None:
    reservation = actors.reservation
    store = actors.rendezvous = rendezvous.RendezvousStore(cfg.trainer.world_size, cfg.ray.start_timeout_s)
    trainer_cls = ray.remote(TrainerWorker)
    env = {**trainer_env(cfg.trainer, model_path), **rendezvous.AGENT_STORE_ENV}
    if cfg.device == "cuda":
        env.update(rendezvous.ALL_GPUS_VISIBLE_ENV)
    for rank, binding in enumerate(bindings):
        options = reservation.trainer_options(rank)
        actors.trainers.append(
            trainer_cls.options(**options, runtime_env={"env_vars": env}).remote(
                cfg, str(model_path), rank, cfg.trainer.world_size, store.host, store.port, log_dir, binding
            )
        )


def trainer_env(trainer: TrainerConfig, model_path: Path) -> dict[str, str]:
    """The environment of a trainer rank's process (see `trainer.return_freed_memory`)."""
    return {
        **cpu_binding.CpuBinding(trainer.threads_per_rank).env(),
        **({"MALLOC_MMAP_THRESHOLD_": str(2**20)} if returns_freed_memory(trainer, model_path) else {}),
    }


def returns_freed_memory(trainer: TrainerConfig, model_path: Path) -> bool:
    """`trainer.return_freed_memory`, or by default whether the weight files hold 256 MiB or more: below that
    the heap's retained blocks are small, and mapping every activation afresh costs more than it saves."""
    if trainer.return_freed_memory is not None:
        return trainer.return_freed_memory
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors")) >= 256 * 2**20


def tool_settings(cfg: RunConfig) -> ToolSettings:
    """The episode's tools and their workers' limits, the tool files' paths made absolute."""
    e = cfg.episode
    return ToolSettings(
        e.tools_config_file and str(Path(e.tools_config_file).expanduser().resolve()),
        e.function_tool_path and str(Path(e.function_tool_path).expanduser().resolve()),
        e.tool_workers,
        e.tool_timeout_s,
        e.tool_memory_mb,
        e.max_tool_response_chars,
        e.tool_response_truncate_side,
        tuple(cfg.reward.pass_env),
        e.max_tool_failure_rate,
        e.tool_calls_per_worker,
    )


def episode_options(cfg: RunConfig, max_model_len: int) -> EpisodeOptions | None:
    """What each engine needs to run episodes (`episode.enable`), else None."""
    e = cfg.episode
    if not e.enable:
        return None
    limits = EpisodeLimits(
        e.max_turns, cfg.completion_tokens, cfg.sampler.response_length, max_model_len, e.max_parallel_calls
    )
    return EpisodeOptions(
        limits,
        tool_settings(cfg),
        e.tool_parser,
        e.renderer,
        e.tool_response_format,
        tuple(e.stop),
        cfg.algorithm.outcomes,
        e.scheduling,
        e.max_calls_in_flight,
    )


def adapter_serving(cfg: RunConfig) -> AdapterServing | None:
    """How each engine serves a LoRA policy sent as adapters (`cfg.lora_sync`), else None: the adapters of the
    staleness window stay loaded."""
    if cfg.lora_sync != "adapter":
        return None
    return AdapterServing(cfg.actor.lora.engine_max_rank, cfg.trainer.max_staleness + 1)


def _start_engines(actors: ActorHandles, cfg: RunConfig, model_path: Path, log_dir: str, bindings: list) -> None:
    plan, s = actors.reservation.plan, cfg.sampler
    memory = s.gpu_memory_utilization or (GPU_MEMORY_COLOCATED if plan.layout == "colocated" else GPU_MEMORY_OWN_DEVICE)
    max_len = cfg.data.max_prompt_length + cfg.completion_tokens
    restarts = s.max_restarts if actors.samplers.restarts.recovery else 0
    for engine, binding in enumerate(bindings):
        options = EngineOptions(
            engine,
            log_dir,
            plan.engines_sleep,
            memory,
            cfg.engine_eager,
            cfg.model.fp32_residual,
            binding,
            episode_options(cfg, max_len),
            adapter_serving(cfg),
            cfg.sync.transport,
            cfg.sampler.tensor_parallel_size,
        )
        ray_options = {**actors.reservation.sampler_options(engine), "max_restarts": restarts}
        actors.samplers.engines.append(
            launch_sampler(
                str(model_path),
                cfg.model.dtype,
                max_len,
                s.kv_cache_gb,
                s.seed + engine,
                options,
                ray_options,
            )
        )


def restarts_in_place(cfg: RunConfig) -> bool:
    """A lost engine can rejoin alone where the transport lets it (`Transport.rejoins_alone`)."""
    return cfg.sampler.max_restarts > 0 and transport_class(cfg.sync.transport).rejoins_alone


def check_transport_reach(cfg: RunConfig, reservation: placement.Reservation) -> None:
    """The transport's own check of where the actors were placed (`Transport.check_placement`): whether it reaches
    every engine from trainer rank 0 (one node's shared memory, one GPU, one NCCL rank per GPU)."""
    home = reservation.trainer_node(0)
    away = tuple(e for e in range(reservation.plan.num_engines) if reservation.sampler_node(e) != home)
    placed = Placed(reservation.plan.layout, reservation.plan.engines_sleep, away)
    why = transport_class(cfg.sync.transport).check_placement(cfg, placed)
    if why is not None:
        raise placement.PlacementError(why)


def check_shared_run_dir(actors: ActorHandles, run_dir: Path) -> None:
    """Checkpoints, the export and actor logs go to the run folder: a marker rank 0 writes must be seen by all."""
    marker = run_dir / f".shared-check-{uuid.uuid4().hex[:8]}"
    gather(
        [(actors.trainer_names[0], actors.trainers[0].touch.remote(str(marker)))],
        "writing the shared-storage marker",
        60,
        actors.log_dir,
    )
    try:
        seen = actors.on_trainers("sees", "checking the shared-storage marker", str(marker), timeout_s=60)
        blind = [name for name, ok in zip(actors.trainer_names, seen) if not ok] + (
            [] if marker.exists() else ["the driver"]
        )
    finally:
        marker.unlink(missing_ok=True)
    if blind:
        raise ActorError(
            f"the run folder {run_dir} is not shared storage: a file trainer_0 wrote there is not visible "
            f"to {', '.join(blind)}. Checkpoints, the export and actor logs are written there by several "
            "processes; on several hosts put it on storage every node mounts at the same path "
            "(hydra.run.dir=/shared/...)"
        )


def write_placement(actors: ActorHandles, run_dir: Path) -> None:
    """placement.json: the plan and where each actor runs, as the actors themselves report it."""
    plan = actors.reservation.plan
    record = {"layout": plan.layout, "why": plan.why, "plan": dataclasses.asdict(plan), "actors": actors.locations()}
    (run_dir / "placement.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    for actor in record["actors"]:
        log.info("%s on node %s (%s), pid %s", actor["actor"], actor["node_id"][:12], actor["node_ip"], actor["pid"])
