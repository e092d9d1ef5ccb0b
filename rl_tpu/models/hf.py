"""Hugging Face model folders and names: parameter names without wrappers, the decoder blocks, the non-weight files."""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

MODEL_FILES = "hf"  # in each checkpoint folder: the model folder without its weights
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.index.json")


def copy_model_files(model_path: str | Path, folder: str | Path) -> None:
    """Everything of a Hugging Face model folder but its weights: config, tokenizer, generation config."""
    shutil.copytree(model_path, folder, ignore=shutil.ignore_patterns(*WEIGHT_FILES), dirs_exist_ok=True)


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, torch.compile


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name, without the wrappers the parallelisation added."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM (`model.model.layers` for Llama/Qwen-style models)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: expected decoder blocks at model.model.layers")
    return layers
