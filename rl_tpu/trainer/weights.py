"""A rank's weights leaving the trainer: gathered bucket by bucket in the served dtype, for a weight bundle or a
Hugging Face folder written as `save_pretrained` writes it. No process holds more than one bucket beyond its shard."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rl_tpu.models.hf import copy_model_files, hf_name
from rl_tpu.sync.bundle import assign_senders, named_checksum, plan_buckets
from rl_tpu.trainer import lora

Served = torch.nn.Parameter | lora.MergedWeight  # a weight as it leaves the trainer: a parameter, or a merge


def served_params(model: torch.nn.Module, lora_sync: str | None = None) -> dict[str, Served]:
    """What a sync sends, by served name: every parameter, a tied head once (under the embedding's name: the
    engines fill the head from it); for a LoRA policy the adapter alone (`adapter`) or every base weight with the
    adapter merged in (`merged`)."""
    if lora_sync == "adapter":
        return lora.adapter_params(model)
    if lora_sync == "merged":
        return lora.merged_params(model)
    return {hf_name(name): param for name, param in model.named_parameters()}


def gathered(served: Served) -> torch.Tensor:
    """The full tensor of a served weight (collective: an all-gather of the shards of each parameter in it)."""

    def full(param: torch.Tensor) -> torch.Tensor:
        param = param.detach()
        return param.full_tensor() if isinstance(param, DTensor) else param

    return served.merge(full) if isinstance(served, lora.MergedWeight) else full(served)


def served_buckets(
    params: dict[str, Served],
    dtype: torch.dtype,
    bucket_mb: float,
    rank: int,
    senders: int = 1,
    device: torch.device = torch.device("cpu"),
) -> Iterator[dict[str, torch.Tensor] | None]:
    """The served weights bucket by bucket, on `device` (the host, or the trainer's device for a transport that
    keeps them there), in the dtype the sampler serves (`model.dtype`).

    Collective: every rank iterates, gathering one bucket's parameters from their shards at a
    time, so no process holds more than one bucket beyond its shard. Bucket i goes to rank
    `assign_senders(...)[i]` among the first `senders` ranks; the others get None for it.
    bf16 halves what a sync moves; the engine would round the fp32 master weights to its dtype
    on load anyway, so rounding here gives it the same values.
    """
    sizes = {name: math.prod(served.shape) * dtype.itemsize for name, served in params.items()}
    plan = plan_buckets(sizes, int(bucket_mb * 2**20))
    owners = assign_senders([sum(sizes[name] for name in names) for names in plan], senders)
    for names, owner in zip(plan, owners):
        bucket = {}
        for name in names:
            full = gathered(params[name])
            if rank == owner:
                bucket[name] = full.to(device, dtype)
        yield bucket if rank == owner else None


def served_specs(params: dict[str, Served], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of what `served_buckets` yields, as meta tensors, in the same order."""
    return {name: torch.empty(served.shape, dtype=dtype, device="meta") for name, served in params.items()}


def base_checksum(model: torch.nn.Module, dtype: torch.dtype, rank: int) -> str:
    """The checksum of a LoRA policy's frozen base in the served dtype, by name (`sync.bundle.named_checksum`):
    what the engines compare with the base they serve. Collective: rank 0 hashes, every rank gets the checksum."""
    params = lora.base_params(model)
    tensors = ((name, gathered(params[name]).to("cpu", dtype)) for name in sorted(params))
    if rank == 0:
        digest = [named_checksum(tensors)]
    else:
        digest = [None]
        for _ in tensors:  # the gathers are collective: every rank takes part
            pass
    if dist.is_initialized():
        dist.broadcast_object_list(digest, src=0)
    return digest[0]


def export_hf_folder(
    buckets: Iterator[dict[str, torch.Tensor] | None], model_path: str, folder: str, rank: int, dtype_name: str
) -> str | None:
    """Write a Hugging Face folder (config, tokenizer, sharded safetensors in `dtype_name`) atomically.

    Streamed like a weight sync: the ranks gather one bucket (`sync.bucket_mb`) at a time and rank 0
    writes it as one shard, so no process holds the full weights; the shards are named and indexed
    as `save_pretrained` names them. Collective: every rank iterates `buckets`; rank 0 writes.
    """
    from safetensors.torch import save_file

    final = Path(folder)
    tmp = final.with_name(final.name + ".partial")
    config = json.loads((Path(model_path) / "config.json").read_text())
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        copy_model_files(model_path, tmp)
    shards: list[tuple[list[str], int]] = []  # (names, bytes) of each shard written
    for bucket in buckets:
        if config.get("tie_word_embeddings") and bucket:
            bucket.pop("lm_head.weight", None)  # the embedding under its other name: stored once
        if bucket:  # rank 0's; the other ranks only took part in the gathers
            save_file(bucket, str(tmp / f"shard-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shards.append((list(bucket), sum(t.nbytes for t in bucket.values())))
    if rank != 0:
        return None
    name_shards(tmp, shards)
    config["dtype"] = dtype_name  # what the shards hold
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return str(final)


def name_shards(folder: Path, shards: list[tuple[list[str], int]]) -> None:
    """Rename `shard-i.safetensors` as `save_pretrained` names its files: `model.safetensors` when there
    is one, else `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`."""
    if len(shards) == 1:
        os.replace(folder / "shard-0.safetensors", folder / "model.safetensors")
        return
    weight_map = {}
    for i, (names, _) in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(folder / f"shard-{i}.safetensors", folder / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(size for _, size in shards)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_adapter_folder(
    params: dict[str, torch.nn.Parameter], config: dict, model_path: str, folder: str, rank: int
) -> str | None:
    """Write a LoRA policy's adapter as a PEFT folder, in fp32 (its master weights), atomically; the adapter is
    megabytes, so it is gathered whole. Collective: every rank gathers; rank 0 writes."""
    tensors = {name: gathered(param).to("cpu", torch.float32) for name, param in params.items()}
    if rank != 0:
        return None
    final = Path(folder)
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    lora.write_adapter_folder(tensors, config, model_path, tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return str(final)
