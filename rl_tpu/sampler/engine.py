"""The sampler: a vLLM engine in its own process (a Ray actor) that makes rollouts and serves a weight version.

vLLM runs in-process inside the actor (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): start-up is
seconds instead of tens of seconds and weights are installed by a direct call. That mode
pins threads and sets `LD_PRELOAD`, which is why it lives in its own process and never in
the trainer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch

from rl_tpu.cluster.actor_logs import actor_name, send_output_to_file
from rl_tpu.cluster.core_loan import EngineActivity
from rl_tpu.cluster.cores import CpuBinding
from rl_tpu.cluster.memory import peak_rss_mb
from rl_tpu.cluster.placement import require_model_on_node, where_am_i
from rl_tpu.episodes.build import EpisodeOptions, build_runner
from rl_tpu.models.precision import keep_vllm_residual_fp32
from rl_tpu.records import CanaryTokens, Rollout, WeightBundle, WeightSyncError
from rl_tpu.sampler.adapters import AdapterServing
from rl_tpu.sampler.episode_requests import EngineRequests
from rl_tpu.sampler.scoring import canary_params, continuation_logprobs, dense_rows, full_distribution_params
from rl_tpu.sampler.served import served_weights
from rl_tpu.sampler.turns import EngineTurns
from rl_tpu.sync.endpoints import unpack
from rl_tpu.sync.registry import DEFAULT_TRANSPORT, transport_class

if TYPE_CHECKING:
    from rl_tpu.episodes.loop import EpisodeRunner

# Set in the actor's environment before vLLM is imported.
SAMPLER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def sampler_env(enforce_eager: bool) -> dict[str, str]:
    """The variables the engine's process needs; `enforce_eager=False` lets vLLM torch.compile the model."""
    # an eager engine skips Dynamo altogether, and with it a 30 s compile of a logprobs helper on the first call
    return {**SAMPLER_ENV, **({"TORCHDYNAMO_DISABLE": "1"} if enforce_eager else {})}


CPU_KV_CACHE_GB = 1.0  # the engine's KV cache on CPU when sampler.kv_cache_gb is unset

# weight installs run on a thread of their own, beside the one that serves generations (see EngineTurns)
SAMPLER_CONCURRENCY = {"weights": 1}


@dataclass(frozen=True)
class SamplingSettings:
    n: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    logprobs: bool = True


@dataclass(frozen=True)
class EngineOptions:
    """How one engine of several is set up beside the model and sampling settings."""

    index: int = 0  # its place among the engines: its receiver rank in a collective weight broadcast
    log_dir: str | None = None  # its output goes to LOG_DIR/sampler_<index>.log
    sleep_mode: bool = False  # CUDA, colocated: release the device while the trainer trains
    gpu_memory_utilization: float | None = None  # None: vLLM's default
    enforce_eager: bool = True  # false: vLLM compiles the model (and captures CUDA graphs on GPUs): slower start
    fp32_residual: bool = False  # bf16 on CPU: the residual stream in fp32, as the trainer keeps it
    binding: CpuBinding = CpuBinding(threads=1)  # its threads, and its cores when pinned
    episodes: EpisodeOptions | None = None  # multi-turn episodes with tools; None: one completion per sample
    adapters: AdapterServing | None = None  # a LoRA policy served as base plus adapter; None: full weights
    transport: str = DEFAULT_TRANSPORT  # sync.transport: it may set vLLM's settings and attach to the engine
    tensor_parallel_size: int = 1  # its devices (on CPU: its threads split over that many worker processes)
    full_distributions: bool = False  # vLLM may return the whole vocabulary's logprobs (`rl_tpu.consistency`)


def sampling_params(
    settings: SamplingSettings,
    n: int,
    max_tokens: int,
    seed: int | None,
    stop: tuple[str, ...] = (),
    stop_token_ids: list[int] | None = None,
):
    """vLLM's sampling parameters for one prompt (or one episode's turn, with its stop strings and ids)."""
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_tokens=max_tokens,
        logprobs=0 if settings.logprobs else None,
        seed=seed,
        stop=list(stop) or None,
        stop_token_ids=stop_token_ids or None,
        # rollouts carry token ids; the grader decodes them (saves per-token work). Stop strings need the text.
        detokenize=bool(stop),
    )


