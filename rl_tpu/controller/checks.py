"""Checks that span several config sections, made once before Ray starts; each names the keys and what is allowed."""

from __future__ import annotations

from pathlib import Path

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms import kl_reward, learning_signal, outcomes, registry
from rl_tpu.cluster import placement
from rl_tpu.cluster.cores import engine_threads
from rl_tpu.cluster.device import Device
from rl_tpu.config import RunConfig
from rl_tpu.grader.grader import reward_sources
from rl_tpu.models.safe_checkpoint import check_metadata
from rl_tpu.outputs import checkpoints
from rl_tpu.sync.base import Transport
from rl_tpu.sync.registry import host_transports, transport_class


def validate(cfg: RunConfig) -> None:
    """Value checks the type system cannot express; each names the key and what is allowed. Each config section
    checks its own fields (`__post_init__`, again in `cfg.check()`); these span sections or need other parts."""
    cfg.check()
    reward_names = [s.label for s in reward_sources(cfg.reward, cfg.custom_reward_function)]
    algorithms.validate(cfg, reward_names)
    kl_reward.validate(cfg.algorithm)
    learning_signal.validate(
        cfg.algorithm.filter_groups, reward_names, cfg.reward.overlong_buffer, cfg.completion_tokens
    )
    outcomes.validate(cfg.algorithm)
    if cfg.trainer.resume_from:
        # names the folder if there is nothing to resume, and refuses a checkpoint that would run code
        check_metadata(checkpoints.latest(Path(cfg.trainer.resume_from).expanduser()))
    per_step = cfg.data.train_batch_size * cfg.sampler.n
    if per_step % cfg.trainer.world_size:
        raise ValueError(
            f"data.train_batch_size * sampler.n = {per_step} sequences must divide evenly over "
            f"trainer.world_size={cfg.trainer.world_size}"
        )
    transport = transport_class(cfg.sync.transport)  # refuses a name it does not know, or a path that fails
    transport.check_config(cfg)
    if cfg.sampler.tensor_parallel_size > 1:
        check_tensor_parallel(cfg, transport)
    placement.check_request(cfg)
    if cfg.ray.address is None and cfg.device in ("cuda", "tpu"):
        Device.resolve(cfg.device)  # a local cluster is this host: a missing accelerator fails now, not after Ray


def check_tensor_parallel(cfg: RunConfig, transport: type[Transport]) -> None:
    """An engine over several devices (`sampler.tensor_parallel_size`) receives full weights through the host
    (`Transport.through_host`): the device transports address one receiving process per engine, and adapters and
    the TPU engine were not tried."""
    size, device = cfg.sampler.tensor_parallel_size, cfg.device
    key = f"sampler.tensor_parallel_size={size}"
    if not transport.through_host:
        allowed = ", ".join(host_transports())
        raise ValueError(f"{key} needs a host transport: sync.transport allowed values are {allowed}")
    if device == "tpu" or cfg.lora_sync == "adapter":
        raise ValueError(
            f"{key} is not supported with device=tpu or a LoRA adapter served as one (not tried): set it to 1, or "
            "actor.lora.sync=merged"
        )
    threads = engine_threads(cfg)
    on_cpu = device == "cpu" or (device == "auto" and cfg.ray.address is None and Device.resolve(device).kind == "cpu")
    if on_cpu and threads < size:
        raise ValueError(
            f"{key} on CPU splits an engine's {threads} thread(s) over {size} workers: set sampler.threads (or "
            f"sampler.num_cpus) to at least {size}"
        )


# Settings a resumed run may change, each change logged: where and how fast it runs, how long, what it records.
# Any other change alters what the run learns or its shapes, and is refused unless trainer.resume_allow_changes
# lists it (prefixes: a key and every key under it).
RESUME_MAY_CHANGE = (
    *("placement", "pin_cores", "cache_dir", "ray.", "export.", "sync.", "data.val_files", "data.val_max_samples"),
    *(f"sampler.{key}" for key in ("kv_cache_gb", "gpu_memory_utilization", "enforce_eager", "num_cpus", "threads")),
    *(f"sampler.{key}" for key in ("num_engines", "node_labels", "max_restarts", "tensor_parallel_size")),
    *(f"trainer.{key}" for key in ("world_size", "micro_batch_size", "activation_checkpointing", "logprob_chunk_size")),
    *(f"trainer.{key}" for key in ("seq_buckets", "compile", "threads_per_rank", "borrow_idle_cores", "node_labels")),
    *(f"trainer.{key}" for key in ("attn_implementation", "sort_by_length", "share_prompts", "return_freed_memory")),
    *(f"trainer.{key}" for key in ("total_steps", "eval_every", "eval_pass_k", "export", "push_to_hub", "plots")),
    *(f"trainer.{key}" for key in ("checkpoint_every", "checkpoint_final", "keep_last", "max_skipped_steps")),
    *(f"trainer.{key}" for key in ("resume", "max_restarts", "logger", "project_name", "experiment_name")),
    "trainer.rollout_data_dir",
    "trainer.preflight",
    "trainer.rollout_data_every",
    "trainer.memory_check",
    "reward.num_workers",
    # when episodes meet the engine and the tools, not what they are (the same episodes for a deterministic engine)
    *(f"episode.{key}" for key in ("scheduling", "max_calls_in_flight")),
)


