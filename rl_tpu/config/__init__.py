"""The config schema: plain dataclasses registered in Hydra's ConfigStore.

Hydra validates every override against these types at start-up, so a typo such as
``algorithm.lrr=1`` or ``device=gpu`` fails before any actor starts, naming the key and
(for enums) the allowed values. Key names follow verl's where verl has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rl_tpu.config.choices import (
    DeviceKind,
    DType,
    Layout,
    LossAggMode,
    OldLogprobSource,
    PinCores,
    ResumeMode,
    RolloutIS,
    Tracker,
    value_of,
)
from rl_tpu.config.episode import EpisodeConfig
from rl_tpu.config.lora import LoraConfig
from rl_tpu.config.reasoning_gym import ReasoningGymConfig
from rl_tpu.config.reward import CustomRewardConfig, RewardConfig
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

        return getattr(torch, value_of(self.dtype))


@dataclass
class DataConfig:
    # verl-schema .parquet or .jsonl (or plain question/answer JSONL via prompt_key / answer_key);
    # unset: the synthetic arithmetic task
    train_files: Optional[str] = None
    val_files: Optional[str] = None
    prompt_key: str = "prompt"  # the column holding chat messages or a plain prompt string
    answer_key: Optional[str] = None  # a column holding the ground truth; None: reward_model.ground_truth
    data_source: Optional[str] = None  # for rows without a data_source column; None: the file name
    train_batch_size: int = 16  # prompts per step (each gets sampler.n completions)
    max_prompt_length: int = 64
    filter_overlong_prompts: bool = True  # skip (and count) longer prompts; false: stop with an error
    val_max_samples: Optional[int] = None  # evaluate on the first N validation prompts only
    seed: int = 0  # the arithmetic task's train / held-out split (and so the tiny model's warm start)
    # the order of the training prompts; None: data.seed. A run's seeds are this, sampler.seed and seed: changing
    # them alone keeps the model and the held-out set
    shuffle_seed: Optional[int] = None
    # a reasoning-gym task generated in place of data files, e.g. data.reasoning_gym.task=products
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    # the synthetic arithmetic task (used when neither train_files nor reasoning_gym.task is set)
    ops: str = "+-"
    max_operand: int = 99
    num_eval: int = 512  # exactly this many held-out problems; 47*83 and 83*47 on one side (reference-workload.md)

    def __post_init__(self) -> None:
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size={self.train_batch_size} must be at least 1")
        if self.train_files and self.reasoning_gym.task:
            raise ValueError(
                f"data.train_files={self.train_files!r} and data.reasoning_gym.task={self.reasoning_gym.task!r} are both "
                "set: a run trains on data files or on a reasoning-gym task, not both"
            )


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


@dataclass
class RolloutCorrectionConfig:
    """`policy_loss.loss_mode=bypass_mode` only: verl's `rollout_correction` keys."""

    loss_type: str = "ppo_clip"  # ppo_clip (the ratio to the sampler is clipped) or reinforce (IS-weighted)
    rollout_is: Optional[str] = "token"  # token, sequence or null: the IS weights reinforce applies
    rollout_is_threshold: float = 2.0


@dataclass
class PolicyLossConfig:
    """verl's `actor.policy_loss`: which registered loss, and the settings only some losses read."""

    loss_mode: str = "vanilla"  # one of verl's (algorithms.registry.LOSS_FACTS) or an import path module:function
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens clipped
    clip_cov_lb: float = 1.0  # clip_cov: covariance bounds of the clipped tokens
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens given the KL term
    ppo_kl_coef: float = 0.1  # kl_cov: that term's coefficient
    dro_beta: Optional[float] = None  # dro: the penalty's coefficient (required)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class ActorConfig:
    """Policy-loss and update settings, named as in verl's `actor_rollout_ref.actor`."""

    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio: float = 0.2  # PPO clip range, both sides unless the next two are set
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None  # above clip_ratio_low: DAPO's clip-higher
    clip_ratio_c: float = 3.0  # dual-clip PPO: the bound on the loss of negative-advantage tokens
    loss_agg_mode: LossAggMode = LossAggMode["token-mean"]  # how token losses become the batch's loss
    # seq-mean-token-sum-norm divides by this; None: sampler.response_length (a constant, as Dr. GRPO wants)
    loss_scale_factor: Optional[int] = None
    tau_pos: float = 1.0  # sapo: gate temperatures for positive and negative advantages
    tau_neg: float = 1.05
    # prompts per optimizer update (x sampler.n sequences); None: the whole batch, one update per epoch
    ppo_mini_batch_size: Optional[int] = None
    ppo_epochs: int = 1  # passes over the batch; each mini-batch of each pass is one optimizer update
    old_logprob_source: OldLogprobSource = OldLogprobSource.trainer  # the PPO ratio's denominator
    use_kl_loss: bool = False  # a KL penalty to the initial policy in the loss
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # verl's KL estimator: k1, k2 (mse), k3 (low_var_kl), abs; "+": k2 gradient
    entropy_coeff: float = 0.0  # entropy bonus
    # importance weights pi_trainer / pi_sampler, truncated (TIS): they correct stale or bf16 rollouts
    rollout_is: RolloutIS = RolloutIS.auto
    rollout_is_threshold: float = 2.0  # importance weights are truncated at this (TIS)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters on a frozen base (off at lora_rank 0)

    def __post_init__(self) -> None:
        if self.rollout_is_threshold <= 1.0:
            raise ValueError(f"actor.rollout_is_threshold={self.rollout_is_threshold} must be > 1")
        self.lora.__post_init__()


