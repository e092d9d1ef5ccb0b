"""`sync.transport=shm_file`: one safetensors file per bucket in a shared-memory folder (`sync.shm_dir`)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rl_tpu.records import Bucket, WeightSyncError
from rl_tpu.sync.base import Placed, SenderSetting, Transport
from rl_tpu.sync.bundle import as_bytes

if TYPE_CHECKING:
    from rl_tpu.config import RunConfig

log = logging.getLogger(__name__)


def reclaim_dead_senders(root: Path) -> list[Path]:
    """Remove the folders of senders that died without `close()` (a SIGKILLed trainer rank 0): `sender-<pid>`
    folders of this user whose process no longer exists. Their bundles would otherwise stay in RAM for good."""
    reclaimed = []
    for folder in root.glob("sender-*") if root.is_dir() else ():
        pid = folder.name.removeprefix("sender-")
        if pid.isdigit() and folder.stat().st_uid == os.getuid() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            reclaimed.append(folder)
    return reclaimed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


class ShmFileTransport(Transport):
    name = "shm_file"
    kept_versions = 2  # the version before stays until this one is installed
    rejoins_alone = through_host = True  # each engine reads every bucket's file by its path, when it installs

    def __init__(self, root: str = "/dev/shm/rl_tpu"):
        for folder in reclaim_dead_senders(Path(root)):
            log.warning("removed %s, the weight bundles of a sender that died without cleaning up", folder)
        self.root = Path(root) / f"sender-{os.getpid()}"

    @classmethod
    def sender(cls, setting: SenderSetting) -> "ShmFileTransport":
        return cls(setting.shm_dir)

    @classmethod
    def check_placement(cls, cfg: "RunConfig", placed: Placed) -> str | None:
        """The files pass through one node's shared memory: rank 0 and every engine must share that node."""
        if not placed.engines_away:
            return None
        return (
            f"sync.transport=shm_file passes weights as files in {cfg.sync.shm_dir} on one node, but engine(s) "
            f"{list(placed.engines_away)} were placed on another node than trainer rank 0: use "
            "sync.transport=object_store or collective across nodes"
        )

    def prepare(self, bundle_bytes: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        free, need = shutil.disk_usage(self.root).free, 2 * bundle_bytes  # a version stays until the next installs
        if free < need:
            raise WeightSyncError(
                f"sync.transport=shm_file: {self.root.parent} has {free / 2**20:.0f} MiB free, and the run keeps two "
                f"weight bundles of {bundle_bytes / 2**20:.0f} MiB there ({need / 2**20:.0f} MiB): give /dev/shm "
                "more room (docker run --shm-size) or set sync.transport=object_store"
            )

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> str:
        from safetensors.torch import save_file

        folder = self.root / f"v{version}"
        if index == 0:
            self._drop_versions_before(version - 1)  # the previous version stays until this one is installed
            folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"bucket{index:05d}.safetensors"
        save_file(_unshared(named), str(path))
        return str(path)

    @staticmethod
    def get(bucket: Bucket, receiver: int = 0) -> list[np.ndarray]:
        from safetensors.torch import load_file

        try:
            tensors = load_file(bucket.handle)
        except Exception as err:  # missing, truncated or unparsable file
            raise WeightSyncError(f"cannot read {bucket.handle}: {err}") from err
        return [
            as_bytes(tensors[spec.name]) if spec.name in tensors else np.empty(0, np.uint8) for spec in bucket.specs
        ]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _drop_versions_before(self, version: int) -> None:
        if not self.root.exists():
            return
        for folder in self.root.glob("v*"):
            if int(folder.name[1:]) < version:
                shutil.rmtree(folder, ignore_errors=True)


def _unshared(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors with storages of their own, as safetensors requires: a tied head that an fp32 CPU
    trainer serves is the embedding tensor itself under a second name."""
    seen, out = set(), {}
    for name, tensor in named.items():
        tensor = tensor.contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out