# Keys that decide which rows share a micro-batch: under the losses that pick tokens by statistics of the rows they
# see (`LossFacts.micro_batch_statistics`), changing one changes the loss itself, so a resume may not
MICRO_BATCH_KEYS = ("trainer.micro_batch_size", "trainer.world_size", "trainer.sort_by_length")
# `data.` keys that shape training alone; every other one may change the held-out set
TRAINING_ONLY_DATA_KEYS = ("data.train_files", "data.train_batch_size", "data.shuffle_seed")


def check_resumed_settings(
    checkpoint: Path, settings: dict, allow_changes: list[str], continues_folder: bool = False
) -> dict[str, tuple]:
    """Compare the run's `settings` with those of the run that wrote `checkpoint`; refuse a change that alters what
    the run learns unless `allow_changes` (trainer.resume_allow_changes) names it. Returns every change.

    `continues_folder`: the run continues the checkpoint's own folder, whose held-out accuracies so far it keeps;
    a change of the held-out set is then refused, since the run would report a gain between two different sets."""
    changed = checkpoints.changed_settings(checkpoints.saved_settings(checkpoint), settings)
    loss = settings["actor"]["policy_loss"]["loss_mode"]
    splits_matter = registry.loss_facts(loss).micro_batch_statistics
    may_change = tuple(k for k in RESUME_MAY_CHANGE if not (splits_matter and k in MICRO_BATCH_KEYS))
    refused = {key: values for key, values in changed.items() if not key.startswith((*may_change, *allow_changes))}
    if refused:
        listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in sorted(refused.items()))
        why = (
            f" (under actor.policy_loss.loss_mode={loss} the loss picks its tokens by statistics of each "
            f"micro-batch, whose rows {', '.join(MICRO_BATCH_KEYS)} decide)"
            if splits_matter and set(refused) & set(MICRO_BATCH_KEYS)
            else ""
        )
        raise ValueError(
            f"{checkpoint} was written by a run with other settings, which change what the run learns: {listed}"
            f"{why}. Resume with the checkpoint's values, or change them anyway with "
            f"trainer.resume_allow_changes=[{','.join(sorted(refused))}]"
        )
    held_out = sorted(k for k in changed if k.startswith("data.") and not k.startswith(TRAINING_ONLY_DATA_KEYS))
    if continues_folder and held_out:
        listed = ", ".join(f"{key}: {changed[key][0]!r} -> {changed[key][1]!r}" for key in held_out)
        raise ValueError(
            f"resuming {checkpoint} in its own run folder with another held-out set ({listed}) would report a "
            "held-out gain between two different sets. Keep the held-out settings, or resume into a new run folder "
            f"(trainer.resume_from={checkpoint} with another hydra.run.dir), whose held-out baseline is then this "
            "checkpoint's policy on the new set"
        )
    return changed


def check_resume_files(checkpoint: Path, kl_in_reward: bool, replay_queued: bool) -> None:
    """Read every file a resume from `checkpoint` will read, before Ray starts: the driver's (`kl_in_reward`: the
    KL controller's; `replay_queued`: the generations queued ahead), and the ranks' shards, whole as the checkpoint's
    metadata lists them. One that is missing or cut short refuses the resume now, not once the actors have started."""
    checkpoints.data_position(checkpoint)
    if kl_in_reward:
        checkpoints.kl_coef(checkpoint)
    if replay_queued:
        checkpoints.queued_generations(checkpoint)
    ends: dict[str, int] = {}  # each shard file's length, by where its last stored item ends
    for info in check_metadata(checkpoint).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(ends.items()):
        shard = checkpoint / name
        if not shard.is_file() or shard.stat().st_size < size:
            raise FileNotFoundError(
                f"{checkpoint}: its shard {name} is missing or shorter than its metadata says ({size} bytes): a "
                "copy cut short? Resume from another checkpoint with trainer.resume_from=RUN/checkpoints/step_N"
            )
