"""The run's machinery: the weight `sync` transport and its canary, the `ray` cluster and the Hub `export`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CanaryConfig:
    # each engine scores a fixed canary after every install and at start; unlike the trainer's, it stops the run
    enable: bool = True
    # the largest per-token logprob gap allowed; null: by dtype (float32 2e-4, bfloat16 1.0: docs/reliability.md)
    max_gap: Optional[float] = None

    def __post_init__(self) -> None:
        if self.max_gap is not None and not self.max_gap > 0:
            raise ValueError(f"sync.canary.max_gap={self.max_gap} must be > 0, or null for the dtype's bound")


@dataclass
class SyncConfig:
    # a built-in transport (rl_tpu/sync/registry.py: object_store, shm_file, collective, cuda_ipc, nccl, tpu_sync)
    # or a Transport subclass by import path, package.module:Class; checked before Ray starts (controller/checks.py)
    transport: str = "object_store"
    bucket_mb: float = 512.0  # upper bound on one bucket's bytes
    shm_dir: str = "/dev/shm/rl_tpu"  # where shm_file writes its buckets
    canary: CanaryConfig = field(default_factory=CanaryConfig)


@dataclass
class ExportConfig:
    # trainer.push_to_hub (and `python -m rl_tpu.export --push-to-hub`) refuses a public repository unless this is
    # true; a repository that does not exist is made private
    public: bool = False


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local cluster; `auto`: join the cluster this node belongs to
    num_cpus: Optional[int] = None  # None: the core count plus one, so the sampler is never starved
    # a local cluster's object store; None: two weight bundles and 256 MiB (512 at least), so that the object_store
    # transport holds a bundle being installed and the next one
    object_store_mb: Optional[int] = None
    placement_timeout_s: float = 120.0  # stop when the actors cannot be placed within this long
    start_timeout_s: float = 900.0  # actors loading their model (vLLM start-up, FSDP sharding)
    call_timeout_s: float = 3600.0  # any one call on an actor during the run (a step, a sync, a checkpoint)
