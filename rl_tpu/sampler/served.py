"""What an engine serves, and how a verified bundle replaces it: full weights reloaded in place (`FullWeights`), or
a LoRA policy's adapter of each version on a base that never changes (`adapters.ServedAdapters`). Both check a
bundle before the install waits for the engine, and install it while the engine is theirs."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

import torch

from rl_tpu.models.families import family_at
from rl_tpu.records import WeightBundle
from rl_tpu.sampler.adapters import AdapterServing, ServedAdapters
from rl_tpu.sync.bundle import FusedWeights, check_kind, check_names


def engine_parameter_names(worker) -> list[str]:
    """Run inside the vLLM worker: the names of the model's parameters as the engine stores them (shared ones once)."""
    return [name for name, _ in worker.model_runner.model.named_parameters()]


def tied_parameter_names(worker) -> dict[str, str]:
    """Run inside the vLLM worker: {a second name of a parameter: its first name} (a tied head: its embedding)."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in worker.model_runner.model.named_parameters(remove_duplicate=False):
        tied.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return tied


@contextlib.contextmanager
def staged_weights(tensors: list[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """The tensors as one safetensors file in a folder of its own in shared memory (the host's temp folder where
    there is none), removed after. Each is copied: safetensors refuses tensors that share storage (a tied head's
    alias, the views of one received bucket)."""
    from safetensors.torch import save_file

    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="rl_tpu_weights_", dir=root) as folder:
        save_file({name: tensor.cpu().clone() for name, tensor in tensors}, os.path.join(folder, "model.safetensors"))
        yield folder


class FullWeights:
    """Every weight of the model, replaced by each bundle."""

    request = None  # the weights in place serve every request

    def __init__(self, llm, fused_weights: FusedWeights):
        self.llm = llm
        self.fused_weights = fused_weights  # the model family's (`families.ModelFamily.fused_weights`)
        self.workers = llm.llm_engine.vllm_config.parallel_config.world_size  # tensor-parallel worker processes
        # what the engine holds (fused names included, a tied head once): every install must fill all of it
        self.engine_params = set(llm.collective_rpc(engine_parameter_names)[0])
        # {a tied weight's source: its second name}: a bundle holds a tied head once, as the embedding
        self.aliases = {source: alias for alias, source in llm.collective_rpc(tied_parameter_names)[0].items()}

    def check(self, bundle: WeightBundle) -> None:
        check_kind(bundle, serves_adapters=False)
        check_names(bundle, self.engine_params, self.fused_weights)

    def install(self, bundle: WeightBundle, tensors: list[tuple[str, torch.Tensor]]) -> None:
        # a tied head loaded under its own name too: vLLM's CPU backend packs the head into storage of its own at
        # load, which the embedding's new values alone would leave stale (on CUDA it shares them: loaded twice)
        aliased = [(self.aliases[name], tensor) for name, tensor in tensors if name in self.aliases]
        if self.workers == 1:  # the worker is in this process: it reads the verified tensors where they lie
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors + aliased)})
        else:  # workers of their own (tensor parallelism): each reads the whole of one file and loads its shard
            with staged_weights(tensors + aliased) as folder:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def report(self) -> dict[str, float]:
        return {}


def served_weights(
    llm, adapters: AdapterServing | None, model_path: str, dtype: torch.dtype
) -> FullWeights | ServedAdapters:
    if adapters is None:
        return FullWeights(llm, family_at(model_path).fused_weights)
    return ServedAdapters(llm, adapters, model_path, dtype)
