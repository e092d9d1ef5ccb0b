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


# 16-bit words per partial sum of `device_checksum`: a word (< 2**16) times its weight (< 2**22) summed 2**22 times
# stays below 2**60, exact in int64 on any device
CHECKSUM_CHUNK_WORDS = 1 << 22


def device_checksum(flat: torch.Tensor) -> str:
    """A checksum of a flat uint8 tensor, computed where it lies (a GPU bucket never visits the host): the sum of its
    16-bit words, each times its position + 1, with their plain sum and the length. Exact integer sums, so the same
    on every device and in any order of reduction; a changed, lost, added or moved word changes it (a word's
    change times a nonzero weight). Not cryptographic: it guards a handoff between this run's own processes, where
    corruption and mix-ups are the risk, as the host transports' blake3 does. One read of the device."""
    words = torch.nn.functional.pad(flat, (0, flat.numel() % 2)).view(torch.int16).to(torch.int64) + 2**15
    sums = []
    for start in range(0, words.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = words[start : start + CHECKSUM_CHUNK_WORDS]
        weights = torch.arange(1, chunk.numel() + 1, device=chunk.device, dtype=torch.int64)
        sums.append(torch.stack([(chunk * weights).sum(), chunk.sum()]))
    partials = torch.stack(sums).tolist() if sums else []
    weighted = sum(w + k * CHECKSUM_CHUNK_WORDS * plain for k, (w, plain) in enumerate(partials))
    plain = sum(p for _, p in partials)
    return f"{flat.numel():x}-{weighted % 2**64:016x}-{plain:x}"


def flat_bytes(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another, in one flat uint8 tensor on their device."""
    return torch.cat([tensor.detach().contiguous().view(-1).view(torch.uint8) for tensor in named.values()])


def split_flat(flat: torch.Tensor, specs: tuple[TensorSpec, ...]) -> list[torch.Tensor]:
    """The tensors `flat_bytes` joined, as views of `flat`; raises if the bytes do not fill the specs exactly."""
    if flat.numel() != sum(spec.num_bytes for spec in specs):
        raise WeightSyncError(f"a bucket of {flat.numel()} bytes does not hold its {len(specs)} tensors")
    tensors, offset = [], 0
    for spec in specs:
        piece = flat[offset : offset + spec.num_bytes].view(getattr(torch, spec.dtype)).view(spec.shape)
        tensors.append(piece)
        offset += spec.num_bytes
    return tensors


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


# Weights an engine stores fused: {engine weight: the Hugging Face weights it concatenates, in order}, each name
# relative to a block. The model's family record holds them (`rl_tpu.models.families`); the engine's side passes
# them in, as sync imports nothing of models.
FusedWeights = dict[str, tuple[str, ...]]


def engine_name(name: str, engine_params: set[str], fused_weights: FusedWeights) -> tuple[str, int]:
    """The engine parameter a Hugging Face weight is loaded into, and how many weights fill it.

    `model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj.weight`, 3)
    when the engine fuses q/k/v (`fused_weights`); otherwise the name itself, filled by one weight.
    """
    for fused, parts in fused_weights.items():
        for part in parts:
            candidate = name.replace(f".{part}.", f".{fused}.")
            if candidate != name and candidate in engine_params:
                return candidate, len(parts)
    return name, 1


def check_names(bundle: WeightBundle, engine_params: set[str], fused_weights: FusedWeights) -> None:
    """Refuse a bundle that would leave any engine weight, or part of a fused one (`engine_name`), at the old
    version."""
    filled: dict[str, set[str]] = {}
    needed: dict[str, int] = {}
    for name in bundle.names:
        target, parts = engine_name(name, engine_params, fused_weights)
        filled.setdefault(target, set()).add(name)
        needed[target] = parts
    missing = sorted(engine_params - filled.keys())
    unexpected = sorted(filled.keys() - engine_params)
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
