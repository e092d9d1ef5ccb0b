"""`sync.transport=cuda_ipc`: a colocated trainer hands its engine CUDA IPC handles of its buckets; the weights never
leave the GPU.

Rank 0 gathers each bucket on its device into one flat byte buffer, keeps it (this version's and the one before:
an engine may still be copying that), and puts a handle of it in the bucket: torch's own reduction of a CUDA tensor
for another process (`torch.multiprocessing.reductions.reduce_tensor`) with the GPU's UUID, since the engine may
number its devices otherwise. The engine opens the handle on the same GPU, checks the device checksum there
(`bundle.device_checksum`) and hands views of the buffer to its loader, which copies them into its parameters. A
CPU tensor goes through torch's shared memory instead (how the unit tests run the logic without a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rl_tpu.records import Bucket, WeightSyncError
from rl_tpu.sync.base import Placed, Transport

if TYPE_CHECKING:
    from rl_tpu.config import RunConfig


def share(flat: torch.Tensor) -> dict[str, Any]:
    """A handle of `flat` that another process on this host opens (`open_shared`) without a copy."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(flat)
    uuid = str(torch.cuda.get_device_properties(flat.device).uuid) if flat.is_cuda else None
    return {"rebuild": rebuild, "args": args, "gpu_uuid": uuid}


def open_shared(handle: dict[str, Any]) -> torch.Tensor:
    """The tensor `share` made a handle of, in this process (on a GPU: the one with the sender's GPU's UUID)."""
    args = list(handle["args"])
    if handle["gpu_uuid"] is not None:
        ours = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if handle["gpu_uuid"] not in ours:
            raise WeightSyncError(
                f"sync.transport=cuda_ipc: the trainer's GPU {handle['gpu_uuid']} is not one this engine sees "
                f"({ours}); the transport needs trainer rank 0 and the engine on one GPU (the colocated layout)"
            )
        args[6] = ours.index(handle["gpu_uuid"])  # the device index, as this process numbers its GPUs
    return handle["rebuild"](*args)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    on_device = True
    kept_versions = 2  # the version before stays until this one is installed
    devices = ("cuda",)

    def __init__(self):
        self.kept: dict[int, list[torch.Tensor]] = {}  # version -> its buckets' buffers, alive while engines read

    @classmethod
    def check_config(cls, cfg: "RunConfig") -> None:
        device = cfg.device
        if cfg.sampler.num_engines != 1 or device in ("cpu", "tpu"):
            raise ValueError(
                f"sync.transport=cuda_ipc hands GPU memory from trainer rank 0 to one engine on its GPU: it needs "
                f"device=cuda (or auto on a GPU host) and sampler.num_engines=1 (got device={device}, "
                f"sampler.num_engines={cfg.sampler.num_engines}); use sync.transport=object_store otherwise"
            )

    @classmethod
    def check_placement(cls, cfg: "RunConfig", placed: Placed) -> str | None:
        """The engine must share rank 0's GPU: engines that sleep are colocated on CUDA."""
        if placed.engines_sleep:
            return None
        return (
            f"sync.transport=cuda_ipc hands GPU memory to an engine on the same GPU, but this run's layout is "
            f"{placed.layout}, not colocated on CUDA: set placement=colocated on a GPU host, or use "
            "sync.transport=object_store"
        )

    def put_flat(self, version: int, index: int, flat: torch.Tensor) -> dict[str, Any]:
        if index == 0:  # the version before stays until this one is installed
            self.kept = {v: buffers for v, buffers in self.kept.items() if v >= version - 1}
        self.kept.setdefault(version, []).append(flat)
        return share(flat)

    @staticmethod
    def get_flat(bucket: Bucket, receiver: int = 0) -> torch.Tensor:
        try:
            return open_shared(bucket.handle)
        except WeightSyncError:
            raise
        except Exception as err:  # a handle of a buffer that is gone, or of another host
            raise WeightSyncError(f"cannot open bucket {bucket.index}'s CUDA IPC handle: {err}") from err

    def close(self) -> None:
        self.kept.clear()
