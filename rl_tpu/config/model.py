"""The `model` section: which model a run trains, and the dtype it trains and serves in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from rl_tpu.config.choices import DType
from rl_tpu.config.tiny import TinyModelConfig

if TYPE_CHECKING:  # torch is imported only where a dtype is asked for: `rl-tpu --help` stays quick
    import torch


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a Hugging Face causal-LM folder; when unset the tiny preset is built
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: DType = DType.float32  # parameter dtype in trainer and sampler; fp32 keeps logprob parity
    # bf16: keep the residual stream in fp32 in the trainer and the CPU engine (halves the logprob gap)
    fp32_residual: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        """The served and parameter dtype as a torch dtype."""
        import torch

        return getattr(torch, self.dtype)
