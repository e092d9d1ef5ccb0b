"""The `trainer` section: the FSDP2 ranks, the run's length and schedule, checkpoints, restarts and outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_tpu.config.choices import ResumeMode, Tracker

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
    # write what each step trained on to <this folder>/<step>.jsonl (verl's key and fields, and the inspector's:
    # rl_tpu/controller/recording.py); None: <run folder>/rollouts, at trainer.rollout_data_every's share
    rollout_data_dir: Optional[str] = None
    # record one prompt group in this many a step (those whose row in the data file is a multiple of it) and the
    # evaluations' samples of as many held-out prompts; 0: record nothing; None: every group where rollout_data_dir
    # is set (verl's dump), else 8
    rollout_data_every: Optional[int] = None
    plots: bool = True  # when the run ends, plot its metrics into plots/ (rl_tpu/outputs/plots.py)
    # first run `rl-tpu doctor`'s checks: two short steps of these settings in RUN/preflight/, from the same start
    # weights (the run's own start is unchanged); a failed check stops before the run starts. A resume skips it
    preflight: bool = False

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
            "trainer.rollout_data_every": self.rollout_data_every or 0,
            "trainer.keep_last": self.keep_last,
            "trainer.checkpoint_every": self.checkpoint_every or 0,
            "trainer.max_restarts": self.max_restarts,
            "trainer.max_staleness": self.max_staleness,
        }
        if min(counts.values()) < 0:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in counts.items())} must each be >= 0 (rollout_data_every 0: "
                "record nothing; keep_last 0: keep every checkpoint; checkpoint_every 0: none during the run; "
                "max_restarts 0: no restarts; max_staleness 0: the synchronous loop)"
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
