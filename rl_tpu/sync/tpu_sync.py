"""`sync.transport=tpu_sync`: weight pushes over TPU Sync (google/tpu-sync) between TPU hosts.

NOT YET RUN ON TPU HARDWARE. Written against the PyTorch API of the pinned `tpu-sync-torch`
(requirements/tpu.txt), `tpu_sync.api.torch.weight_synchronizer.WeightSynchronizer`:

- ``WeightSynchronizer(device_tensors, local_port=None, parallelism=1, listener_port=None,
  bind_ip=None, unsafe_skip_buffer_lock=True, auto_h2d=False, global_shard_indices=None)``
  registers device tensors (``[layers][shards]``, TPU tensors only) and allocates one host
  staging buffer per tensor. ``local_port=0`` picks a free port, readable afterwards from the
  ``local_port`` property; ``bind_ip`` is the address it advertises and sends from
  (``get_local_endpoints()`` returns ``[{"endpoint": "ip:port", ...}]``), so it must be one that
  peers on other hosts reach; None lets it pick this host's data NIC.
- ``get_host_buffer(layer_idx, shard_idx)``: a zero-copy uint8 CPU tensor over that staging buffer.
- ``h2d()`` / ``d2h()``: staging buffers to the registered device tensors and back (they wait).
- ``push_weights(["ip:port", ...])``: ``d2h()`` of every layer, then the staging buffers are
  written into each peer's staging buffers; it returns once every peer has them.
- ``wait_for_transfer_completion(uuid=None)`` is for controller-driven transfers, which carry a
  uuid; a plain `push_weights` records none, so this call would never return after one.
- ``unbind_weights()`` releases the device tensors; the staging buffers stay.

Importing the module imports `torch_tpu` (whose library the extension links) and libtpu, so
it is imported only when this transport is used. What runs without a TPU (slot plan, packing,
handshake, checksum failures) is tested on CPU with a stand-in synchronizer and, where
tpu-sync-torch imports, with its CPU test instance (test_only_create_cpu_instance).

Layout. TPU Sync moves a fixed list of equally sized buffers, so the bundle's buckets
(`sync.plan_buckets`, at most `sync.bucket_mb` each) become *slots*: slot i holds bucket i's
tensors back to back at aligned offsets, padded to the largest bucket. Both ends hold the same
`SlotPlan`, made once from the trainer's full state dict at start-up.

Copies. The sender writes each bucket's host bytes (already on the host, where `sync.pack`
checksummed them) straight into its staging buffers; `flush` copies them to the registered
device slots (`h2d`) only because `push_weights` always starts with a `d2h` from them. The
receiver never touches its device: the engine reads the pushed bytes in place from the staging
buffers, so its device slots are released (`unbind_weights`) right after the listener opens.
One sync: one host-to-device and one device-to-host copy, both on the sender (the engine's own
load of the verified bytes, as with every transport, comes on top).

Contract. Unchanged from the other transports: the sender checksums every bucket and stamps
the version; the receiver verifies every checksum, the version and the names, and only then
installs (`Sampler.install`). The staging buffers are separate from the engine's weights, so a
bad push never touches what is served. The next push overwrites them: the controller installs
bundle v before it publishes v+1.

Handshake (`Transport.handshake`, run by the controller once at start-up through
`TrainerWorker.handshake`): trainer rank 0 makes the plan (`offer`), each sampler opens a receiver for
it bound to its node's IP (`listen`, through `Sampler.listen`) and returns its endpoint, and rank 0
connects its sender to those endpoints (`connect`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from rl_tpu.records import Bucket, TensorSpec, WeightSyncError
from rl_tpu.sync.base import SenderSetting, Transport
from rl_tpu.sync.bundle import plan_buckets, spec_of

if TYPE_CHECKING:
    from rl_tpu.config import RunConfig

ALIGN = 512  # byte alignment of every tensor inside a slot (DMA-friendly, and a multiple of any itemsize)
PARALLELISM = 4  # TCP streams per push (WeightSynchronizer's `parallelism`)

# A factory with WeightSynchronizer's constructor signature: (device_tensors, **options) -> synchronizer.
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
        """Zeroed slots as TPU Sync registers them: one layer per slot, one shard each."""
        return [[torch.zeros(self.slot_bytes, dtype=torch.uint8, device=device)] for _ in self.buckets]

    def write(self, index: int, buffers: list[np.ndarray], slot: np.ndarray) -> None:
        """Lay bucket `index`'s byte arrays into `slot` (a host staging buffer) at their offsets."""
        for spec, start, buf in zip(self.buckets[index], self.offsets(index), buffers, strict=True):
            slot[start : start + spec.num_bytes] = buf

    def read(self, index: int, slot: np.ndarray) -> list[np.ndarray]:
        return [slot[start : start + spec.num_bytes] for spec, start in zip(self.buckets[index], self.offsets(index))]


def default_factory() -> SynchronizerFactory:
    try:
        from tpu_sync.api.torch.weight_synchronizer import WeightSynchronizer
    except (ImportError, OSError) as err:  # OSError: a library it loads (torch_tpu's, libtpu) is missing
        raise RuntimeError(
            "sync.transport=tpu_sync needs TPU Sync's PyTorch package (tpu-sync-torch) with torch_tpu "
            "and libtpu, on Python 3.12 on a TPU host (pinned in requirements/tpu.txt; see "
            f"examples/tpu/README.md); on CPU or GPU use object_store or collective ({err})"
        ) from err
    return WeightSynchronizer


