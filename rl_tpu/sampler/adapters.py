"""A LoRA policy in the engine: vLLM serves its base plus the adapter of the newest version, loaded from an adapter
bundle's tensors (no files), under an id and a name of that version's own.

vLLM keys its adapter cache by id and its prefix cache by name, so a new adapter under an old id or name would be
ignored or meet stale cached prefixes: each version gets its own. The versions of the staleness window stay loaded
(the trainer's `max_staleness + 1`), the rest are removed; the engine's slots hold one more, so that a new adapter
is loaded and checked before an old one goes. Every request carries the adapter once one is installed: vLLM's CPU
kernels mis-serve batches that mix base and adapter requests (vLLM PRs #48421, #49656).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_tpu.models.hf import stored_weights
from rl_tpu.records import WeightBundle
from rl_tpu.sampler.cpu_lora import use_one_matmul_per_adapter
from rl_tpu.sync.bundle import check_adapter, check_kind, named_checksum


@dataclass(frozen=True)
class AdapterServing:
    """How an engine is set up to serve LoRA adapters."""

    max_rank: int  # a rank vLLM accepts (rl_tpu.config.lora.VLLM_LORA_RANKS), at least the adapter's
    keep_versions: int  # adapters kept loaded: the staleness window

    def engine_args(self) -> dict:
        slots = self.keep_versions + 1  # load before unload
        # max_cpu_loras as large: vLLM's LRU cache evicts silently, and an adapter loaded from tensors cannot return
        return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots, "max_lora_rank": self.max_rank}


def lora_modules(worker) -> list[str]:
    """Run inside the vLLM worker: the Hugging Face module names the engine can adapt (q_proj, gate_proj, ...)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    return sorted({part for module in manager.supported_lora_modules for part in packed.get(module, [module])})


def load_adapter(worker, adapter_id: int, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Run inside the vLLM worker: build an adapter from tensors (what vLLM's own loader does after reading a
    folder) and make it servable under `adapter_id`. Private vLLM API (checked on vLLM 0.32)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    worker_manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings})
    helper.validate_legal(worker_manager.lora_config)  # rank, DoRA, bias: what vLLM cannot serve is refused here
    adapter = LoRAModel.from_lora_tensors(
        adapter_id,
        tensors,
        helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
    )
    manager = worker_manager._adapter_manager
    manager.remove_adapter(adapter_id)
    manager.add_adapter(adapter)


def remove_adapter(worker, adapter_id: int) -> None:
    """Run inside the vLLM worker."""
    worker.model_runner.lora_manager._adapter_manager.remove_adapter(adapter_id)


def loaded_adapters(worker) -> list[int]:
    """Run inside the vLLM worker: the ids of the adapters the engine holds."""
    return sorted(worker.model_runner.lora_manager.list_adapters())


class ServedAdapters:
    """The adapters an engine holds, the one it serves, and the checksum of the base they apply to."""

    def __init__(self, llm, serving: AdapterServing, model_path: str, dtype: torch.dtype):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # every token uses the same adapter: one matmul, not a per-token gather
            use_one_matmul_per_adapter()
        self.llm, self.serving = llm, serving
        # computed from the weights the engine loaded (its own copy of the model folder): vLLM's CPU build packs
        # its weights for its kernels and cannot give them back
        self.base_checksum = named_checksum(stored_weights(model_path, dtype))
        self.lora_modules = set(llm.collective_rpc(lora_modules)[0])
        self.modules: set[str] | None = None  # the first adapter's modules: every later one fills the same
        self.versions: list[int] = []  # loaded, oldest first
        self.request = None  # the LoRARequest of the newest version; None: the base alone (version 0)

    def check(self, bundle: WeightBundle) -> None:
        """Refuse an adapter that does not fit (before the install waits for the engine)."""
        check_kind(bundle, serves_adapters=True)
        self.modules = check_adapter(bundle, self.base_checksum, self.lora_modules, self.modules)

    def install(self, bundle: WeightBundle, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load the checked adapter as its version's, serve it, and drop versions older than the window."""
        from vllm.lora.request import LoRARequest

        version = bundle.version
        # the received views are read-only and share the bundle's buffers: the adapter keeps copies of its own
        named = {name: tensor.clone() for name, tensor in tensors}
        self.llm.collective_rpc(load_adapter, args=(version, named, bundle.adapter))
        self.versions.append(version)
        # a name of its own: no prefix cached under another version's name is reused
        self.request = LoRARequest(f"policy-v{version}", version, f"rl_tpu://policy/v{version}")
        while len(self.versions) > self.serving.keep_versions:
            self.llm.collective_rpc(remove_adapter, args=(self.versions.pop(0),))

    def report(self) -> dict[str, float]:
        """What vLLM itself lists (an adapter that never reached it would leave the base served unnoticed)."""
        return {"sampler/adapters_loaded": float(len(self.llm.collective_rpc(loaded_adapters)[0]))}
