"""What the memory plan needs of a decoder, read from its config.json and its weight files' headers (nothing is
loaded): its parameter count and sizes, the largest pieces the trainer handles whole, what a block keeps for its
backward and what LoRA adapts. A family's record (`families.py`) names the formula that reads them."""

from __future__ import annotations

from dataclasses import dataclass

from rl_tpu.config.lora import LoraConfig


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
    # {a linear layer LoRA may target, by its module name: its inputs + outputs}, per block
    projections: dict[str, int]
    # what a block keeps for its backward per token: hidden-sized tensors, MLP-sized ones (compute dtype)
    saved_hidden: int = 13
    saved_intermediate: int = 4

    @classmethod
    def from_config(cls, config: dict, parameters: int) -> ModelShape:
        """A Llama/Qwen-style decoder's: q/k/v/o attention with grouped KV heads and a gated MLP (gate, up, down).

        Its block keeps for its backward about 13 hidden-sized tensors per token (the norms' inputs and outputs,
        q/k/v after RoPE and GQA's repeat, the attention output, the projections' inputs, the residual sums) and 4
        MLP-sized ones (gate, up, the activation, their product)."""
        heads = config["num_attention_heads"]
        h, i = config["hidden_size"], config["intermediate_size"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or h // heads
        q, kv = heads * head_dim, kv_heads * head_dim
        projections = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
        projections |= {"gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        return cls(
            parameters,
            h,
            config["num_hidden_layers"],
            i,
            heads,
            kv_heads,
            head_dim,
            config["vocab_size"],
            bool(config.get("tie_word_embeddings")),  # as models.hf reads it
            projections,
        )

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

    def block_saved_bytes(self, dtype_size: int) -> int:
        """What one block keeps for its backward per token, in a compute dtype of `dtype_size` bytes."""
        return dtype_size * (self.saved_hidden * self.hidden + self.saved_intermediate * self.intermediate)

    def adapter_parameters(self, lora: LoraConfig) -> int:
        """LoRA's A and B over the targeted projections of every block: rank x (inputs + outputs) each."""
        sides = self.projections
        targets = sides if lora.target_modules == "all-linear" else set(lora.target_modules)
        kept = [name for name in sides if name in targets and name not in (lora.exclude_modules or ())]
        return lora.lora_rank * self.layers * sum(sides[name] for name in kept)
