"""What the memory plan needs of a decoder, read from its config.json and its weight files' headers (nothing is
loaded): its parameter count and sizes, and the largest pieces the trainer handles whole."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rl_tpu.config.lora import LoraConfig
from rl_tpu.models.hf import bundle_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a decoder: its parameter count (weight files' headers) and its config's sizes."""

    parameters: int  # every weight, a tied head once
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict, parameters: int) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(
            parameters,
            config["hidden_size"],
            config["num_hidden_layers"],
            config["intermediate_size"],
            heads,
            config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads,
            config["vocab_size"],
            bool(config.get("tie_word_embeddings")),  # as models.hf reads it
        )

    @classmethod
    def of(cls, model_path: str | Path) -> ModelShape:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return cls.from_config(config, bundle_bytes(model_path, torch.float32) // 4)

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def largest_unit(self) -> int:
        """FSDP's largest unit: the root (embedding, an untied head, the final norm) or a decoder block."""
        root = self.embedding * (1 if self.tied else 2) + self.hidden
        return max(root, (self.parameters - root) // self.layers)

    @property
    def largest_weight(self) -> int:
        return max(self.embedding, self.hidden * self.intermediate)

    def adapter_parameters(self, lora: LoraConfig) -> int:
        """LoRA's A and B over the targeted projections of every block: rank x (inputs + outputs) each."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        sides = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
        sides |= {"gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        targets = sides if lora.target_modules == "all-linear" else set(lora.target_modules)
        kept = [name for name in sides if name in targets and name not in (lora.exclude_modules or ())]
        return lora.lora_rank * self.layers * sum(sides[name] for name in kept)
