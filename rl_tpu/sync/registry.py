"""The registry of transports by `sync.transport` name, or by import path (`package.module:Class`) for one defined
outside rl_tpu; the device ones are imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from rl_tpu.sync.base import SenderSetting, Transport
from rl_tpu.sync.collective import CollectiveTransport
from rl_tpu.sync.object_store import ObjectStoreTransport
from rl_tpu.sync.shm_file import ShmFileTransport

CPU_TRANSPORTS = {"object_store": ObjectStoreTransport, "shm_file": ShmFileTransport, "collective": CollectiveTransport}
# imported when asked for: cuda_ipc and tpu_sync are one device's paths, nccl imports vLLM's weight-transfer modules
DEVICE_TRANSPORTS = {
    "cuda_ipc": "rl_tpu.sync.cuda_ipc:CudaIpcTransport",
    "tpu_sync": "rl_tpu.sync.tpu_sync:TpuSyncTransport",
    "nccl": "rl_tpu.sync.nccl:NcclTransport",
}
TRANSPORT_NAMES = (*CPU_TRANSPORTS, *DEVICE_TRANSPORTS)
DEFAULT_TRANSPORT = "object_store"


def transport_class(name: str) -> type[Transport]:
    """The class `sync.transport=name` names; refuses an unknown name, naming the key and the allowed values."""
    if name in CPU_TRANSPORTS:
        return CPU_TRANSPORTS[name]
    if name in DEVICE_TRANSPORTS:
        module, _, attribute = DEVICE_TRANSPORTS[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
    module, _, attribute = name.partition(":")
    if not module or not attribute:
        raise ValueError(
            f"sync.transport={name!r}: allowed values are {', '.join(TRANSPORT_NAMES)}, or a Transport subclass by "
            "import path (package.module:Class)"
        )
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"sync.transport={name!r}: cannot import {attribute} from {module}: {err}") from err
    if not (isinstance(found, type) and issubclass(found, Transport)):
        raise ValueError(f"sync.transport={name!r} is {found!r}, not a subclass of rl_tpu.sync.base.Transport")
    return found


def host_transports() -> list[str]:
    """The built-in transports an engine over several devices can receive through (`Transport.through_host`)."""
    return [name for name, cls in CPU_TRANSPORTS.items() if cls.through_host]


def make_transport(
    name: str, shm_dir: str = "/dev/shm/rl_tpu", host: str = "127.0.0.1", receivers: int = 1, device: Any = None
) -> Transport:
    """The sender side; `host` is the sender's node address, `receivers` the number of engines, `device` the
    sending rank's `cluster.device.Device` (nccl waits on its events). Its bundles carry `name`, by which each
    engine finds the same class to receive them."""
    transport = transport_class(name).sender(SenderSetting(shm_dir, host, receivers, device))
    transport.name = name
    return transport
