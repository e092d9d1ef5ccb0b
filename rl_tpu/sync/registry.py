"""The registry of transports by `sync.transport` name; the device ones are imported only when asked for."""

from __future__ import annotations

from typing import Any

from rl_tpu.sync.base import Transport
from rl_tpu.sync.collective import CollectiveTransport
from rl_tpu.sync.object_store import ObjectStoreTransport
from rl_tpu.sync.shm_file import ShmFileTransport

CPU_TRANSPORTS = {"object_store": ObjectStoreTransport, "shm_file": ShmFileTransport, "collective": CollectiveTransport}
TRANSPORT_NAMES = (*CPU_TRANSPORTS, "cuda_ipc", "tpu_sync", "nccl")


def transport_class(name: str) -> type[Transport]:
    if name == "tpu_sync":  # imported only when asked for: it is the TPU-only path
        from rl_tpu.sync.tpu_sync import TpuSyncTransport

        return TpuSyncTransport
    if name == "cuda_ipc":
        from rl_tpu.sync.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport
    if name == "nccl":  # imports vLLM's weight-transfer modules
        from rl_tpu.sync.nccl import NcclTransport

        return NcclTransport
    if name not in CPU_TRANSPORTS:
        raise ValueError(f"sync.transport={name!r}: allowed values are {', '.join(TRANSPORT_NAMES)}")
    return CPU_TRANSPORTS[name]


def make_transport(
    name: str, shm_dir: str = "/dev/shm/rl_tpu", host: str = "127.0.0.1", receivers: int = 1, device: Any = None
) -> Transport:
    """The sender side; `host` is the sender's node address, `receivers` the number of engines, `device` the
    sending rank's `cluster.device.Device` (nccl waits on its events)."""
    cls = transport_class(name)
    if cls is ShmFileTransport:
        return cls(shm_dir)
    if cls is CollectiveTransport:
        return cls(host, receivers)
    if name == "nccl":
        return cls(host, receivers, device)
    return cls(bind_ip=host) if name == "tpu_sync" else cls()