@dataclass
class KLControlConfig:
    """verl's `algorithm.kl_ctrl`: the coefficient of the KL penalty in the reward (`algorithm.use_kl_in_reward`)."""

    type: str = "fixed"  # fixed, or adaptive (Ziegler et al., 2019): the coefficient steers the KL toward target_kl
    kl_coef: float = 0.001  # the coefficient (adaptive: its first value)
    horizon: int = 10000  # adaptive: sequences over which a 20% KL error changes the coefficient by 20%
    target_kl: float = 0.1  # adaptive: the per-token KL aimed at


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling, by verl's `algorithm.filter_groups` keys (rl_tpu/algorithms/learning_signal.py)."""

    enable: bool = False  # drop groups whose rewards are all equal and generate more until the batch is full
    metric: Optional[str] = None  # what must vary within a group: a reward's name (reward.combine); None: the score
    # generation batches per step at most; past it, groups without variation fill the rest (zero advantage)
    max_num_gen_batches: int = 10


@dataclass
class AlgorithmConfig:
    # verl's estimator: grpo, rloo, opo, gpg, gdpo, grpo_passk, reinforce_plus_plus(_baseline), grpo/rloo_vectorized.
    # verl's others need a critic or inputs rl_tpu does not make (algorithms.registry); or an import path mod:fn
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # divide each group's advantages by its reward std (false: Dr. GRPO)
    gamma: float = 1.0  # discount (reinforce_plus_plus)
    lam: float = 1.0
    # gdpo: the reward components normalised one by one (names in reward.combine), and their weights
    gdpo_reward_keys: Optional[list[str]] = None
    gdpo_reward_weights: Optional[list[float]] = None
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_filter: bool = False  # DAPO's overlong filtering: truncated completions are left out of the loss
    # each token's reward less kl_ctrl's coefficient times its KL to the reference model (the initial weights),
    # before the advantages, as verl's apply_kl_penalty (rl_tpu/algorithms/kl_reward.py)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # verl's estimator of that KL: kl (k1), abs, mse (k2), low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0  # linear learning-rate warm-up, in steps
    grad_clip: float = 1.0  # gradient norm clip


MEMORY_CHECKS = ("refuse", "warn", "off")  # trainer.memory_check


