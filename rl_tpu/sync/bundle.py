"""The weight bundle's format: buckets of named tensors, each checksummed over names, dtypes, shapes and bytes.

The bundle (`rl_tpu.records.WeightBundle`) is the narrow contract between trainer and engines: Hugging
Face parameter names in size-bounded buckets, a monotonically increasing version, and per-bucket
checksums computed on the sender. The receiver verifies every bucket before any of it reaches the engine
(`rl_tpu.sync.endpoints.unpack`). This module imports nothing else of `rl_tpu.sync`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

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


def named_checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One checksum of named CPU tensors taken one at a time (a whole model need not be in memory), in the order
    given: a LoRA run's base, which trainer and engines each compute in name order and compare at every install."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name, tensor in tensors:
        hasher.update(f"{name}|{spec_of(name, tensor).dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(as_bytes(tensor))
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


def check_kind(bundle: WeightBundle, serves_adapters: bool) -> None:
    """Refuse full weights for an engine that serves a LoRA policy's adapters, and an adapter for one that does not."""
    if (bundle.adapter is not None) != serves_adapters:
        holds = "a LoRA adapter" if bundle.adapter is not None else "full weights"
        serves = "adapters on its base" if serves_adapters else "full weights"
        raise WeightSyncError(
            f"weight bundle v{bundle.version} holds {holds} and the engine serves {serves}; nothing was installed"
        )


def adapter_modules(names: list[str]) -> dict[str, set[str]]:
    """{module: the adapter weights it has (lora_A, lora_B)} of PEFT-named adapter tensors; raises on other names."""
    modules: dict[str, set[str]] = {}
    for name in names:
        module, _, part = name.removesuffix(".weight").rpartition(".")
        if part not in ("lora_A", "lora_B") or not name.endswith(".weight"):
            raise WeightSyncError(f"adapter tensor {name!r} is not a PEFT LoRA weight (<module>.lora_A/B.weight)")
        modules.setdefault(module, set()).add(part)
    return modules


def check_adapter(bundle: WeightBundle, served_base: str, lora_modules: set[str], first: set[str] | None) -> set[str]:
    """Refuse an adapter bundle that would not change what the engine serves as the trainer has it: one over another
    base, an empty one, one with a module lacking lora_A or lora_B or that the engine cannot adapt, or one whose
    modules differ from the first adapter's (`first`; None: this is the first). Returns its modules."""
    where = f"adapter bundle v{bundle.version}"
    if bundle.base_checksum != served_base:
        raise WeightSyncError(
            f"{where} was trained over base {str(bundle.base_checksum)[:16]}, the engine serves base "
            f"{served_base[:16]}: trainer and engine loaded different model weights; nothing was installed"
        )
    modules = adapter_modules(bundle.names)
    incomplete = sorted(m for m, parts in modules.items() if len(parts) != 2)
    unservable = sorted(m for m in modules if m.rpartition(".")[2] not in lora_modules)
    changed = sorted(set(modules) ^ first) if first is not None else []
    if not modules or incomplete or unservable or changed:
        raise WeightSyncError(
            f"{where} does not fit the served model: {len(modules)} modules, without lora_A or lora_B "
            f"{incomplete[:3]}, not adaptable by the engine {unservable[:3]} (it adapts {sorted(lora_modules)}), "
            f"not in the first adapter or missing {changed[:3]}; nothing was installed"
        )
    return set(modules)
