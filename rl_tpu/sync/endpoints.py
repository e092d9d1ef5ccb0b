"""Both ends of a sync: `pack` stages a bundle's buckets through a transport, `unpack` fetches and verifies them."""

from __future__ import annotations

import time
import warnings
from typing import Iterable

import torch

from rl_tpu.records import Bucket, WeightBundle, WeightSyncError
from rl_tpu.sync.base import Transport
from rl_tpu.sync.bundle import as_bytes, checksum, device_checksum, flat_bytes, plan_buckets, spec_of, split_flat
from rl_tpu.sync.object_store import ObjectStoreTransport
from rl_tpu.sync.registry import transport_class


def pack(
    state_dict: dict[str, torch.Tensor], version: int, transport: Transport | None = None, bucket_mb: float = 512
) -> WeightBundle:
    """Trainer side: stage full CPU tensors as checksummed buckets through `transport`."""
    sizes = {name: tensor.nbytes for name, tensor in state_dict.items()}
    groups = ({n: state_dict[n] for n in names} for names in plan_buckets(sizes, int(bucket_mb * 2**20)))
    return pack_buckets(groups, version, transport)


def pack_buckets(
    groups: Iterable[dict[str, torch.Tensor] | None], version: int, transport: Transport | None = None
) -> WeightBundle:
    """Stage buckets as they come (a sharded trainer gathers one at a time); each is checksummed and put.

    A `None` group is a bucket that another sender stages: the result is then this sender's part of
    the bundle (`WeightBundle.merge` joins the parts)."""
    transport = transport or ObjectStoreTransport()
    buckets = []
    for index, group in enumerate(groups):
        if group is None:
            continue
        specs = tuple(spec_of(n, t) for n, t in group.items())
        if transport.on_device:  # the bucket stays where it was gathered, and is checked there
            flat = flat_bytes(group)
            buckets.append(Bucket(specs, device_checksum(flat), transport.put_flat(version, index, flat), index))
            continue
        named = {n: t.detach().cpu() for n, t in group.items()}
        buffers = [as_bytes(t) for t in named.values()]
        buckets.append(Bucket(specs, checksum(specs, buffers), transport.put(version, index, named, buffers), index))
    if buckets:
        transport.flush()
    num_bytes = sum(spec.num_bytes for bucket in buckets for spec in bucket.specs)
    return WeightBundle(version, transport.name, tuple(buckets), num_bytes)


def unpack(bundle: WeightBundle, receiver: int = 0) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Sampler side (engine `receiver`): fetch and verify every bucket, then rebuild named tensors.

    Raises on any mismatch."""
    if transport_class(bundle.transport).on_device:
        return _unpack_on_device(bundle, receiver)
    get = transport_class(bundle.transport).get
    start = time.perf_counter()
    fetched = [(bucket, get(bucket, receiver)) for bucket in bundle.buckets]
    got = time.perf_counter()
    for index, (bucket, buffers) in enumerate(fetched):
        if len(buffers) != len(bucket.specs) or checksum(bucket.specs, buffers) != bucket.checksum:
            raise checksum_failure(bundle, index)
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zero-copy views are read-only; the engine copies them
        for bucket, buffers in fetched:
            for spec, buf in zip(bucket.specs, buffers):
                tensors.append((spec.name, torch.from_numpy(buf).view(getattr(torch, spec.dtype)).view(spec.shape)))
    return tensors, {"fetch_s": got - start, "verify_s": time.perf_counter() - got}


def _unpack_on_device(bundle: WeightBundle, receiver: int) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
    """`unpack` for a transport whose buckets stay on the device: each opened where it lies and checked there."""
    get = transport_class(bundle.transport).get_flat
    start = time.perf_counter()
    fetched = [(bucket, get(bucket, receiver)) for bucket in bundle.buckets]
    got = time.perf_counter()
    tensors = []
    for index, (bucket, flat) in enumerate(fetched):
        if device_checksum(flat) != bucket.checksum:
            raise checksum_failure(bundle, index)
        tensors += [(spec.name, tensor) for spec, tensor in zip(bucket.specs, split_flat(flat, bucket.specs))]
    return tensors, {"fetch_s": got - start, "verify_s": time.perf_counter() - got}


def checksum_failure(bundle: WeightBundle, index: int) -> WeightSyncError:
    return WeightSyncError(
        f"weight bundle v{bundle.version}: bucket {index} of {len(bundle.buckets)} fails its checksum "
        f"({bundle.transport}); nothing was installed"
    )
