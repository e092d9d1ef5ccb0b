"""A rank's training state in a checkpoint: sharded model, optimizer and schedule through torch.distributed.checkpoint,
reloadable at any world size, with the model's non-weight files so that a checkpoint alone can be exported."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rl_tpu.models.hf import MODEL_FILES, copy_model_files
from rl_tpu.models.safe_checkpoint import load_state


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict()}


def save_checkpoint(
    folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, model_path: str, rank: int
) -> None:
    """Written to `folder.partial` and renamed by rank 0 once every rank has finished, so a crash
    mid-save never leaves something that looks like a complete checkpoint. Collective."""
    final = Path(folder)
    tmp = final.with_name(final.name + ".partial")
    dcp.save(_state(model, optimizer, scheduler), checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        copy_model_files(model_path, tmp / MODEL_FILES)  # so that the checkpoint alone can be exported
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()


def load_checkpoint(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Read as data (`safe_checkpoint`): a checkpoint that would run code is refused before any of it runs."""
    state = _state(model, optimizer, scheduler)
    load_state(state, folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
