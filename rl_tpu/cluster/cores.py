"""Which cores each actor's threads run on, and how many threads it starts, on CPU hosts.

Ray's CPU counts are bookkeeping: it pins no process, and a 1-CPU actor gets `OMP_NUM_THREADS=1`
whatever it does. vLLM in-process (our sampler) binds nothing either. So on a shared host a
trainer rank's and an engine's OpenMP pools, and their spinning waits, land on the same cores,
and async mode overlaps nothing. Pinned, each actor gets cores of its own: the trainer ranks on
a node take the first cores, the engines the next ones, each as many as it has threads.

The thread count travels in the actor's environment (`OMP_NUM_THREADS`, read when torch is
imported); the cores are positions in the node's CPU list, which the actor maps to its own
allowed CPUs and pins every thread of its process to, before it starts its engine or its
process group (threads started later inherit the mask).

Runs that share a node (a sweep's trials at once) pin disjoint cores: each run leases its block of core
positions on each node (`CoreLease`) and holds it until its actors stop.

With `trainer.borrow_idle_cores`, a pinned rank also gets a `CoreLoan`: its node's engine cores,
which it computes on while those engines are idle (rl_tpu/cluster/core_loan.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rl_tpu.config import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreLoan:
    """Cores a trainer rank may compute on while every engine in `engines` is idle."""

    cores: tuple[int, ...]  # positions in the node's CPU list, as `CpuBinding.cores`
    engines: tuple[int, ...]  # the engines on the rank's node (indices)
    folder: str  # the run's folder of engine activity files on the node


@dataclass(frozen=True)
class CpuBinding:
    threads: int
    cores: tuple[int, ...] = ()  # (): the OS schedules the threads anywhere
    loan: CoreLoan | None = None  # a trainer rank's: engine cores it may borrow
    activity_folder: str | None = None  # an engine's: where it marks itself busy for the ranks that borrow its cores

    def env(self) -> dict[str, str]:
        """The environment that starts the process's OpenMP pool at this size (Ray would set 1)."""
        return {"OMP_NUM_THREADS": str(self.threads)}

    def apply(self, actor: str) -> list[int]:
        """In the actor's process: pin every thread to the binding's cores, then size torch's pool. Returns the
        CPUs the process was allowed before, the node's list that core positions index."""
        import torch

        allowed = sorted(os.sched_getaffinity(0))
        if self.cores:
            positions = self.cores + (self.loan.cores if self.loan else ())
            if max(positions) >= len(allowed):
                raise RuntimeError(
                    f"{actor}: pinned to core positions {list(positions)} but its node allows "
                    f"{len(allowed)} CPUs ({allowed}): lower the thread counts or set pin_cores=off"
                )
            pin_threads(self.cpus(allowed))
        torch.set_num_threads(self.threads)
        return allowed

    def cpus(self, allowed: list[int], positions: tuple[int, ...] | None = None) -> set[int]:
        """The CPUs at these positions (default: the binding's cores) of the node's list `allowed`."""
        return {allowed[i] for i in (self.cores if positions is None else positions)}


