"""A rank's training state in a checkpoint: sharded model, optimizer and schedule through torch.distributed.checkpoint,
reloadable at any world size, with the model's non-weight files so that a checkpoint alone can be exported."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rl_tpu.models.hf import LORA_BASE_FILE, MODEL_FILES, copy_model_files, hf_name
from rl_tpu.models.safe_checkpoint import load_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, lora: bool) -> dict:
    """The training state; a LoRA policy's model state is its adapter (the trainable weights) alone."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(lora))
    if lora:  # DCP keeps a tied head although it is frozen: the state is the trainable weights only
        trainable = {hf_name(name) for name, param in model.named_parameters() if param.requires_grad}
        model_state = {key: value for key, value in model_state.items() if key in trainable}
    return {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}


def _options(lora: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def save_checkpoint(
    folder: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    model_path: str,
    rank: int,
    base_checksum: str | None = None,
    extra_files: dict[str, str] | None = None,
) -> None:
    """Written to `folder.partial` and renamed by rank 0 once every rank has finished, so a crash
    mid-save never leaves something that looks like a complete checkpoint. Collective.

    `base_checksum`: a LoRA policy's (its model state is then the adapter alone). `extra_files`: {name: text}
    written into the checkpoint before the rename (the driver's part)."""
    final = Path(folder)
    tmp = final.with_name(final.name + ".partial")
    try:
        dcp.save(_state(model, optimizer, scheduler, base_checksum is not None), checkpoint_id=str(tmp))
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left for a resume or the disk to hold
        raise OSError(f"saving {final} failed ({describe_room(final.parent)}): {error}") from error
    dist.barrier()
    if rank == 0:
        copy_model_files(model_path, tmp / MODEL_FILES)  # so that the checkpoint alone can be exported
        if base_checksum is not None:
            (tmp / LORA_BASE_FILE).write_text(
                json.dumps({"base_checksum": base_checksum, "base_model": str(model_path)})
            )
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()


def describe_room(folder: Path) -> str:
    """The free space of `folder`'s filesystem, and whether it is full: what a failed save most often means."""
    free = shutil.disk_usage(folder).free
    full = "no space left on its filesystem" if free < 64 * 2**20 else "its filesystem has room"
    return f"{full}: {free / 2**20:.0f} MiB free at {folder}"


def load_checkpoint(
    folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, base_checksum: str | None = None
) -> None:
    """Read as data (`safe_checkpoint`): a checkpoint that would run code is refused before any of it runs.

    A LoRA checkpoint is refused unless it was written over the same base (`base_checksum`) as this run's."""
    check_lora_base(Path(folder), base_checksum)
    lora = base_checksum is not None
    state = _state(model, optimizer, scheduler, lora)
    load_state(state, folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(lora)
    )
    scheduler.load_state_dict(state["scheduler"])


def check_lora_base(folder: Path, base_checksum: str | None) -> None:
    """Refuse a checkpoint of the other kind (adapter or full weights), or an adapter trained over another base."""
    stored = json.loads((folder / LORA_BASE_FILE).read_text()) if (folder / LORA_BASE_FILE).is_file() else None
    if (stored is None) != (base_checksum is None):
        have, want = ("a LoRA adapter", "full weights") if stored else ("full weights", "a LoRA adapter")
        raise ValueError(f"{folder}: the checkpoint holds {have} and this run trains {want} (actor.lora.lora_rank)")
    if stored is not None and stored["base_checksum"] != base_checksum:
        raise ValueError(
            f"{folder}: the checkpoint's adapter was trained over base {stored['base_checksum'][:16]} "
            f"({stored['base_model']}), this run's base is {base_checksum[:16]}: resume with the same model.path"
        )
