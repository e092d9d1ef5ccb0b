"""What an engine serves, and how a verified bundle replaces it: full weights reloaded in place (`FullWeights`), or
a LoRA policy's adapter of each version on a base that never changes (`adapters.ServedAdapters`). Both check a
bundle before the install waits for the engine, and install it while the engine is theirs."""

from __future__ import annotations

import torch

from rl_tpu.records import WeightBundle
from rl_tpu.sampler.adapters import AdapterServing, ServedAdapters
from rl_tpu.sync.bundle import check_kind, check_names


def engine_parameter_names(worker) -> list[str]:
    """Run inside the vLLM worker: the names of the model's parameters as the engine stores them."""
    return [name for name, _ in worker.model_runner.model.named_parameters()]


class FullWeights:
    """Every weight of the model, replaced by each bundle."""

    request = None  # the weights in place serve every request

    def __init__(self, llm):
        self.llm = llm
        # what the engine holds (fused names included): every install must fill all of it
        self.engine_params = set(llm.collective_rpc(engine_parameter_names)[0])
        if getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False):
            # vLLM's CPU backend repacks the head into storage of its own: a new embedding alone would leave it stale
            self.engine_params.add("lm_head.weight")

    def check(self, bundle: WeightBundle) -> None:
        check_kind(bundle, serves_adapters=False)
        check_names(bundle, self.engine_params)

    def install(self, bundle: WeightBundle, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def report(self) -> dict[str, float]:
        return {}


def served_weights(
    llm, adapters: AdapterServing | None, model_path: str, dtype: torch.dtype
) -> FullWeights | ServedAdapters:
    return FullWeights(llm) if adapters is None else ServedAdapters(llm, adapters, model_path, dtype)
