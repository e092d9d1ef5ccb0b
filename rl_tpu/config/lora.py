"""The `actor.lora` section: LoRA adapters on a frozen base (rl_tpu/trainer/lora.py, PEFT). Key names follow
verl's `actor_rollout_ref.model.lora_*` keys and PEFT's `LoraConfig` fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# how a LoRA policy reaches the engines: the adapter alone (vLLM's LoRA support), or the base with the adapter
# merged in (a full bundle); auto: the adapter wherever the engine serves adapters
LORA_SYNCS = ("auto", "adapter", "merged")
# vLLM's LoRAConfig accepts these max_lora_rank values only (vllm/config/lora.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoraConfig:
    lora_rank: int = 0  # 0: full fine-tuning; else the adapters' rank (verl: model.lora_rank)
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank (verl: model.lora_alpha)
    lora_dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's key)
    # "all-linear" (every linear layer of the blocks), or module names such as [q_proj, v_proj] (verl's key)
    target_modules: Any = "all-linear"
    exclude_modules: Optional[list[str]] = None  # module names left without an adapter (verl's key)
    # what each sync sends: adapter (served by vLLM's LoRA support), merged (full weights), auto (adapter; TPU: merged)
    sync: str = "auto"
    export_merged: bool = False  # the run's export: the PEFT adapter, and with this the merged model as well

    def __post_init__(self) -> None:
        if not 0 <= self.lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"actor.lora.lora_rank={self.lora_rank} must be in [0, {VLLM_LORA_RANKS[-1]}] (0: off)")
        if self.lora_alpha <= 0 or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(
                f"actor.lora.lora_alpha={self.lora_alpha} must be > 0 and actor.lora.lora_dropout="
                f"{self.lora_dropout} in [0, 1)"
            )
        if self.sync not in LORA_SYNCS:
            raise ValueError(f"actor.lora.sync={self.sync!r}: allowed values are {', '.join(LORA_SYNCS)}")
        targets = self.target_modules
        if not (targets == "all-linear" or (isinstance(targets, (list, tuple)) and targets)):
            raise ValueError(
                f"actor.lora.target_modules={targets!r} must be all-linear or a non-empty list of module names"
            )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def engine_max_rank(self) -> int:
        """The smallest rank vLLM can be set up for that holds this adapter's."""
        return next(rank for rank in VLLM_LORA_RANKS if rank >= self.lora_rank)
