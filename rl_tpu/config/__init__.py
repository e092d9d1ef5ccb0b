"""The config schema: plain dataclasses registered in Hydra's ConfigStore, one module per section group.

Hydra validates every override against these types at start-up, so a typo such as
``algorithm.lrr=1`` or ``device=gpu`` fails before any actor starts, naming the key and
(for enums) the allowed values. Key names follow verl's where verl has one. Every section's class is importable
from here (``from rl_tpu.config import TrainerConfig``). To add a section: a dataclass in a module of this package
(`rl-tpu --help` reads every module's field comments), a field of `RunConfig`, its checks in `__post_init__` (and
the section in `RunConfig.check`), its public names in `__all__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rl_tpu.config.actor import ActorConfig, PolicyLossConfig, RolloutCorrectionConfig
from rl_tpu.config.algorithm import AlgorithmConfig, FilterGroupsConfig, KLControlConfig, OutcomesConfig
from rl_tpu.config.choices import (
    DeviceKind,
    DType,
    Layout,
    LossAggMode,
    OldLogprobSource,
    OutcomePolicy,
    PinCores,
    ResumeMode,
    RolloutIS,
    Tracker,
)
from rl_tpu.config.data import DataConfig
from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.config.infra import CanaryConfig, ExportConfig, RayConfig, SyncConfig
from rl_tpu.config.lora import LoraConfig
from rl_tpu.config.model import ModelConfig
from rl_tpu.config.reasoning_gym import ReasoningGymConfig
from rl_tpu.config.reward import CustomRewardConfig, RewardConfig
from rl_tpu.config.sampler import SamplerConfig
from rl_tpu.config.tiny import TinyModelConfig
from rl_tpu.config.trainer import TrainerConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CanaryConfig",
    "CustomRewardConfig",
    "DType",
    "DataConfig",
    "DeviceKind",
    "EpisodeConfig",
    "ExportConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "Layout",
    "LoraConfig",
    "LossAggMode",
    "ModelConfig",
    "OldLogprobSource",
    "OutcomePolicy",
    "OutcomesConfig",
    "PinCores",
    "PolicyLossConfig",
    "RayConfig",
    "ReasoningGymConfig",
    "ResumeMode",
    "RewardConfig",
    "RolloutCorrectionConfig",
    "RolloutIS",
    "RunConfig",
    "SamplerConfig",
    "SyncConfig",
    "TinyModelConfig",
    "Tracker",
    "TrainerConfig",
    "cache_path",
    "register_configs",
]


@dataclass
class RunConfig:
    device: DeviceKind = DeviceKind.auto  # auto: what the Ray cluster has (GPU, then TPU), else the CPU
    placement: Layout = Layout.auto  # where trainer ranks and engines run (rl_tpu/cluster/placement.py)
    pin_cores: PinCores = PinCores.auto  # CPU: each actor's threads on cores of their own (rl_tpu/cluster/cores.py)
    seed: int = 0  # the trainer's torch seed; data order, sampling and the tiny model have seeds of their own
    cache_dir: Optional[str] = None  # built models and datasets; default ~/.cache/rl_tpu
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # verl's key for reward.custom, accepted so verl command lines work unchanged
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def check(self) -> None:
        """Every section's own checks again (they run when a section is made; a program may have changed it)."""
        for section in (
            self.data,
            self.sampler,
            self.episode,
            self.actor,
            self.algorithm.outcomes,
            self.trainer,
            self.reward,
            self.sync.canary,
        ):
            section.__post_init__()

    @property
    def lora_sync(self) -> str | None:
        """What a LoRA policy's weight sync sends (None: no LoRA): `actor.lora.sync`, where auto is the adapter
        except on TPU, whose engine plugin was not tried with adapters (merged weights there)."""
        lora = self.actor.lora
        if not lora.enabled:
            return None
        on_tpu = self.device == "tpu" or self.sync.transport == "tpu_sync"
        return lora.sync if lora.sync != "auto" else ("merged" if on_tpu else "adapter")

    @property
    def engine_eager(self) -> bool:
        """Whether the engines run eagerly: `sampler.enforce_eager`, by default on CPU only (with `device` resolved,
        as the actors' config has it): compiled with CUDA graphs on accelerators, where decoding gains most."""
        eager = self.sampler.enforce_eager
        return self.device == "cpu" if eager is None else eager

    @property
    def completion_tokens(self) -> int:
        """The most tokens after a prompt: one completion's, or an episode's turns and tool results."""
        e, turn = self.episode, self.sampler.response_length
        return (e.max_tokens or turn * e.max_turns) if e.enable else turn

    @property
    def completion_keys(self) -> str:
        """The keys that set `completion_tokens`, for the messages that ask to lower it."""
        if self.episode.enable:
            return "episode.max_tokens, or sampler.response_length x episode.max_turns"
        return "sampler.response_length"


def _required(key: str, what: str) -> None:
    raise ValueError(f"{key} is required by this recipe ({what}): add {key}=... to the command line")


def cache_path(cfg: RunConfig) -> Path:
    """Where built models and datasets go: `cache_dir`, by default ~/.cache/rl_tpu."""
    return Path(cfg.cache_dir or "~/.cache/rl_tpu").expanduser()


def register_configs() -> None:
    """The schema, and the `${required:KEY,WHAT}` resolver recipes use for settings only the user can give."""
    ConfigStore.instance().store(name="rl_tpu_schema", node=RunConfig)
    OmegaConf.register_new_resolver("required", _required, replace=True)
