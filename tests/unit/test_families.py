"""Model families as records (rl_tpu/models/families.py): a family without one is refused before Ray starts, a family
added from outside rl_tpu is taken by the checks, the memory plan and the bundle's names, and every record matches
the module tree transformers builds and the weights vLLM fuses."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import compose_run

from rl_tpu.config import RunConfig
from rl_tpu.controller import memory_plan
from rl_tpu.controller.run import check_inputs
from rl_tpu.data.datasets import Example
from rl_tpu.models.families import FAMILIES, ModelFamily, family_at, model_shape
from rl_tpu.models.resolve import check_decoder
from rl_tpu.models.shape import ModelShape
from rl_tpu.records import Bucket, TensorSpec, WeightBundle
from rl_tpu.sampler.served import served_weights
from rl_tpu.sync.bundle import check_names

TINY = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
TINY |= {
    "intermediate_size": 32,
    "vocab_size": 64,
    "head_dim": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# the Hugging Face architecture vLLM serves for each model_type of a record
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
}


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**TINY)


def meta_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(model_type))


def saved_model(model_type: str, folder: Path) -> Path:
    """A tiny model of this family with random weights, saved as Hugging Face saves it (nothing downloaded)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(folder)
    return folder


def phi3_shape(config: dict, parameters: int) -> ModelShape:
    """Phi-3's sizes: Llama's, but its checkpoint stores q/k/v and gate/up fused, which is what LoRA adapts."""
    llama = ModelShape.from_config(config, parameters)
    h, i, q, kv = llama.hidden, llama.intermediate, llama.heads * llama.head_dim, llama.kv_heads * llama.head_dim
    fused = {"qkv_proj": h + q + 2 * kv, "o_proj": q + h, "gate_up_proj": h + 2 * i, "down_proj": i + h}
    return dataclasses.replace(llama, projections=fused)


# the one record a new family adds: Phi-3's checkpoint already holds the weights vLLM fuses, under its names
PHI3 = ModelFamily(fused_weights={}, shape=phi3_shape)


def test_a_family_without_a_record_is_refused_before_ray_naming_what_a_record_says(tmp_path):
    """Mixtral has Llama's blocks and norms, but vLLM fuses its experts under names no record maps: without the
    record it is refused at the checks, not at the first weight sync after the engines started."""
    mixtral = tmp_path / "mixtral"
    tiny_config("mixtral").save_pretrained(mixtral)
    few = [Example([1], "src", "1", {})] * 4
    with pytest.raises(TypeError, match=r"model_type 'mixtral' has no family record .*the weights the engine fuses"):
        check_inputs(compose_run("data.train_batch_size=4"), mixtral, few)


def test_a_family_added_from_a_test_module_is_taken_by_the_checks_the_plan_and_the_bundle(
    tmp_path, monkeypatch, caplog
):
    folder = saved_model("phi3", tmp_path / "phi3")
    with pytest.raises(TypeError, match="model_type 'phi3' has no family record"):
        check_decoder(folder)
    monkeypatch.setitem(FAMILIES, "phi3", PHI3)  # all it takes

    check_decoder(folder, fp32_residual=True)  # its blocks, and its norms replaced for an fp32 residual stream
    shape = model_shape(folder)
    assert shape.parameters == sum(t.numel() for _, t in saved_model_named(folder)) and shape.hidden == 16
    cfg = RunConfig()
    cfg.device, cfg.actor.lora.lora_rank, cfg.actor.lora.lora_alpha = "cpu", 4, 8
    # LoRA over all linear layers adapts Phi-3's four fused projections, not Llama's seven
    assert shape.adapter_parameters(cfg.actor.lora) == 4 * 2 * ((16 + 16 + 16) + (16 + 16) + (16 + 64) + (32 + 16))
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        memory_plan.check(cfg, folder)
    assert "LoRA adapter, fp32" in caplog.text

    # the engine's side takes the record's fused names: here none, the bundle's names are the engine's
    names = [name for name, _ in saved_model_named(folder)]
    served = served_weights(FakeLLM(names), None, str(folder), torch.float32)
    assert served.fused_weights is PHI3.fused_weights
    served.check(bundle_of(names))
    check_names(bundle_of(names), set(names), family_at(folder).fused_weights)


def saved_model_named(folder: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(folder / "model.safetensors").items())


def bundle_of(names: list[str]) -> WeightBundle:
    specs = tuple(TensorSpec(name, "float32", (1,)) for name in names)
    return WeightBundle(1, "object_store", (Bucket(specs, "", None, 0),), 4 * len(names))


class FakeLLM:
    """What `FullWeights` asks of vLLM's LLM at its start: its parameters' names, and the tied ones."""

    def __init__(self, names: list[str]):
        self.names = names
        self.llm_engine = type("Engine", (), {"vllm_config": _parallel_config(1)})()

    def collective_rpc(self, method):
        return [self.names if method.__name__ == "engine_parameter_names" else {}]


def _parallel_config(world_size: int):
    parallel = type("Parallel", (), {"world_size": world_size})()
    return type("VllmConfig", (), {"parallel_config": parallel})()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_each_record_matches_the_model_transformers_builds(model_type):
    """Its blocks and residual norms are where it says (fp32-residual ready except Gemma's own RMSNorm)."""
    model, family = meta_model(model_type), FAMILIES[model_type]
    assert len(family.decoder_layers(model)) == TINY["num_hidden_layers"]
    norms = family.residual_norms(model)
    assert len(norms) == TINY["num_hidden_layers"] * len(family.block_norms) + 1
    assert all(isinstance(getattr(owner, name), torch.nn.Module) for owner, name in norms)
    shape = family.shape(json.loads(tiny_config(model_type).to_json_string()), 0)
    projections = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(shape.projections) == projections - {"lm_head"}


def test_each_record_fuses_what_vllm_fuses():
    """vLLM's model class for each record's family concatenates the weights the record names, in its order."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    for model_type, family in FAMILIES.items():
        module, name = _TEXT_GENERATION_MODELS[ARCHITECTURES[model_type]]
        engine = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
        record = {
            fused.rpartition(".")[2]: [part.rpartition(".")[2] for part in parts]
            for fused, parts in family.fused_weights.items()
        }
        assert record == engine.packed_modules_mapping, model_type
