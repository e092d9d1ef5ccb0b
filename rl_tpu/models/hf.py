"""Hugging Face model folders and names: parameter names without wrappers, the weight files, the non-weight files."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

MODEL_FILES = "hf"  # in each checkpoint folder: the model folder without its weights
LORA_BASE_FILE = "lora_base.json"  # in a LoRA checkpoint: the checksum of the frozen base its adapter applies to
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


def weight_files(model_path: str | Path) -> dict[str, Path]:
    """{weight name: the safetensors file holding it} of a model folder, a tied head once (as the embedding)."""
    from safetensors import safe_open

    files = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    config = json.loads((Path(model_path) / "config.json").read_text())
    if config.get("tie_word_embeddings") and "model.embed_tokens.weight" in files:
        files.pop("lm_head.weight", None)
    return files


def bundle_bytes(model_path: str | Path, dtype: torch.dtype) -> int:
    """The bytes of a full weight bundle of this model in `dtype` (read from the files' headers, nothing loaded)."""
    from safetensors import safe_open

    elements = 0
    for name, file in weight_files(model_path).items():
        with safe_open(str(file), "pt") as f:
            elements += math.prod(f.get_slice(name).get_shape())
    return elements * dtype.itemsize


def stored_weights(model_path: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """A model folder's weights in name order, one at a time, cast to `dtype` (a tied head once, as stored)."""
    from safetensors import safe_open

    files = weight_files(model_path)
    for name in sorted(files):
        with safe_open(str(files[name]), "pt") as f:
            yield name, f.get_tensor(name).to(dtype)