@dataclass
class TrainerConfig:
    world_size: int = 1  # FSDP2 ranks (Ray actors)
    micro_batch_size: int = 64  # sequences per forward/backward on each rank
    activation_checkpointing: bool = False
    # completion positions whose fp32 log-softmax is computed (and recomputed in backward) at once
    logprob_chunk_size: int = 32
    # pad prompt and response lengths up to these sizes, so compiled graphs are reused (TPU); []: no padding
    seq_buckets: list[int] = field(default_factory=list)
    compile: bool = False  # torch.compile each decoder block (inductor; the first step compiles, ~1 min on CPU)
    threads_per_rank: int = 1
    # Pinned CPU runs (pin_cores): a rank also computes on its node's engine cores while every engine there is
    # idle, and narrows back when one takes a call (rl_tpu/cluster/core_loan.py). With `compile`, each block compiles once
    # per thread count, over the first steps. Off by default: it pays where the train step is long beside the
    # controller's own work, and slowed grpo_math's short steps (benchmarks/README.md)
    borrow_idle_cores: bool = False
    # the trainer model's attention: eager, sdpa, flash_attention_2 ...; None: eager for bf16 on CPU (PyTorch's
    # bf16 CPU flash-attention backward is slow: benchmarks/README.md), else sdpa
    attn_implementation: Optional[str] = None
    # micro-batches of sequences of similar lengths (padding costs compute); the loss does not depend on the order
    sort_by_length: bool = True
    # Each distinct prompt of a micro-batch is run once and its keys and values serve every completion of its
    # group (a GRPO group shares its prompt), so a prompt costs 1/sampler.n of its compute; loss and gradients
    # equal the whole-sequence forward's (fp32: to 1e-6). The prompts' forward has a batch size per count of
    # distinct prompts in a micro-batch; with seq_buckets that count is rounded up to a power of two, so a compiler
    # (on TPU, a graph per shape) sees a few sizes only
    share_prompts: bool = True
    # Rows whose advantages are all zero (a GRPO group whose completions all scored the same) or that are out of
    # the loss get no forward or backward: under the policy losses in rl_tpu/algorithms/core.py's list, with no KL loss
    # and no entropy bonus, they add exactly zero to the loss and the gradient, and the loss keeps the whole
    # batch's token and sequence counts; the rows left are topped up to a multiple of the ranks (with seq_buckets, of
    # ranks times micro_batch_size: no new shape). Loss and gradients equal the full batch's to float rounding (fp32:
    # 1e-6, tests). actor/entropy and actor/logprob_diff are then over the rows trained; perf/rows_skipped_frac says
    # how many were not. None: on wherever that changes no update; true: on, refusing settings where it would; false: off
    skip_zero_advantage_rows: Optional[bool] = None
    # Host allocations of 1 MiB or more are mapped and unmapped on their own, so freed memory goes back to the
    # OS at once (glibc's MALLOC_MMAP_THRESHOLD_): otherwise freed parameter-sized blocks stay in the heap and a
    # rank's memory stops scaling with the world size. Real-size benchmark: 37% lower peak per rank at world
    # size 2, CPU train steps 10-20% slower (benchmarks/README.md, trainer_memory.py). None: on for models
    # whose weight files hold 256 MiB or more; on the 3.3M reference model it doubled the train step
    return_freed_memory: Optional[bool] = None
    # refuse a run whose memory plan (logged at start, an estimate) exceeds a device's memory; warn: start anyway;
    # off: no plan (rl_tpu/controller/memory_plan.py)
    memory_check: str = "refuse"
    # place trainer ranks only on Ray nodes with these labels (`ray start --labels=role=trainer`); {}: anywhere
    node_labels: dict[str, str] = field(default_factory=dict)
    total_steps: int = 100  # training steps (each: generate, score, update, push weights); 0: evaluate the model only
    # Async mode: the sampler generates up to this many steps ahead of the trainer, with weights up to
    # this many versions old (corrected by truncated importance sampling); 0 is the synchronous loop.
    max_staleness: int = 0
    eval_every: int = 10  # steps between held-out evaluations (and after the last)
    # also draw this many samples a held-out prompt at sampler.temperature at the first and the last evaluation:
    # eval/pass@1 (their mean accuracy) and eval/pass@k for k = 2, 4, .., this (0: greedy accuracy only)
    eval_pass_k: int = 0
    export: bool = True  # write the final policy as a Hugging Face folder
    push_to_hub: Optional[str] = None  # upload the export to this Hub repository (user/name); a failure is a warning
    # steps between resumable checkpoints; None: every 10% of total_steps (bounds lost work); 0: none during the run
    checkpoint_every: Optional[int] = None
    checkpoint_final: bool = True  # a resumable checkpoint after the last step
    keep_last: int = 3  # complete checkpoints kept (older ones are removed after each save); 0: keep all
    max_skipped_steps: int = 3  # this many updates skipped in a row (non-finite loss or gradient) stop the run
    resume_from: Optional[str] = None  # a run folder (its latest checkpoint) or a checkpoints/step_N folder
    resume: ResumeMode = ResumeMode.off  # auto: continue this run folder (hydra.run.dir=...) where it stopped
    # settings a resumed run may change although they change what it learns (e.g. [sampler.n]); the checkpoint's
    # settings are compared with the run's, and other changes to such settings are refused
    resume_allow_changes: list[str] = field(default_factory=list)
    # a lost trainer rank (or an engine that cannot rejoin alone): every actor restarts from the last checkpoint,
    # this many times in one run; past that the run stops with the command that resumes it
    max_restarts: int = 1
    # where metrics go besides metrics.jsonl: TensorBoard and the others through verl's Tracking; a tracker whose
    # package is missing, or that cannot start, costs one warning (rl_tpu/outputs/tracking.py)
    logger: list[Tracker] = field(default_factory=lambda: [Tracker.console, Tracker.jsonl, Tracker.tensorboard])
    project_name: str = "rl_tpu"  # the trackers' project
    experiment_name: Optional[str] = None  # the trackers' name for the run; None: the run folder's name
    # write what each step trained on to <this folder>/<step>.jsonl (verl's key and fields; rl_tpu/outputs/rollout_log.py)
    rollout_data_dir: Optional[str] = None
    plots: bool = True  # when the run ends, plot its metrics into plots/ (rl_tpu/outputs/plots.py)

    @property
    def is_async(self) -> bool:
        """Whether the sampler generates ahead of the trainer (async mode), derived here once."""
        return self.max_staleness > 0

    def __post_init__(self) -> None:
        if min(self.eval_every, self.micro_batch_size) < 1 or min(self.total_steps, self.eval_pass_k) < 0:
            raise ValueError(
                f"trainer.eval_every={self.eval_every} and trainer.micro_batch_size={self.micro_batch_size} must "
                f"each be at least 1, and trainer.total_steps={self.total_steps} and trainer.eval_pass_k="
                f"{self.eval_pass_k} at least 0 (total_steps 0: evaluate the model only; eval_pass_k 0: no pass@k)"
            )
        counts = {
            "trainer.keep_last": self.keep_last,
            "trainer.checkpoint_every": self.checkpoint_every or 0,
            "trainer.max_restarts": self.max_restarts,
            "trainer.max_staleness": self.max_staleness,
        }
        if min(counts.values()) < 0:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in counts.items())} must each be >= 0 (keep_last 0: keep every "
                "checkpoint; checkpoint_every 0: none during the run; max_restarts 0: no restarts; max_staleness "
                "0: the synchronous loop)"
            )
        if self.world_size < 1 or self.logprob_chunk_size < 1:
            raise ValueError(
                f"trainer.world_size={self.world_size} and trainer.logprob_chunk_size={self.logprob_chunk_size} "
                "must be at least 1"
            )
        if self.memory_check not in MEMORY_CHECKS:
            raise ValueError(
                f"trainer.memory_check={self.memory_check!r}: allowed values are {', '.join(MEMORY_CHECKS)}"
            )


