"""LoRA on the trainer's model, with PEFT: adapters injected before sharding, the base frozen in the served dtype.

PEFT's `inject_adapter_in_model` keeps the Hugging Face class and its `model.model.layers` path, so the model is
parallelised, checkpointed and run as a full one; its `lora_A`/`lora_B` parameters are the only trainable ones and
stay in fp32, while every base weight is stored in `model.dtype` (what the engine serves). The names the adapter
leaves the trainer under are PEFT's saved names (`base_model.model.<module>.lora_A.weight`), which vLLM and
`PeftModel.from_pretrained` read as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rl_tpu.config.lora import LoraConfig
from rl_tpu.models.hf import hf_name

ADAPTER = "default"  # PEFT's adapter name: the trainer holds one adapter
PEFT_PREFIX = "base_model.model."  # PEFT's saved tensor names start with this


def peft_config(lora: LoraConfig):
    """PEFT's `LoraConfig` for `actor.lora` (lists from Hydra made plain)."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return PeftLoraConfig(
        r=lora.lora_rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=targets,
        exclude_modules=list(lora.exclude_modules) if lora.exclude_modules else None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(model: nn.Module, lora: LoraConfig, base_dtype: torch.dtype) -> dict:
    """Inject the adapters into `model` (in place, on any device, meta included) and store its frozen base in
    `base_dtype`; returns the adapter's config as `adapter_config.json` holds it (the modules resolved)."""
    from peft import inject_adapter_in_model

    config = peft_config(lora)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        raise ValueError(f"actor.lora.target_modules={lora.target_modules!r}: {error}") from error
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(base_dtype)
    return adapter_config_dict(config)


def adapter_config_dict(config) -> dict:
    """`adapter_config.json`'s content, as PEFT's `save_pretrained` writes it (sets as sorted lists)."""
    plain = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.loads(json.dumps(plain, default=str))


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(name: str) -> str:
    """A trainer parameter's name as PEFT saves it: `base_model.model.<module>.lora_A.weight`."""
    return PEFT_PREFIX + hf_name(name).replace(f".{ADAPTER}.", ".")


def base_name(name: str) -> str:
    """A frozen base weight's Hugging Face name (the `.base_layer` of a wrapped module removed)."""
    return hf_name(name).replace(".base_layer.", ".")


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapter's parameters under their PEFT names, in the model's order."""
    return {adapter_name(n): p for n, p in model.named_parameters() if p.requires_grad and is_adapter_weight(n)}


def base_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The frozen base's parameters under their Hugging Face names (a tied head once, as the files hold it)."""
    return {base_name(n): p for n, p in model.named_parameters() if not is_adapter_weight(n)}


@dataclass(frozen=True)
class MergedWeight:
    """A targeted module's weight as served with the adapter merged in: W + scale * B @ A."""

    weight: nn.Parameter
    lora_a: nn.Parameter
    lora_b: nn.Parameter
    scale: float

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def merge(self, full) -> torch.Tensor:
        """`full` gathers a parameter from its shards (collective); the sum is made in fp32."""
        return full(self.weight).float() + self.scale * (full(self.lora_b).float() @ full(self.lora_a).float())


def merged_params(model: nn.Module) -> dict[str, nn.Parameter | MergedWeight]:
    """Every served weight under its Hugging Face name, the adapted ones as `MergedWeight`s (a tied head once)."""
    from peft.tuners.lora import LoraLayer

    merged = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            merged[f"{base_name(module_name)}.weight"] = MergedWeight(
                module.base_layer.weight,
                module.lora_A[ADAPTER].weight,
                module.lora_B[ADAPTER].weight,
                float(module.scaling[ADAPTER]),
            )
    served = {}
    for name, param in model.named_parameters():
        if not is_adapter_weight(name):
            served[base_name(name)] = merged.get(base_name(name), param)
    return served


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model alone (the reference policy of a LoRA run): every adapter bypassed while inside."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def base_model_name(model_path: str) -> str:
    """The base as `adapter_config.json` names it: its Hub name when the folder is a Hub download
    (`.../models--ORG--NAME/snapshots/REV`), else the folder's name. Never the local path: an exported adapter is
    pushed to the Hub as it is, and would publish the trainer's file system (its user name, its layout)."""
    path = Path(model_path).expanduser().absolute()
    hub = [part for part in path.parts if part.startswith("models--")]
    return hub[-1].removeprefix("models--").replace("--", "/") if hub else path.name


def write_adapter_folder(tensors: dict[str, torch.Tensor], config: dict, model_path: str, folder: Path) -> None:
    """A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`): what `PeftModel.from_pretrained`
    and vLLM's `LoRARequest` load (given the base: it is named, not located). Written directly: PEFT's
    `save_pretrained` cannot read a sharded model."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": base_model_name(model_path)}, indent=2)
    )
