"""Weight sync: the trainer publishes a versioned, checksummed weight bundle; the sampler installs it.

The bundle is the narrow contract between the two sides: Hugging Face parameter names in
size-bounded buckets, a monotonically increasing version, and per-bucket checksums computed on
the sender over names, dtypes, shapes and bytes. The receiver fetches and verifies *every*
bucket before it returns anything, so a corrupt or missing bucket never reaches the engine.

Transports (`sync.transport`):
- `object_store`: Ray's object store; readers on the same node get zero-copy numpy views.
- `shm_file`: one safetensors file per bucket in a shared-memory folder (`sync.shm_dir`).
- `collective`: a gloo group of trainer rank 0 and every engine, created on first use and bound to
  rank 0's node address; each bucket is one broadcast of its bytes, in order.
- `tpu_sync`: TPU Sync pushes between TPU hosts (`rl_tpu/sync_tpu.py`; not yet run on hardware).
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

import blake3
import numpy as np
import torch


class WeightSyncError(RuntimeError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # e.g. "float32", "bfloat16"
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    specs: tuple[TensorSpec, ...]
    checksum: str
    handle: Any  # object_store: [ObjectRef]; shm_file: the file's path; collective: the group's {host, port}
    index: int  # its place in the bundle (buckets may come from several senders)


@dataclass(frozen=True)
class WeightBundle:
    version: int
    transport: str
    buckets: tuple[Bucket, ...]
    num_bytes: int

    @property
    def names(self) -> list[str]:
        return [spec.name for bucket in self.buckets for spec in bucket.specs]

    @classmethod
    def merge(cls, parts: list["WeightBundle"]) -> "WeightBundle":
        """One bundle from the parts that several trainer ranks sent (each holds some of the buckets)."""
        buckets = tuple(sorted((b for part in parts for b in part.buckets), key=lambda b: b.index))
        if {(p.version, p.transport) for p in parts} != {(parts[0].version, parts[0].transport)} \
                or [b.index for b in buckets] != list(range(len(buckets))):
            raise WeightSyncError(f"the trainer ranks' parts of a weight bundle do not fit together: versions "
                                  f"{[p.version for p in parts]}, buckets {[[b.index for b in p.buckets] for p in parts]}")
        return cls(parts[0].version, parts[0].transport, buckets, sum(p.num_bytes for p in parts))


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a CPU tensor of any dtype (numpy has no bfloat16)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()


def checksum(specs: tuple[TensorSpec, ...], buffers: list[np.ndarray]) -> str:
    # on every core this process may use now: a 1 GB bf16 bundle's pack and verified fetch through the object
    # store took 0.71 s instead of 0.99 on 2 cores (results/weight_sync_hash_threads.json)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else blake3.blake3.AUTO
    hasher = blake3.blake3(max_threads=threads)
    for spec, buf in zip(specs, buffers, strict=True):
        hasher.update(f"{spec.name}|{spec.dtype}|{spec.shape}|".encode())
        hasher.update(buf)
    return hasher.hexdigest()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def assign_senders(bucket_bytes: list[int], senders: int) -> list[int]:
    """Which sender stages each bucket: in turn, the one that has the fewest bytes so far (ties: the lowest),
    so that every trainer rank writes its share of a bundle. Deterministic: every rank computes the same."""
    loads, owners = [0] * senders, []
    for size in bucket_bytes:
        owner = loads.index(min(loads))
        owners.append(owner)
        loads[owner] += size
    return owners


def plan_buckets(sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names grouped so that each group holds at most `bucket_bytes` (a larger tensor goes alone)."""
    groups: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if groups[-1] and filled + size > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    return [g for g in groups if g]


class Transport:
    """Sender side of a transport: `put` stages one bucket and returns its handle; `flush` ends a bundle.

    The receiver side is the class method `get(bucket, receiver) -> list of byte arrays`, one per
    spec; `receiver` is the engine's index among the engines that receive every bundle.
    """

    name: str
    # whether any trainer rank may stage buckets: the receiver then fetches each from where it was put
    any_rank_sends: bool = False

    def flush(self) -> None:
        """Called after the last bucket of a bundle; transports that send per bucket have nothing left."""

    def close(self) -> None:
        """Release what the transport holds when the trainer shuts down."""