@dataclass
class SyncConfig:
    # a built-in transport (rl_tpu/sync/registry.py: object_store, shm_file, collective, cuda_ipc, nccl, tpu_sync)
    # or a Transport subclass by import path, package.module:Class; checked before Ray starts (controller/checks.py)
    transport: str = "object_store"
    bucket_mb: float = 512.0  # upper bound on one bucket's bytes
    shm_dir: str = "/dev/shm/rl_tpu"  # where shm_file writes its buckets


@dataclass
class ExportConfig:
    # trainer.push_to_hub (and `python -m rl_tpu.export --push-to-hub`) refuses a public repository unless this is
    # true; a repository that does not exist is made private
    public: bool = False


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a local cluster; `auto`: join the cluster this node belongs to
    num_cpus: Optional[int] = None  # None: the core count plus one, so the sampler is never starved
    # a local cluster's object store; None: two weight bundles and 256 MiB (512 at least), so that the object_store
    # transport holds a bundle being installed and the next one
    object_store_mb: Optional[int] = None
    placement_timeout_s: float = 120.0  # stop when the actors cannot be placed within this long
    start_timeout_s: float = 900.0  # actors loading their model (vLLM start-up, FSDP sharding)
    call_timeout_s: float = 3600.0  # any one call on an actor during the run (a step, a sync, a checkpoint)


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
        for section in (self.data, self.sampler, self.episode, self.actor, self.trainer, self.reward):
            section.__post_init__()

    @property
    def lora_sync(self) -> str | None:
        """What a LoRA policy's weight sync sends (None: no LoRA): `actor.lora.sync`, where auto is the adapter
        except on TPU, whose engine plugin was not tried with adapters (merged weights there)."""
        lora = self.actor.lora
        if not lora.enabled:
            return None
        on_tpu = value_of(self.device) == "tpu" or value_of(self.sync.transport) == "tpu_sync"
        return lora.sync if lora.sync != "auto" else ("merged" if on_tpu else "adapter")

    @property
    def engine_eager(self) -> bool:
        """Whether the engines run eagerly: `sampler.enforce_eager`, by default on CPU only (with `device` resolved,
        as the actors' config has it): compiled with CUDA graphs on accelerators, where decoding gains most."""
        eager = self.sampler.enforce_eager
        return value_of(self.device) == "cpu" if eager is None else eager

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