def sampled_tokens(completion, settings: SamplingSettings) -> tuple[list[int], list[float]]:
    """A completion's token ids and each one's logprob (zeros when none were asked for)."""
    ids = list(completion.token_ids)
    if not settings.logprobs:
        return ids, [0.0] * len(ids)
    return ids, [step[token].logprob for step, token in zip(completion.logprobs, ids)]


def memory_args(kv_cache_gb: float | None, gpu_memory_utilization: float | None, on_cpu: bool) -> dict:
    """vLLM's memory arguments: the KV cache in bytes where `sampler.kv_cache_gb` is set (on CPU, 1 GiB when not:
    vLLM would otherwise claim most of the RAM), else the accelerator's share `gpu_memory_utilization` leaves."""
    if kv_cache_gb is None and on_cpu:
        kv_cache_gb = CPU_KV_CACHE_GB
    if kv_cache_gb is not None:
        return {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
    return {} if gpu_memory_utilization is None or on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}


def tensor_parallel_args(options: EngineOptions, on_cpu: bool, allowed: list[int]) -> dict[str, Any]:
    """vLLM's tensor parallelism over `options.tensor_parallel_size` worker processes (vLLM's own `mp` executor,
    inside this actor). On CPU each worker takes its share of the engine's threads: its own cores when the engine is
    pinned (vLLM's `VLLM_CPU_OMP_THREADS_BIND`, core lists split by `|`; its `auto` needs a NUMA node per worker),
    else an unbound pool of that size. The variables are set here, before the workers are spawned with them."""
    size = options.tensor_parallel_size
    if size == 1:
        return {}
    if on_cpu:
        threads = max(1, options.binding.threads // size)
        if options.binding.cores:
            cpus = sorted(options.binding.cpus(allowed))
            lists = [cpus[i * threads : (i + 1) * threads] for i in range(size)]
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, cores)) for cores in lists)
        else:
            os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)})
    return {"tensor_parallel_size": size, "distributed_executor_backend": "mp"}


def episode_runner(llm: Any, episodes: EpisodeOptions | None) -> EpisodeRunner | None:
    """The engine's episode runner (`episode.enable`), told whether vLLM computes on this host's CPU; else None."""
    if episodes is None:
        return None
    from vllm.platforms import current_platform

    model_type = llm.llm_engine.model_config.hf_config.model_type
    return build_runner(episodes, llm.get_tokenizer(), model_type, current_platform.is_cpu())


def engine_args(options: EngineOptions, kv_cache_gb: float | None, on_cpu: bool, allowed: list[int]) -> dict[str, Any]:
    """vLLM's settings that follow from the engine's options: memory, adapters, prefill, weight transfer, devices."""
    args = memory_args(kv_cache_gb, options.gpu_memory_utilization, on_cpu)
    args.update(tensor_parallel_args(options, on_cpu, allowed))
    if options.adapters is not None:
        args.update(options.adapters.engine_args())
    if on_cpu:
        # Per-prompt seeds (exact resume) fail on CPU when a prompt's prefill is split across steps:
        # vLLM then rewinds the request's generator, and CPU generators have no offset to rewind.
        args["enable_chunked_prefill"] = False
    args.update(transport_class(options.transport).engine_args())
    if options.full_distributions:
        args["max_logprobs"] = -1  # no cap: a prompt's logprobs over every token of the vocabulary
    return args


def start_vllm(
    model_path: str,
    dtype: str,
    max_model_len: int,
    kv_cache_gb: float | None,
    seed: int,
    options: EngineOptions,
    allowed: list[int],
):
    """vLLM's engine (`LLM`), in this process, set up from the engine's settings; `allowed`: the cores it may use."""
    from vllm import LLM
    from vllm.platforms import current_platform

    if options.fp32_residual and dtype != "float32" and current_platform.is_cpu():
        keep_vllm_residual_fp32()
    return LLM(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        logprobs_mode="processed_logprobs",  # after temperature: what the trainer computes
        enforce_eager=options.enforce_eager,
        enable_sleep_mode=options.sleep_mode,
        **engine_args(options, kv_cache_gb, current_platform.is_cpu(), allowed),
    )


