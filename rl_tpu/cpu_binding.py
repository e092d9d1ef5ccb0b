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
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from rl_tpu.config import RunConfig, value_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuBinding:
    threads: int
    cores: tuple[int, ...] = ()  # (): the OS schedules the threads anywhere

    def env(self) -> dict[str, str]:
        """The environment that starts the process's OpenMP pool at this size (Ray would set 1)."""
        return {"OMP_NUM_THREADS": str(self.threads)}

    def apply(self, actor: str) -> None:
        """In the actor's process: pin every thread to the binding's cores, then size torch's pool."""
        import torch

        if self.cores:
            allowed = sorted(os.sched_getaffinity(0))
            if max(self.cores) >= len(allowed):
                raise RuntimeError(f"{actor}: pinned to core positions {list(self.cores)} but its node allows "
                                   f"{len(allowed)} CPUs ({allowed}): lower the thread counts or set pin_cores=off")
            cores = {allowed[i] for i in self.cores}
            for task in os.listdir("/proc/self/task"):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task), cores)
        torch.set_num_threads(self.threads)


def engine_threads(cfg: RunConfig) -> int:
    return cfg.sampler.threads or max(1, round(cfg.sampler.num_cpus))


def should_pin(cfg: RunConfig, kind: str, one_host: bool) -> bool:
    """`pin_cores=auto` pins on a one-host CPU run in async mode, where trainer and engines run at once."""
    mode = value_of(cfg.pin_cores)
    if mode == "auto":
        return kind == "cpu" and one_host and cfg.trainer.max_staleness > 0
    return mode == "on" and kind == "cpu"


def bind(cfg: RunConfig, trainer_nodes: list[str], engine_nodes: list[str], pin: bool,
         node_cores: dict[str, int]) -> tuple[list[CpuBinding], list[CpuBinding]]:
    """Each trainer rank's and each engine's binding; `*_nodes` is where each was placed.

    Pinned, the actors on a node take consecutive cores, ranks first. When they need more cores
    than the node has (`node_cores`), none of that node's actors is pinned, with a warning naming
    the counts: sharing cores unpinned is slower, not wrong.
    """
    trainer_threads, sampler_threads = cfg.trainer.threads_per_rank, engine_threads(cfg)
    nodes = trainer_nodes + engine_nodes  # ranks first, then engines
    bindings = [CpuBinding(trainer_threads) for _ in trainer_nodes] + [CpuBinding(sampler_threads) for _ in engine_nodes]
    ranks = len(trainer_nodes)
    if not pin:
        return bindings[:ranks], bindings[ranks:]
    for node in dict.fromkeys(nodes):
        on_node = [i for i, where in enumerate(nodes) if where == node]
        needed = sum(bindings[i].threads for i in on_node)
        if needed > node_cores[node]:
            log.warning("pin_cores: the actors on node %s need %d cores (trainer.threads_per_rank=%d per rank, "
                        "sampler.threads=%d per engine) but it has %d; they run unpinned", node[:12], needed,
                        trainer_threads, sampler_threads, node_cores[node])
            continue
        first = 0
        for i in on_node:
            bindings[i] = CpuBinding(bindings[i].threads, tuple(range(first, first + bindings[i].threads)))
            first += bindings[i].threads
    return bindings[:ranks], bindings[ranks:]