def staging_buffers(synchronizer: Any, plan: SlotPlan) -> list[np.ndarray]:
    """Zero-copy numpy views of the synchronizer's host staging buffers, one per slot."""
    views = []
    for index in range(len(plan.buckets)):
        buffer = synchronizer.get_host_buffer(index, 0)
        if buffer.numel() < plan.slot_bytes:
            raise WeightSyncError(
                f"tpu_sync staging buffer {index} holds {buffer.numel()} bytes, the slot plan needs {plan.slot_bytes}"
            )
        views.append(buffer[: plan.slot_bytes].numpy())
    return views


class TpuSyncTransport(Transport):
    """Sender side (trainer rank 0); `get` and `open_receiver` are the receiver side (the sampler)."""

    name = "tpu_sync"
    devices = ("tpu",)
    handshake = True  # the engines listen for the slot plan rank 0 offers, then rank 0 connects to them
    _receivers: dict[str, "_Receiver"] = {}  # endpoint -> receiver, in the sampler's process

    def __init__(self, factory: SynchronizerFactory | None = None, bind_ip: str | None = None):
        # bind_ip: the sender's own address; None lets TPU Sync pick this host's data NIC
        self.factory, self.bind_ip = factory, bind_ip
        self.plan: SlotPlan | None = None

    @classmethod
    def sender(cls, setting: SenderSetting) -> "TpuSyncTransport":
        return cls(bind_ip=setting.host)

    @classmethod
    def check_config(cls, cfg: "RunConfig") -> None:
        if cfg.trainer.is_async:
            raise ValueError(
                f"sync.transport=tpu_sync with trainer.max_staleness={cfg.trainer.max_staleness}: an engine reads "
                "TPU Sync's staging buffers in place, and in async mode the next push could overwrite them between "
                "their check and their load; use trainer.max_staleness=0 or sync.transport=object_store"
            )

    def offer(self, specs: dict[str, Any], bucket_bytes: int) -> SlotPlan:
        """The slot plan both ends hold, made from the served weights' specs as `sync.pack` buckets them."""
        return SlotPlan.of(specs, bucket_bytes)

    @classmethod
    def listen(cls, offer: SlotPlan, receiver: int, device: torch.device, host: str) -> str:
        return open_receiver(offer, device, host)

    def connect(self, plan: SlotPlan, peers: list[str], device: torch.device) -> None:
        self.plan, self.peers = plan, list(peers)
        self.slots = plan.allocate(device)  # what push_weights copies from (d2h); written only by h2d
        self.synchronizer = (self.factory or default_factory())(
            self.slots, local_port=0, parallelism=PARALLELISM, bind_ip=self.bind_ip, auto_h2d=False
        )
        self.staging = staging_buffers(self.synchronizer, plan)

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> dict:
        if self.plan is None:
            raise WeightSyncError("tpu_sync transport used before connect(): the controller's handshake did not run")
        if tuple(spec_of(n, t) for n, t in named.items()) != self.plan.buckets[index]:
            raise WeightSyncError(
                f"bucket {index} does not match the tpu_sync slot plan made at start-up "
                "(weights changed name, shape or dtype?)"
            )
        self.plan.write(index, buffers, self.staging[index])  # host to host: the bytes pack checksummed
        return {"endpoints": self.peers, "slot": index}

    def flush(self) -> None:
        """Push every slot to every peer (after all buckets of a bundle were put)."""
        self.synchronizer.h2d()  # push_weights starts with a d2h of the device slots: give them the new bytes
        self.synchronizer.push_weights(self.peers)  # returns once every peer's staging buffers hold them

    def close(self) -> None:
        self.synchronizer = self.staging = None

    @classmethod
    def get(cls, bucket: Bucket, receiver_index: int = 0) -> list[np.ndarray]:
        endpoint = bucket.handle["endpoints"][receiver_index]
        receiver = cls._receivers.get(endpoint)
        if receiver is None:
            raise WeightSyncError(f"no tpu_sync receiver at {endpoint} in this process")
        slot = bucket.handle["slot"]
        # The push completed before the sender returned the bundle, so the staging buffers hold it;
        # these are views into them, and sync.unpack verifies them before the sampler uses them.
        return receiver.plan.read(slot, receiver.staging[slot])


@dataclass
class _Receiver:
    plan: SlotPlan
    synchronizer: Any
    staging: list[np.ndarray]


def open_receiver(plan: SlotPlan, device: torch.device, host: str, factory: SynchronizerFactory | None = None) -> str:
    """Sampler side: listen for pushes laid out as `plan`; returns the endpoint the trainer pushes to.

    `host` is this node's IP as the trainer's host reaches it (the sampler passes
    `ray.util.get_node_ip_address()`); the endpoint is `host:port`, so a loopback address only
    works when trainer and sampler share a host.
    """
    slots = plan.allocate(device)  # the constructor sizes the staging buffers from device tensors
    synchronizer = (factory or default_factory())(
        slots, local_port=0, parallelism=PARALLELISM, bind_ip=host, auto_h2d=False
    )
    staging = staging_buffers(synchronizer, plan)
    if hasattr(synchronizer, "unbind_weights"):  # not in every tpu-sync-torch build; see requirements/tpu.txt
        synchronizer.unbind_weights()  # nothing is copied to this device: free the slots' device memory
    del slots
    endpoint = synchronizer.get_local_endpoints()[0]["endpoint"]
    TpuSyncTransport._receivers[endpoint] = _Receiver(plan, synchronizer, staging)
    return endpoint