class Sampler:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        max_model_len: int,
        kv_cache_gb: float | None,
        seed: int,
        options: EngineOptions = EngineOptions(),
    ):
        self.name = actor_name("sampler", options.index)
        send_output_to_file(options.log_dir, self.name)
        require_model_on_node(self.name, model_path)
        for key, value in sampler_env(options.enforce_eager).items():
            os.environ.setdefault(key, value)
        # before vLLM starts: its CPU worker binds nothing in-process, and disables torch.set_num_threads
        allowed = options.binding.apply(self.name)
        self.options = options
        self.llm = start_vllm(model_path, dtype, max_model_len, kv_cache_gb, seed, options, allowed)
        transport_class(options.transport).attach_engine(options.index, self.llm)
        self.version = 0
        self.turns = EngineTurns()
        self.activity = EngineActivity(options.binding.activity_folder, options.index)
        self.busy_s = 0.0  # seconds the engine spent generating and installing, since start
        self.served = served_weights(self.llm, options.adapters, model_path, getattr(torch, dtype))
        self.episodes = episode_runner(self.llm, options.episodes)

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seeds: list[int] | None = None,
        tools_kwargs: list[dict] | None = None,
        after: dict | None = None,
    ) -> list[Rollout]:
        """`settings.n` completions (or episodes, when the engine runs them) per prompt, in prompt order; `group`
        is the prompt's index.

        `seeds`, one per prompt, make each prompt's draws independent of the engine's state and of
        which engine serves it: a resumed run, a restarted engine or a different number of engines
        draws the same tokens. `tools_kwargs`, one per prompt, are verl's per-row tool arguments (episodes).
        The pool may send the call behind an install it has not waited for, passing that install's ObjectRef
        as the after argument, which Ray resolves to the install's report before the call runs.
        """
        seeds = seeds if seeds is not None else [None] * len(prompts)
        if self.episodes is not None:
            kwargs = tools_kwargs if tools_kwargs is not None else [{}] * len(prompts)
            return self._episodes(prompts, settings, seeds, kwargs)
        params = [sampling_params(settings, settings.n, settings.max_tokens, seed) for seed in seeds]
        outputs, version = self._generate(prompts, params)
        rollouts = []
        for group, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            for completion in output.outputs:
                ids, logprobs = sampled_tokens(completion, settings)
                rollouts.append(
                    Rollout(list(prompt), ids, logprobs, version, completion.finish_reason or "length", group)
                )
        return rollouts

    def _episodes(
        self, prompts: list[list[int]], settings: SamplingSettings, seeds: list, tools_kwargs: list[dict]
    ) -> list[Rollout]:
        """A batch of episodes, the whole batch one turn of the engine: one weight version serves every model turn
        (an install sent after the call waits for the batch), recorded per turn."""
        stop, stop_ids = self.options.episodes.stop, self.episodes.parser.stop_token_ids
        with self.activity, self.turns.generation():
            engine = EngineRequests(
                self.llm,
                lambda r: sampling_params(settings, 1, r.max_tokens, r.seed, stop, stop_ids),
                lambda completion: sampled_tokens(completion, settings),
                self.served.request,
                self.version,
            )
            try:
                return self.episodes.run(prompts, settings.n, seeds, tools_kwargs, engine)
            finally:
                engine.abort()
                self.busy_s += engine.busy_s

    def _generate(self, prompts: list[list[int]], params: list) -> tuple[list, int]:
        """vLLM's outputs, and the weight version that produced them."""
        from vllm.inputs import TokensPrompt

        with self.activity, self.turns.generation():
            start = time.perf_counter()
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                params,
                use_tqdm=False,
                lora_request=self.served.request,
            )
            self.busy_s += time.perf_counter() - start
            return outputs, self.version

    def next_token_logprobs(self, sequences: list[list[int]]) -> torch.Tensor:
        """The served policy's full next-token log-softmax at every position but the last of each sequence, rows
        stacked in order (`rl_tpu.consistency`; the engine needs `EngineOptions.full_distributions`)."""
        outputs, _ = self._generate(sequences, [full_distribution_params()] * len(sequences))
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        return torch.cat([dense_rows(output.prompt_logprobs, vocab) for output in outputs])

    def score_canary(self, tokens: CanaryTokens | None) -> list[float] | None:
        """The logprob of each canary continuation token under what the engine serves now, through the adapter
        request its generations use (`rl_tpu/sync/canary.py`); None without a canary."""
        if tokens is None:
            return None
        outputs, _ = self._generate([list(s) for s in tokens.sequences], [canary_params()] * len(tokens.sequences))
        return continuation_logprobs(outputs, tokens)

    @ray.method(concurrency_group="weights")
    def install(self, bundle: WeightBundle, resent: bool = False, earlier: list | None = None) -> dict[str, Any]:
        """Verify and install a weight bundle; the previous version keeps serving if anything is wrong. The figures
        include the bundle's canary as the engine now scores it (`canary`, `canary_s`), for the pool to check.

        `resent`: the pool sends it again after losing the engine; one brought back with this version already
        (`EngineRestarts.bring_back`) reports instead of refusing it. earlier: the generations sent to this engine
        before the install (ObjectRefs), which end before it loads."""
        with self.activity:  # receiving and verifying use the engine's cores too
            start = time.perf_counter()
            # reads every bucket, refused or not: a collective stream stays aligned
            tensors, timings = unpack(bundle, receiver=self.options.index)
            if resent and bundle.version == self.version:
                checked = loading = done = time.perf_counter()
            else:
                checked, loading, done = self._load(bundle, tensors, earlier or [])
            canary, scored = self.score_canary(bundle.canary), time.perf_counter()
            return {
                **timings,
                "install_s": done - loading,
                "receive_s": (checked - start) + (done - loading),
                "install_wait_s": loading - checked,  # the generation under way finishing first
                "peak_rss_mb": peak_rss_mb(),
                "version": self.version,
                "busy_s": self.busy_s,
                **self.served.report(),
                "canary": canary,
                "canary_s": scored - done,  # scoring it: the canary's cost on the engine's side
            }

    def _load(self, bundle: WeightBundle, tensors, earlier: list) -> tuple[float, float, float]:
        """Refuse a bundle that is not newer or does not fill the engine; else load it once the generations sent
        before it have ended. Returns when the checks ended, when the load began and when it ended."""
        if bundle.version <= self.version:
            raise WeightSyncError(f"sampler serves v{self.version}; refusing older or equal bundle v{bundle.version}")
        self.served.check(bundle)
        checked = time.perf_counter()
        with self.turns.install(earlier):
            loading = time.perf_counter()
            self.served.install(bundle, tensors)
            self.version = bundle.version
            done = time.perf_counter()
            self.busy_s += done - loading  # inside the turn: generations add to it from their own thread
        return checked, loading, done

    def sleep(self) -> None:
        """Give the device to the trainer (sleep mode only): KV cache dropped, and the weights too where a full
        bundle replaces them at the next install (level 2); a LoRA base, which no install sends, is kept on the
        host meanwhile (level 1)."""
        if self.options.sleep_mode:
            self.llm.sleep(level=1 if self.options.adapters is not None else 2, mode="wait")

    def wake_up(self) -> None:
        if self.options.sleep_mode:
            self.llm.wake_up()

    def listen(self, offer: Any) -> Any:
        """This engine's side of the transport's start-up handshake (`Transport.listen`); returns what trainer
        rank 0 connects to."""
        from rl_tpu.cluster.device import Device

        # the trainer may be on another host: listen on, and advertise, this node's address
        device, host = Device.resolve("auto").torch_device, ray.util.get_node_ip_address()
        return transport_class(self.options.transport).listen(offer, self.options.index, device, host)

    def serving_version(self) -> int:
        return self.version

    def compiled_graphs(self) -> int:
        """Graphs torch.compile made in this engine's process: none when it runs eagerly."""
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def where(self) -> dict:
        return {**where_am_i(), "actor": self.name}

    def shutdown(self) -> None:
        """Release the engine before the actor exits (a lingering engine leaks shared memory)."""
        if hasattr(self, "activity"):
            self.activity.close()
        if getattr(self, "episodes", None) is not None:
            self.episodes.tools.close()
        engine = getattr(self, "llm", None)
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()
            del self.llm


def launch_sampler(
    model_path: str,
    dtype: str,
    max_model_len: int,
    kv_cache_gb: float | None,
    seed: int,
    options: EngineOptions = EngineOptions(),
    ray_options: dict | None = None,
):
    """Start a `Sampler` as a Ray actor in its own process, with the environment vLLM needs.

    `ray_options` are Ray's actor options (resources, placement); by default one CPU.
    """
    env = {**sampler_env(options.enforce_eager), **options.binding.env()}
    return (
        ray.remote(concurrency_groups=SAMPLER_CONCURRENCY)(Sampler)
        .options(**(ray_options or {"num_cpus": 1}), runtime_env={"env_vars": env})
        .remote(model_path, dtype, max_model_len, kv_cache_gb, seed, options)
    )
