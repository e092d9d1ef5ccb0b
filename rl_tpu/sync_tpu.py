"""`sync.transport=tpu_sync`: weight pushes over TPU Sync (google/tpu-sync) for TPU slices.

NOT YET RUN ON TPU HARDWARE. Written against TPU Sync's documented PyTorch API,
`tpu_sync.api.torch.weight_synchronizer.WeightSynchronizer`: both ends register the same list
of device buffers (``[layers][shards]``); the sender copies its buffers to host (`d2h`) and
pushes them to its peers' ``host:port`` (`push_weights`); the receiver waits for the transfer
(`wait_for_transfer_completion`) and copies host to device (`h2d`). The package is imported
only when this transport is used. What runs without a TPU (the slot plan, packing, unpacking,
the handshake, checksum failures) is tested on CPU with a stand-in synchronizer.

Layout. TPU Sync moves a fixed list of equally sized buffers, so the bundle's buckets
(`sync.plan_buckets`, at most `sync.bucket_mb` each) become *slots*: slot i holds bucket i's
tensors back to back at aligned offsets, padded to the largest bucket. Both ends hold the same
`SlotPlan`, made once from the trainer's full state dict at start-up.

Contract. Unchanged from the other transports: the sender checksums every bucket and stamps
the version; the receiver copies every pushed slot out of its staging buffers, verifies every
checksum, the version and the names, and only then installs (`Sampler.install`). The staging
buffers are separate from the engine's weights, so a bad push never touches what is served.
The cost is one extra copy of the weights on the sampler's device while staging.

Handshake (`TrainerWorker.connect_tpu_sync`, once at start-up): trainer rank 0 makes the plan,
the sampler opens a receiver for it (`Sampler.open_tpu_sync`) and returns its endpoint, and
rank 0 connects its sender to that endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from rl_tpu.sync import Bucket, TensorSpec, Transport, WeightSyncError, plan_buckets, spec_of

ALIGN = 512  # byte alignment of every tensor inside a slot (DMA-friendly, and a multiple of any itemsize)

# A factory with WeightSynchronizer's signature: (device_tensors, **options) -> synchronizer.
SynchronizerFactory = Callable[..., Any]


def _aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class SlotPlan:
    """Which tensor sits where: bucket i is slot i; every slot is `slot_bytes` long."""

    buckets: tuple[tuple[TensorSpec, ...], ...]
    slot_bytes: int

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor], bucket_bytes: int) -> "SlotPlan":
        groups = plan_buckets({name: t.nbytes for name, t in state_dict.items()}, bucket_bytes)  # as sync.pack
        buckets = tuple(tuple(spec_of(n, state_dict[n]) for n in group) for group in groups)
        slot_bytes = max(sum(_aligned(s.num_bytes) for s in bucket) for bucket in buckets)
        return cls(buckets, slot_bytes)

    def offsets(self, index: int) -> list[int]:
        starts, position = [], 0
        for spec in self.buckets[index]:
            starts.append(position)
            position += _aligned(spec.num_bytes)
        return starts

    def allocate(self, device: torch.device) -> list[list[torch.Tensor]]:
        """Zeroed slots as TPU Sync takes them: one layer per slot, one shard each."""
        return [[torch.zeros(self.slot_bytes, dtype=torch.uint8, device=device)] for _ in self.buckets]

    def write(self, index: int, buffers: list[np.ndarray], slot: torch.Tensor) -> None:
        for spec, start, buf in zip(self.buckets[index], self.offsets(index), buffers, strict=True):
            slot[start : start + spec.num_bytes].copy_(torch.from_numpy(buf))

    def read(self, index: int, slot: np.ndarray) -> list[np.ndarray]:
        return [slot[start : start + spec.num_bytes]
                for spec, start in zip(self.buckets[index], self.offsets(index))]


def default_factory() -> SynchronizerFactory:
    try:
        from tpu_sync.api.torch.weight_synchronizer import WeightSynchronizer
    except ImportError as err:
        raise RuntimeError("sync.transport=tpu_sync needs TPU Sync's PyTorch package (tpu-sync-torch, built for "
                           "the installed torch_tpu) on a TPU host; on CPU or GPU use object_store or collective"
                           ) from err
    return WeightSynchronizer


class TpuSyncTransport(Transport):
    """Sender side (trainer rank 0); `get` and `open_receiver` are the receiver side (the sampler)."""

    name = "tpu_sync"
    _receivers: dict[str, "_Receiver"] = {}  # endpoint -> receiver, in the sampler's process

    def __init__(self, factory: SynchronizerFactory | None = None):
        self.factory = factory
        self.plan: SlotPlan | None = None

    def connect(self, plan: SlotPlan, peers: list[str], device: torch.device) -> None:
        self.plan, self.peers = plan, peers
        self.slots = plan.allocate(device)
        self.synchronizer = (self.factory or default_factory())(self.slots, local_port=0, parallelism=4)

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> dict:
        if self.plan is None:
            raise WeightSyncError("tpu_sync transport used before connect(): the controller's handshake did not run")
        if tuple(spec_of(n, t) for n, t in named.items()) != self.plan.buckets[index]:
            raise WeightSyncError(f"bucket {index} does not match the tpu_sync slot plan made at start-up "
                                  "(weights changed name, shape or dtype?)")
        self.plan.write(index, buffers, self.slots[index][0])
        return {"endpoints": self.peers, "slot": index}

    def flush(self) -> None:
        """Push every slot to every peer (after all buckets of a bundle were put)."""
        self.synchronizer.d2h()
        if self.slots[0][0].device.type != "cpu":
            torch.accelerator.synchronize()
        self.synchronizer.push_weights(self.peers)

    def close(self) -> None:
        self.synchronizer = None

    @classmethod
    def get(cls, bucket: Bucket, receiver_index: int = 0) -> list[np.ndarray]:
        endpoint = bucket.handle["endpoints"][receiver_index]
        receiver = cls._receivers.get(endpoint)
        if receiver is None:
            raise WeightSyncError(f"no tpu_sync receiver at {endpoint} in this process")
        if bucket.handle["slot"] == 0:  # the first bucket of a bundle: take in the whole push
            receiver.ingest()
        return receiver.plan.read(bucket.handle["slot"], receiver.host_slots[bucket.handle["slot"]])


@dataclass
class _Receiver:
    plan: SlotPlan
    slots: list[list[torch.Tensor]]
    synchronizer: Any
    host_slots: list[np.ndarray] | None = None

    def ingest(self) -> None:
        """Wait for the push, move it into the staging slots, and copy them out for verification."""
        self.synchronizer.wait_for_transfer_completion()
        self.synchronizer.h2d()
        self.host_slots = [layer[0].cpu().numpy() for layer in self.slots]


def open_receiver(plan: SlotPlan, device: torch.device, host: str = "127.0.0.1",
                  factory: SynchronizerFactory | None = None) -> str:
    """Sampler side: staging slots and a listening synchronizer; returns the endpoint to push to."""
    slots = plan.allocate(device)
    synchronizer = (factory or default_factory())(slots, local_port=0, parallelism=4, bind_ip=host)
    endpoint = f"{host}:{synchronizer.local_port}"
    TpuSyncTransport._receivers[endpoint] = _Receiver(plan, slots, synchronizer)
    return endpoint