class CoreLease:
    """A block of consecutive core positions of this node, held for one run: the first free block of `count`.

    Each position is a lock file under `folder` held with `flock` while the lease lives; the kernel drops the locks
    of a process that dies, so a crashed run's cores are free again at once and nothing stale needs cleaning.
    """

    def __init__(self, count: int, node_cores: int, folder: str):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.locks: list = []
        self.first: int | None = None  # None: no block of `count` free positions
        for first in range(node_cores - count + 1):
            if self._take(folder, range(first, first + count)):
                self.first = first
                return

    def _take(self, folder: str, positions: range) -> bool:
        for position in positions:
            lock = open(Path(folder) / f"core_{position}.lock", "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                self.release()
                return False
            self.locks.append(lock)
        return True

    def first_position(self) -> int | None:
        return self.first

    def release(self) -> None:
        for lock in self.locks:
            lock.close()  # closing the file drops its lock
        self.locks = []


def lease_folder() -> str:
    """Where a node's lease lock files live: the runs that use one folder lease disjoint cores. `RL_TPU_CORE_LEASE_DIR`
    sets it (the test suite gives each of its workers its own: they share a host on purpose)."""
    return os.environ.get("RL_TPU_CORE_LEASE_DIR") or os.path.join(tempfile.gettempdir(), "rl_tpu-cores")


class CoreLeases:
    """A run's core leases on every node it pins actors on: this node's held by the driver, another node's by a
    small actor placed there. Held until `release`, when the run's actors stop."""

    def __init__(self, here: str):
        self.here, self.folder = here, lease_folder()
        self.local: list[CoreLease] = []
        self.holders: list = []  # Ray actors holding other nodes' leases

    def take(self, node: str, count: int, node_cores: int) -> int | None:
        """The first of `count` consecutive core positions of `node` leased to this run; None: none free."""
        if node == self.here:
            self.local.append(CoreLease(count, node_cores, self.folder))
            return self.local[-1].first
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        holder = (
            ray.remote(CoreLease)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(count, node_cores, self.folder)
        )
        self.holders.append(holder)
        return ray.get(holder.first_position.remote(), timeout=60)

    def release(self) -> None:
        import ray

        for lease in self.local:
            lease.release()
        for holder in self.holders:
            ray.kill(holder)  # its process ends, and with it its locks
        self.local, self.holders = [], []


def pin_threads(cpus: set[int]) -> None:
    """Pin every thread of this process to `cpus` (threads started later inherit the caller's mask)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def engine_threads(cfg: RunConfig) -> int:
    return cfg.sampler.threads or max(1, round(cfg.sampler.num_cpus))


def should_pin(cfg: RunConfig, kind: str, one_host: bool) -> bool:
    """`pin_cores=auto` pins on a one-host CPU run in async mode, where trainer and engines run at once."""
    mode = cfg.pin_cores
    if mode == "auto":
        return kind == "cpu" and one_host and cfg.trainer.is_async
    return mode == "on" and kind == "cpu"


def bind(
    cfg: RunConfig,
    trainer_nodes: list[str],
    engine_nodes: list[str],
    pin: bool,
    node_cores: dict[str, int],
    activity_folder: str,
    lease: Callable[[str, int, int], int | None] | None = None,
) -> tuple[list[CpuBinding], list[CpuBinding]]:
    """Each trainer rank's and each engine's binding; `*_nodes` is where each was placed.

    Pinned, the actors on a node take consecutive cores, ranks first, from the first position of the block
    `lease(node, count, node_cores)` gives the run (`CoreLeases.take`; None: from 0). When they need more cores
    than the node has (`node_cores`), or other runs hold them, none of that node's actors is pinned, with a
    warning naming the counts: sharing cores unpinned is slower, not wrong. With `trainer.borrow_idle_cores` the
    pinned ranks of a node share its engines' cores as loans (`activity_folder` names the run's
    folder of activity files).
    """
    trainer_threads, sampler_threads = cfg.trainer.threads_per_rank, engine_threads(cfg)
    nodes = trainer_nodes + engine_nodes  # ranks first, then engines
    bindings = [CpuBinding(trainer_threads) for _ in trainer_nodes] + [
        CpuBinding(sampler_threads) for _ in engine_nodes
    ]
    ranks = len(trainer_nodes)
    if not pin:
        return bindings[:ranks], bindings[ranks:]
    for node in dict.fromkeys(nodes):
        on_node = [i for i, where in enumerate(nodes) if where == node]
        needed = sum(bindings[i].threads for i in on_node)
        if needed > node_cores[node]:
            log.warning(
                "pin_cores: the actors on node %s need %d cores (trainer.threads_per_rank=%d per rank, "
                "sampler.threads=%d per engine) but it has %d; they run unpinned",
                node[:12],
                needed,
                trainer_threads,
                sampler_threads,
                node_cores[node],
            )
            continue
        first = lease(node, needed, node_cores[node]) if lease else 0
        if first is None:
            log.warning(
                "pin_cores: node %s has no %d consecutive cores free of other runs' pinned actors (a sweep's trials "
                "at once?); this run's actors there run unpinned",
                node[:12],
                needed,
            )
            continue
        for i in on_node:
            bindings[i] = CpuBinding(bindings[i].threads, tuple(range(first, first + bindings[i].threads)))
            first += bindings[i].threads
        if cfg.trainer.borrow_idle_cores:
            lend_engine_cores(
                bindings, [i for i in on_node if i < ranks], [i for i in on_node if i >= ranks], ranks, activity_folder
            )
    return bindings[:ranks], bindings[ranks:]


def lend_engine_cores(
    bindings: list[CpuBinding], ranks_here: list[int], engines_here: list[int], ranks: int, folder: str
) -> None:
    """One node's pinned engine cores, dealt out among its pinned ranks in turn; every engine there reports
    its activity, and each loan waits for all of them (an engine's cores are idle only when it is)."""
    if not ranks_here or not engines_here:
        return
    lendable = [core for i in engines_here for core in bindings[i].cores]
    watched = tuple(i - ranks for i in engines_here)
    for k, i in enumerate(ranks_here):
        if cores := tuple(lendable[k :: len(ranks_here)]):
            bindings[i] = dataclasses.replace(bindings[i], loan=CoreLoan(cores, watched, folder))
    for i in engines_here:
        bindings[i] = dataclasses.replace(bindings[i], activity_folder=folder)
