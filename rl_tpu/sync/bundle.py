"""The weight bundle's format: buckets of named tensors, each checksummed over names, dtypes, shapes and bytes.

The bundle (`rl_tpu.records.WeightBundle`) is the narrow contract between trainer and engines: Hugging
Face parameter names in size-bounded buckets, a monotonically increasing version, and per-bucket
checksums computed on the sender. The receiver verifies every bucket before any of it reaches the engine
(`rl_tpu.sync.endpoints.unpack`). This module imports nothing else of `rl_tpu.sync`.
"""

from __future__ import annotations

import os

import blake3
import numpy as np
import torch

from rl_tpu.records import TensorSpec, WeightBundle, WeightSyncError


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
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
    partial = sorted(
        f"{target} ({len(names)} of {needed[target]})"
        for target, names in filled.items()
        if target in engine_params and len(names) != needed[target]
    )
    if missing or unexpected or partial:
        raise WeightSyncError(
            f"weight bundle v{bundle.version} does not match the served model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}, partly filled fused weights {partial[:5]}; "
            "nothing was installed"
        )
