"""The `sampler` section: how the vLLM engines sample rollouts, and how many engines there are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SamplerConfig:
    n: int = 8  # completions per prompt (the GRPO group)
    temperature: float = 1.0  # sampling temperature; the trainer's logprobs use the same
    top_p: float = 1.0  # < 1, and top_k > 0: evaluation-only runs (trainer.total_steps=0), refused when training:
    top_k: int = -1  # the engine samples, and reports logprobs, renormalised over kept tokens; the trainer does not
    response_length: int = 16  # max new tokens
    # the engine's KV cache; None: 1 GiB on CPU, and on an accelerator what gpu_memory_utilization leaves
    kv_cache_gb: Optional[float] = None
    # the share of an accelerator's memory the engine may take; None: 0.85 on a device of its own, 0.4 colocated
    gpu_memory_utilization: Optional[float] = None
    # true: the engine runs eagerly (start-up in seconds); false: vLLM torch.compiles the model and, on GPUs,
    # captures CUDA graphs: a start-up longer by tens of seconds, for faster decoding where the model's own
    # compute dominates (on CPU it gained 0-25%: benchmarks/README.md); None: eager on CPU, compiled elsewhere
    enforce_eager: Optional[bool] = None
    seed: int = 0  # each prompt's draws at each step are seeded from this, the step and the prompt's index
    num_cpus: float = 1.0  # CPUs reserved for each engine
    threads: Optional[int] = None  # each engine's torch / OpenMP threads; None: num_cpus, rounded (at least 1)
    num_engines: int = 1  # vLLM engines (Ray actors); each receives every weight version and a share of each batch
    # each engine's devices, vLLM's tensor parallelism (verl: tensor_model_parallel_size); on CPU, its threads split
    tensor_parallel_size: int = 1
    # place engines only on Ray nodes with these labels (`ray start --labels=role=sampler`); {}: anywhere
    node_labels: dict[str, str] = field(default_factory=dict)
    # a lost engine is restarted by Ray this many times, given the served weights, and its prompts are generated
    # again (object_store and shm_file transports; with collective the whole run restarts, trainer.max_restarts)
    max_restarts: int = 2

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"sampler.temperature={self.temperature} must be > 0 for training rollouts")
        if self.max_restarts < 0 or self.tensor_parallel_size < 1:
            raise ValueError(
                f"sampler.max_restarts={self.max_restarts} must be >= 0 (0: no restarts) and "
                f"sampler.tensor_parallel_size={self.tensor_parallel_size} >= 1"
            )