class ObjectStoreTransport(Transport):
    name = "object_store"
    any_rank_sends = True  # objects are fetched from whichever node put them

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> Any:
        import ray

        return [ray.put(buffers)]  # freed by Ray's reference counting once the last bundle is dropped

    timeout_s = 300.0  # a bucket whose sender's node is gone must fail the install, not hang the engine

    @classmethod
    def get(cls, bucket: Bucket, receiver: int = 0) -> list[np.ndarray]:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(bucket.handle[0], timeout=cls.timeout_s)
        except GetTimeoutError as err:
            raise WeightSyncError(f"bucket {bucket.index} did not come through the object store within "
                                  f"{cls.timeout_s:g} s; nothing was installed") from err


class ShmFileTransport(Transport):
    name = "shm_file"

    def __init__(self, root: str = "/dev/shm/rl_tpu"):
        self.root = Path(root) / f"sender-{os.getpid()}"

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
        return [_as_bytes(tensors[spec.name]) if spec.name in tensors else np.empty(0, np.uint8) for spec in bucket.specs]

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


class CollectiveTransport(Transport):
    """Broadcasts over a gloo group {trainer rank 0: 0, engine i: i + 1}, made on the first bundle.

    `put` only queues a bucket and returns; a sender thread broadcasts the queue in order once the
    receiver has joined, so publishing never waits for the sampler. The receiver reads every bucket
    of a bundle in order (see `unpack`), which keeps both ends of the stream aligned.
    """

    name = "collective"
    # A peer that died mid-stream surfaces as an error on the other side after this long, not a hang.
    timeout = timedelta(minutes=5)
    _receiver_groups: dict[tuple[str, int], Any] = {}

    def __init__(self, host: str = "127.0.0.1", receivers: int = 1):
        # `host`: the sender's node address, which the engines on other nodes connect to
        self.host, self.size, self.store, self.queue = host, receivers + 1, None, queue.Queue()

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> dict:
        import torch.distributed as dist

        if self.store is None:
            self.store = dist.TCPStore(self.host, 0, self.size, is_master=True, wait_for_workers=False)
            threading.Thread(target=self._serve, daemon=True, name="weight-broadcast").start()
        self.queue.put(torch.from_numpy(np.concatenate(buffers)))
        return {"host": self.host, "port": self.store.port, "size": self.size}

    def _serve(self) -> None:
        group = gloo_group(self.store, 0, self.size, self.host, self.timeout)  # waits for every receiver to join
        while (flat := self.queue.get()) is not None:
            group.broadcast(flat, 0).wait()

    def close(self) -> None:
        self.queue.put(None)

    @classmethod
    def get(cls, bucket: Bucket, receiver: int = 0) -> list[np.ndarray]:
        import torch.distributed as dist
        from ray.util import get_node_ip_address

        key, size = (bucket.handle["host"], bucket.handle["port"]), bucket.handle["size"]
        if key not in cls._receiver_groups:
            store = dist.TCPStore(key[0], key[1], size, is_master=False, timeout=cls.timeout)
            cls._receiver_groups[key] = gloo_group(store, receiver + 1, size, get_node_ip_address(), cls.timeout)
        sizes = [spec.num_bytes for spec in bucket.specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        cls._receiver_groups[key].broadcast(flat, 0).wait()
        return list(np.split(flat.numpy(), np.cumsum(sizes)[:-1]))


def gloo_group(store, rank: int, size: int, address: str, timeout: timedelta):
    """A gloo group whose sockets bind to `address`, this node's IP.

    Gloo's default device binds to whatever the host name resolves to, which is often 127.0.0.1
    (`/etc/hosts` in containers): peers on other hosts could then never connect.
    """
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


CPU_TRANSPORTS = {"object_store": ObjectStoreTransport, "shm_file": ShmFileTransport,
                  "collective": CollectiveTransport}
TRANSPORT_NAMES = (*CPU_TRANSPORTS, "tpu_sync")


def transport_class(name: str) -> type[Transport]:
    if name == "tpu_sync":  # imported only when asked for: it is the TPU-only path
        from rl_tpu.sync_tpu import TpuSyncTransport

        return TpuSyncTransport
    if name not in CPU_TRANSPORTS:
        raise ValueError(f"sync.transport={name!r}: allowed values are {', '.join(TRANSPORT_NAMES)}")
    return CPU_TRANSPORTS[name]


def make_transport(name: str, shm_dir: str = "/dev/shm/rl_tpu", host: str = "127.0.0.1",
                   receivers: int = 1) -> Transport:
    """The sender side; `host` is the sender's node address, `receivers` the number of engines."""
    cls = transport_class(name)
    if cls is ShmFileTransport:
        return cls(shm_dir)
    if cls is CollectiveTransport:
        return cls(host, receivers)
    return cls(bind_ip=host) if name == "tpu_sync" else cls()


def pack(state_dict: dict[str, torch.Tensor], version: int, transport: Transport | None = None,
         bucket_mb: float = 512) -> WeightBundle:
    """Trainer side: stage full CPU tensors as checksummed buckets through `transport`."""
    sizes = {name: tensor.nbytes for name, tensor in state_dict.items()}
    groups = ({n: state_dict[n] for n in names} for names in plan_buckets(sizes, int(bucket_mb * 2**20)))
    return pack_buckets(groups, version, transport)


def pack_buckets(groups: Iterable[dict[str, torch.Tensor] | None], version: int,
                 transport: Transport | None = None) -> WeightBundle:
    """Stage buckets as they come (a sharded trainer gathers one at a time); each is checksummed and put.

    A `None` group is a bucket that another sender stages: the result is then this sender's part of
    the bundle (`WeightBundle.merge` joins the parts)."""
    transport = transport or ObjectStoreTransport()
    buckets = []
    for index, group in enumerate(groups):
        if group is None:
            continue
        named = {n: t.detach().cpu() for n, t in group.items()}
        specs = tuple(spec_of(n, t) for n, t in named.items())
        buffers = [_as_bytes(t) for t in named.values()]
        buckets.append(Bucket(specs, checksum(specs, buffers), transport.put(version, index, named, buffers), index))
    if buckets:
        transport.flush()
    num_bytes = sum(spec.num_bytes for bucket in buckets for spec in bucket.specs)
    return WeightBundle(version, transport.name, tuple(buckets), num_bytes)


# A tied head shares the embedding's storage in the trainer, so an engine may not list it among its
# parameters; a bundle may carry it anyway. (The sampler requires it when its engine keeps a copy.)
TIED_NAMES = {"lm_head.weight"}

# Weights an engine stores fused, {engine weight: the Hugging Face weights it concatenates, in order}:
# vLLM's attention and MLP layers for Llama/Qwen-style models. The one place names are mapped.
FUSED_WEIGHTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def engine_name(name: str, engine_params: set[str]) -> tuple[str, int]:
    """The engine parameter a Hugging Face weight is loaded into, and how many weights fill it.

    `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, 3)
    when the engine fuses q/k/v; otherwise the name itself, filled by one weight.
    """
    for fused, parts in FUSED_WEIGHTS.items():
        for part in parts:
            candidate = name.replace(f".{part}.", f".{fused}.")
            if candidate != name and candidate in engine_params:
                return candidate, len(parts)
    return name, 1


def check_names(bundle: WeightBundle, engine_params: set[str]) -> None:
    """Refuse a bundle that would leave any engine weight, or part of a fused one, at the old version."""
    filled: dict[str, set[str]] = {}
    needed: dict[str, int] = {}
    for name in bundle.names:
        target, parts = engine_name(name, engine_params)
        filled.setdefault(target, set()).add(name)
        needed[target] = parts
    missing = sorted(engine_params - filled.keys())
    unexpected = sorted(filled.keys() - engine_params - TIED_NAMES)
    partial = sorted(f"{target} ({len(names)} of {needed[target]})" for target, names in filled.items()
                     if target in engine_params and len(names) != needed[target])
    if missing or unexpected or partial:
        raise WeightSyncError(f"weight bundle v{bundle.version} does not match the served model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}, partly filled fused weights {partial[:5]}; "
                              "nothing was installed")


def unpack(bundle: WeightBundle, receiver: int = 0) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Sampler side (engine `receiver`): fetch and verify every bucket, then rebuild named tensors.

    Raises on any mismatch."""
    get = transport_class(bundle.transport).get
    start = time.perf_counter()
    fetched = [(bucket, get(bucket, receiver)) for bucket in bundle.buckets]
    got = time.perf_counter()
    for index, (bucket, buffers) in enumerate(fetched):
        if len(buffers) != len(bucket.specs) or checksum(bucket.specs, buffers) != bucket.checksum:
            raise WeightSyncError(f"weight bundle v{bundle.version}: bucket {index} of {len(bundle.buckets)} fails its "
                                  f"checksum ({bundle.transport}); nothing was installed")
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zero-copy views are read-only; the engine copies them
        for bucket, buffers in fetched:
            for spec, buf in zip(bucket.specs, buffers):
                tensors.append((spec.name, torch.from_numpy(buf).view(getattr(torch, spec.dtype)).view(spec.shape)))
    return tensors, {"fetch_s": got - start, "verify_s": time.perf_counter() - got}
