"""Model families as records: what rl_tpu assumes of a decoder beyond what transformers and vLLM load, one record per
family, found by config.json's `model_type`. A model whose family has no record is refused before Ray starts.

A record says where the decoder blocks are (the units FSDP shards, checkpoints and compiles), the norms that read the
residual stream (replaced for `model.fp32_residual`), which weights the engine stores fused (the bundle's names are
mapped onto them at each install), and the formula that reads the memory plan's sizes from config.json.

To add one: a `ModelFamily` record in `FAMILIES` below, checked by tests/unit/test_families.py
(docs/extending.md#a-model-family).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from rl_tpu.models.hf import bundle_bytes
from rl_tpu.models.shape import ModelShape

# vLLM's fused attention and MLP layers (`packed_modules_mapping` of its Llama/Qwen/Gemma classes):
# {engine weight: the Hugging Face weights it concatenates, in order}, relative to a block
QKV_GATE_UP = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family: its defaults are the Llama layout."""

    blocks: str = "model.layers"  # the decoder blocks (an nn.ModuleList), a dotted path from the causal LM
    final_norm: str = "model.norm"  # the norm after the last block, a dotted path from the causal LM
    block_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # in each block
    fused_weights: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(QKV_GATE_UP))
    shape: Callable[[dict, int], ModelShape] = ModelShape.from_config  # (config.json, parameter count) -> sizes

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        layers = _attribute(model, self.blocks)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(model).__name__}: expected decoder blocks at model.{self.blocks}")
        return layers

    def residual_norms(self, model: nn.Module) -> list[tuple[nn.Module, str]]:
        """(owner, attribute) of every norm that reads the residual stream: each block's, then the final one."""
        owner, _, name = self.final_norm.rpartition(".")
        blocks = [(layer, norm) for layer in self.decoder_layers(model) for norm in self.block_norms]
        return [*blocks, (_attribute(model, owner), name)]


LLAMA = ModelFamily()
# {config.json's `model_type`: its family's record}: Mistral, Qwen2/2.5/3 and Gemma share Llama's layout (Gemma's
# norms are not Llama's RMSNorm: `model.fp32_residual` refuses it)
FAMILIES: dict[str, ModelFamily] = dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "gemma"), LLAMA)


def _attribute(model: nn.Module, path: str) -> object:
    for part in filter(None, path.split(".")):
        model = getattr(model, part, None)
    return model


def family_named(model_type: str | None, where: str) -> ModelFamily:
    """The record of `model_type`; refused, naming what a record must say, when there is none."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    known = sorted(FAMILIES)
    raise TypeError(
        f"{where}: model_type {model_type!r} has no family record (rl_tpu knows {', '.join(known)}); a record in "
        "rl_tpu/models/families.py names its decoder blocks, their norms, the weights the engine fuses and its "
        "sizes for the memory plan (docs/extending.md#a-model-family)"
    )


def family_of(model: nn.Module) -> ModelFamily:
    """The record of a built Hugging Face causal LM (PEFT's injected adapters keep its class and config)."""
    return family_named(getattr(getattr(model, "config", None), "model_type", None), type(model).__name__)


def family_at(model_path: str | Path) -> ModelFamily:
    return family_named(_config(model_path).get("model_type"), f"model.path={model_path}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a Hugging Face causal LM, where its family's record says they are."""
    return family_of(model).decoder_layers(model)


def model_shape(model_path: str | Path) -> ModelShape:
    """The memory plan's sizes of a model folder: its family's formula over config.json, and its parameter count
    from the weight files' headers (0 where the weights are not in safetensors files)."""
    return family_at(model_path).shape(_config(model_path), bundle_bytes(model_path, torch.float32) // 4)


def _config(model_path: str | Path) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())
