"""Weight sync: the trainer publishes a versioned, checksummed weight bundle; the sampler installs it.

The bundle is the narrow contract between the two sides: Hugging Face parameter names,
a monotonically increasing version, and a checksum computed on the sender over names,
shapes, dtypes and bytes. The receiver verifies the checksum before anything is installed.
Transport here: Ray's object store (zero-copy numpy views for readers on the same node).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class WeightBundle:
    version: int
    checksum: str
    specs: tuple[TensorSpec, ...]
    payload: Any  # transport-specific handle: for the object store, a one-element list holding an ObjectRef
    num_bytes: int
    transport: str = "object_store"


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a CPU tensor of any dtype (numpy has no bfloat16)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()


def checksum(specs: tuple[TensorSpec, ...], buffers: list[np.ndarray]) -> str:
    hasher = blake3.blake3()
    for spec, buf in zip(specs, buffers, strict=True):
        hasher.update(f"{spec.name}|{spec.dtype}|{spec.shape}|".encode())
        hasher.update(buf)
    return hasher.hexdigest()


def pack(state_dict: dict[str, torch.Tensor], version: int) -> WeightBundle:
    """Trainer side: stage full CPU tensors into the object store as one bundle."""
    import ray

    specs = tuple(TensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state_dict.items())
    buffers = [_as_bytes(t.cpu()) for t in state_dict.values()]
    digest = checksum(specs, buffers)
    ref = ray.put(buffers)
    return WeightBundle(version, digest, specs, [ref], sum(b.nbytes for b in buffers))


def unpack(bundle: WeightBundle) -> tuple[list[tuple[str, torch.Tensor]], dict[str, float]]:
    """Sampler side: fetch, verify the checksum, and rebuild named tensors. Raises on any mismatch."""
    import ray

    start = time.perf_counter()
    buffers = ray.get(bundle.payload[0])
    fetched = time.perf_counter()
    if len(buffers) != len(bundle.specs):
        raise WeightSyncError(f"weight bundle v{bundle.version}: {len(buffers)} buffers for {len(bundle.specs)} tensors")
    actual = checksum(bundle.specs, buffers)
    if actual != bundle.checksum:
        raise WeightSyncError(
            f"weight bundle v{bundle.version}: checksum mismatch (sent {bundle.checksum[:16]}, got {actual[:16]});"
            " nothing was installed"
        )
    tensors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zero-copy views are read-only; the engine copies them
        for spec, buf in zip(bundle.specs, buffers):
            tensor = torch.from_numpy(buf).view(getattr(torch, spec.dtype)).view(spec.shape)
            tensors.append((spec.name, tensor))
    timings = {"fetch_s": fetched - start, "verify_s": time.perf_counter() - fetched}
    return tensors, timings
