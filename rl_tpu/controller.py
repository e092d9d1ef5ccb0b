"""The driver: builds the parts, then runs the loop (generate -> grade -> advantages -> train -> push weights).

One loop for both modes. Synchronous (`trainer.max_staleness=0`): the sampler generates batch
t with the weights of step t-1. Async (`max_staleness=k`): the sampler works up to k batches
ahead, so batch t may come from weights t-1-k .. t-1 and the sampler generates while the
trainer trains and the grader grades; the trainer corrects the policy gradient with truncated
importance weights. Every rollout's weight version is checked against that window. The
sampler runs its calls in order, so a generation queued before a weight install uses the
older weights; in async mode the driver does not wait for the install, and the generations sent
after it wait for it on their engine. The held-out evaluation is graded while the sampler generates
the next batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rl_tpu import algorithms, batch_shaping, checkpoints, evaluation, kl_reward, placement, plots, precision, rollout_queue, tracking
from rl_tpu.config import RayConfig, RunConfig, Tracker, cache_path, value_of
from rl_tpu.data import Example, batches, ensure_arithmetic_dataset, load_examples
from rl_tpu.device import Device
from rl_tpu.export import push_to_hub, write_model_card
from rl_tpu.grader import Grader, reward_sources
from rl_tpu.kl_reward import KLInReward
from rl_tpu.metrics import MetricsLogger, final_accuracy
from rl_tpu.models import check_decoder, resolve_model_path
from rl_tpu.recovery import RunInterrupted, SkippedStepGuard, StopRequest, with_restarts
from rl_tpu.rollout import TrainBatch
from rl_tpu.rollout_queue import RolloutQueue
from rl_tpu.workers import Workers, start_workers

log = logging.getLogger(__name__)


def validate(cfg: RunConfig) -> None:
    """Value checks the type system cannot express; each names the key and what is allowed."""
    reward_names = [s.label for s in reward_sources(cfg.reward, cfg.custom_reward_function)]
    algorithms.validate(cfg, reward_names)
    kl_reward.validate(cfg.algorithm)
    batch_shaping.validate(cfg.algorithm.filter_groups, reward_names, cfg.reward.overlong_buffer,
                           cfg.sampler.response_length)
    t = cfg.trainer
    if min(t.eval_every, t.micro_batch_size, cfg.data.train_batch_size) < 1 or min(t.total_steps, t.eval_pass_k) < 0:
        raise ValueError(f"trainer.eval_every={t.eval_every}, trainer.micro_batch_size={t.micro_batch_size} and "
                         f"data.train_batch_size={cfg.data.train_batch_size} must each be at least 1, and "
                         f"trainer.total_steps={t.total_steps} and trainer.eval_pass_k={t.eval_pass_k} at least 0 "
                         "(total_steps 0: evaluate the model only; eval_pass_k 0: no pass@k)")
    counts = {"trainer.keep_last": t.keep_last, "trainer.checkpoint_every": t.checkpoint_every or 0,
              "trainer.max_restarts": t.max_restarts, "sampler.max_restarts": cfg.sampler.max_restarts}
    if min(counts.values()) < 0:
        raise ValueError(f"{', '.join(f'{k}={v}' for k, v in counts.items())} must each be >= 0 (keep_last 0: keep "
                         "every checkpoint; checkpoint_every 0: none during the run; max_restarts 0: no restarts)")
    if t.resume_from:
        checkpoints.latest(Path(t.resume_from).expanduser())  # names the folder if there is nothing to resume
    r = cfg.reward
    if not 0.0 <= r.max_failure_rate <= 1.0 or r.timeout_s <= 0 or (r.worker_memory_mb is not None and r.worker_memory_mb <= 0):
        raise ValueError(f"reward.max_failure_rate={r.max_failure_rate} must be in [0, 1], reward.timeout_s="
                         f"{r.timeout_s} > 0 and reward.worker_memory_mb={r.worker_memory_mb} > 0 (null: no limit)")
    if cfg.trainer.world_size < 1 or cfg.trainer.logprob_chunk_size < 1:
        raise ValueError(f"trainer.world_size={cfg.trainer.world_size} and trainer.logprob_chunk_size="
                         f"{cfg.trainer.logprob_chunk_size} must be at least 1")
    per_step = cfg.data.train_batch_size * cfg.sampler.n
    if per_step % cfg.trainer.world_size:
        raise ValueError(f"data.train_batch_size * sampler.n = {per_step} sequences must divide evenly over "
                         f"trainer.world_size={cfg.trainer.world_size}")
    if cfg.trainer.max_staleness < 0 or cfg.actor.rollout_is_threshold <= 1.0:
        raise ValueError(f"trainer.max_staleness={cfg.trainer.max_staleness} must be >= 0 and "
                         f"actor.rollout_is_threshold={cfg.actor.rollout_is_threshold} > 1")
    if cfg.sampler.temperature <= 0:
        raise ValueError(f"sampler.temperature={cfg.sampler.temperature} must be > 0 for training rollouts")
    placement.check_request(cfg)
    if cfg.ray.address is None and value_of(cfg.device) in ("cuda", "tpu"):
        Device.resolve(cfg.device)  # a local cluster is this host: a missing accelerator fails now, not after Ray


def grpo_step(step: int, queue: RolloutQueue, workers: Workers, tokenizer, grader: Grader,
              cfg: RunConfig, kl: KLInReward | None = None) -> tuple[dict[str, float], list[Example]]:
    """One step: the batch's rollouts (graded, shaped), advantages (less `kl`'s penalties when the reward holds
    the KL), the update, the weights to the sampler. Returns the step's metrics and the prompts it trained on."""
    t0 = time.perf_counter()
    sampled = rollout_queue.collect(step, queue, tokenizer, grader, cfg)
    rollouts, grades = sampled.batch.rollouts, sampled.batch.grades
    t1 = time.perf_counter()
    lengths = [len(r.completion_ids) for r in rollouts]
    in_loss = [r.finish_reason != "length" for r in rollouts] if cfg.algorithm.overlong_filter else None
    batch = TrainBatch(  # advantages filled in below: the KL in the reward needs the batch first
        [r.prompt_ids for r in rollouts], [r.completion_ids for r in rollouts], [r.logprobs for r in rollouts],
        [[0.0] * n for n in lengths], cfg.sampler.temperature,
        algorithms.rollout_is_level(cfg.actor, cfg.trainer.max_staleness > 0), cfg.actor.rollout_is_threshold, in_loss)
    workers.release_devices()
    penalties, kl_metrics = kl.penalties(workers.token_kl(batch)) if kl else (None, {})
    advantages = algorithms.advantages(grades.scores, [r.group for r in rollouts], lengths, cfg.algorithm,
                                       grades.components, penalties)
    t2 = time.perf_counter()
    train = workers.train(dataclasses.replace(batch, advantages=advantages))
    t3 = time.perf_counter()
    bundle = workers.publish(step)
    publish_s = time.perf_counter() - t3
    # async: the engines install while the trainer goes on to the next step, which reports this install's figures
    received = workers.install(bundle, wait=cfg.trainer.max_staleness == 0)
    t4 = time.perf_counter()
    generated = sampled.generated.rollouts  # what the policy produced, before any group was dropped
    gen_tokens = sum(len(r.completion_ids) for r in generated)
    oldest_used = min(r.weight_version for r in rollouts)
    return {
        "reward/mean": statistics.fmean(sampled.generated.grades.scores),
        "reward/std": statistics.pstdev(sampled.generated.grades.scores),
        **sampled.generated.grades.metrics("reward"),
        **sampled.metrics(),
        "rollout/samples": float(len(rollouts)),
        "response/length_mean": gen_tokens / len(generated),
        "response/truncated_frac": statistics.fmean(r.finish_reason == "length" for r in generated),
        **train,
        **kl_metrics,
        "time/generate_s": sampled.generate_s,  # waiting for the sampler (its work may have started earlier)
        "time/reward_s": sampled.reward_s + (t2 - t1),  # grading, shaping, the KL in the reward, the advantages
        "time/train_step_s": t3 - t2,
        "time/sync_s": t4 - t3,
        "time/publish_s": publish_s,  # the trainer's part of the sync; the engines' is sync/receive_s
        "time/step_s": t4 - t0,
        # no rank computed: waiting for rollouts, grades and the engines' install (async mode hides generation)
        "time/trainer_idle_s": max(0.0, (t4 - t0) - train["time/train_s"] - publish_s),
        "perf/gen_tokens_per_s": gen_tokens / sampled.generate_s,
        "perf/train_tokens_per_s": train["perf/train_tokens"] / train["time/train_s"],
        "rollout/weight_version": float(oldest_used),
        "rollout/staleness": float(step - 1 - oldest_used),
        "sync/version": float(bundle.version),
        "sync/transport": bundle.transport,
        "sync/buckets": float(len(bundle.buckets)),
        "sync/bytes": float(bundle.num_bytes),
        "sync/mb_per_s": bundle.num_bytes / 2**20 / (t4 - t3),
        **install_metrics(received),
        **sampled.shares,
    }, sampled.batch.prompts


def install_metrics(received: dict[str, float]) -> dict[str, float]:
    """An install's figures as a step's metrics (none when no install finished in the step: async, step 1)."""
    if not received:
        return {}
    return {
        "sync/receive_s": received["receive_s"],
        "sync/install_wait_s": received["install_wait_s"],  # for the engine's generation under way to end
        "perf/sampler_peak_rss_mb": received["peak_rss_mb"],
        **{k: v for k, v in received.items() if k.startswith(("time/", "sampler/"))},  # time/sampler_idle_s
    }


def dataset_paths(cfg: RunConfig, cache_dir: Path) -> tuple[Path, Path]:
    d = cfg.data
    if d.train_files:
        if not d.val_files:
            raise ValueError("data.train_files is set but data.val_files is not; held-out accuracy needs a val file")
        return Path(d.train_files), Path(d.val_files)
    return ensure_arithmetic_dataset(cache_dir / "data", d.ops, d.max_operand, d.num_eval, d.seed)


@dataclass
class Job:
    """What every attempt of a run shares: its settings, its inputs, and the outputs it continues."""

    cfg: RunConfig
    run_dir: Path
    model_path: Path
    kind: str  # the device kind the actors run on
    tokenizer: Any
    train_examples: list[Example]
    eval_examples: list[Example]
    grader: Grader
    logger: MetricsLogger
    stop: StopRequest


def save_checkpoint(job: Job, workers: Workers, step: int, queue: RolloutQueue, kl: KLInReward | None) -> Path:
    folder = checkpoints.folder_for(job.run_dir, step)
    workers.on_trainers("save_checkpoint", f"saving checkpoint {folder}", str(folder))
    checkpoints.save_data_position(folder, queue.taken)
    if kl is not None:
        checkpoints.save_kl_coef(folder, kl.coef)
    checkpoints.prune(job.run_dir, job.cfg.trainer.keep_last)
    return folder


def resume(job: Job, workers: Workers, restarted: bool) -> tuple[int, Path | None]:
    """Load the trainer state and give the sampler the same weights; returns the step to continue after, and
    the checkpoint of that step (None: the run starts).

    `trainer.resume=auto` and a restart continue this run folder (its metrics too); `trainer.resume_from`
    starts a new folder from another run's checkpoint.
    """
    t = job.cfg.trainer
    checkpoint = checkpoints.resume_point(job.run_dir, restarted or value_of(t.resume) == "auto", t.resume_from)
    if checkpoint is None:
        job.logger.truncate_after(None)
        return 0, None
    step = checkpoints.step_of(checkpoint)
    workers.on_trainers("load_checkpoint", f"loading checkpoint {checkpoint}", str(checkpoint))
    workers.install(workers.publish(step))
    job.logger.truncate_after(step if checkpoint.is_relative_to(job.run_dir) else None)
    log.info("resumed from %s at step %d", checkpoint, step)
    return step, checkpoint


def stop_early(job: Job, workers: Workers, step: int, saved: int, queue: RolloutQueue, kl: KLInReward | None) -> None:
    """A signal asked the run to stop: save after `step` unless that is saved already, and stop."""
    checkpoint = checkpoints.folder_for(job.run_dir, saved) if saved else None
    if step > saved:
        checkpoint = save_checkpoint(job, workers, step, queue, kl)
    raise RunInterrupted(step, job.stop.requested, checkpoint)


def train(job: Job, restarted: bool) -> None:
    """One attempt at the run: start the actors, continue from the resume point, run the remaining steps."""
    cfg, logger = job.cfg, job.logger
    total, timeout = cfg.trainer.total_steps, cfg.ray.call_timeout_s
    checkpoint_every = checkpoints.every(cfg.trainer.checkpoint_every, total)
    workers = start_workers(cfg, job.model_path, job.run_dir, job.kind)
    try:
        start_step, checkpoint = resume(job, workers, restarted)
        taken = checkpoints.data_position(checkpoint) if checkpoint else 0
        kl = KLInReward(cfg.algorithm, checkpoints.kl_coef(checkpoint)) if cfg.algorithm.use_kl_in_reward else None
        if not logger.records:  # a run continuing its own folder has its evaluation at start_step already
            first = evaluation.start_eval(workers.samplers, job.eval_examples, cfg, with_samples=True)
            logger.log(start_step, {**first.finish(job.tokenizer, job.grader, timeout),
                                    "sync/version": float(start_step)})
        order_seed = cfg.data.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed
        prompt_batches = batches(job.train_examples, cfg.data.train_batch_size, order_seed)
        for _ in range(taken):  # the same batches a run that never stopped would see next
            next(prompt_batches)
        queue = RolloutQueue(workers, prompt_batches, cfg, taken)
        guard, saved = SkippedStepGuard(cfg.trainer.max_skipped_steps), start_step
        for step in range(start_step + 1, total + 1):
            if job.stop.requested:
                stop_early(job, workers, step - 1, saved, queue, kl)
            metrics, prompts = grpo_step(step, queue, workers, job.tokenizer, job.grader, cfg, kl)
            guard.observe(step, metrics, prompts)
            pending_eval = None
            if step % cfg.trainer.eval_every == 0 or step == total:
                pending_eval = evaluation.start_eval(workers.samplers, job.eval_examples, cfg, step == total)
            queue.fill_after(step)  # behind the evaluation on the sampler: this step's weights or older
            if pending_eval is not None:
                metrics.update(pending_eval.finish(job.tokenizer, job.grader, timeout))
            logger.log(step, metrics)
            if (checkpoint_every and step % checkpoint_every == 0) or (step == total and cfg.trainer.checkpoint_final):
                save_checkpoint(job, workers, step, queue, kl)
                saved = step
        workers.samplers.finish_install()  # async: the last step's (its evaluation waited for it already)
        if cfg.trainer.export:
            workers.on_trainers("export", "exporting the policy", str(job.run_dir / "export"))
            write_model_card(job.run_dir / "export", job.run_dir, value_of(cfg.model.dtype))
            if cfg.trainer.push_to_hub:
                push_to_hub(job.run_dir / "export", cfg.trainer.push_to_hub)
    finally:
        workers.shutdown()


def check_inputs(cfg: RunConfig, model_path: Path, train_examples: list[Example]) -> None:
    """What the model and the data decide, checked before Ray starts."""
    if cfg.data.train_batch_size > len(train_examples):
        raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the "
                         f"{len(train_examples)} usable prompts of {cfg.data.train_files or 'the arithmetic task'}")
    check_decoder(model_path, cfg.model.fp32_residual and value_of(cfg.model.dtype) != "float32")


def start_ray(cfg: RayConfig) -> None:
    """Join `ray.address`, or start a local cluster; a sweep's trial runs inside the sweep's cluster already."""
    if ray.is_initialized():
        return
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=False)
        return
    # "local": a cluster of this run's own, even when another process on this host runs one (plain ray.init()
    # would join that one, and then refuse the CPU count)
    ray.init(address="local", num_cpus=cfg.num_cpus or (os.cpu_count() or 1) + 1, include_dashboard=False,
             object_store_memory=cfg.object_store_mb * 2**20, log_to_driver=False)


def load_datasets(cfg: RunConfig, cache_dir: Path, tokenizer) -> tuple[list[Example], list[Example]]:
    train_path, val_path = dataset_paths(cfg, cache_dir)
    train = load_examples(train_path, tokenizer, cfg.data)
    held_out = load_examples(val_path, tokenizer, cfg.data, max_rows=cfg.data.val_max_samples)
    return train, held_out


def run(cfg: RunConfig, run_dir: Path, show_progress: bool = True) -> dict[str, float]:
    """Train as configured, writing metrics and the export into `run_dir`; returns the summary.

    Raises `RunInterrupted` when SIGTERM or SIGINT stopped it early (after saving a checkpoint).
    """
    from transformers import AutoTokenizer

    started = time.monotonic()
    validate(cfg)
    cache_dir = cache_path(cfg)
    model_path = resolve_model_path(cfg.model, cfg.data, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples, eval_examples = load_datasets(cfg, cache_dir, tokenizer)
    check_inputs(cfg, model_path, train_examples)
    grader = Grader(cfg.reward, cfg.custom_reward_function)
    show_progress = show_progress and Tracker.console in cfg.trainer.logger
    logger = MetricsLogger(run_dir, cfg.trainer.total_steps, show_progress, tracking.for_run(cfg, run_dir), started)
    try:
        start_ray(cfg.ray)  # before the signal handlers: ray.init installs a SIGTERM handler of its own
        kind = placement.device_kind(cfg.device, ray.cluster_resources())
        if value_of(cfg.sync.transport) == "tpu_sync" and kind != "tpu":
            raise ValueError(f"sync.transport=tpu_sync moves weights between TPU hosts, but this run is on {kind}: "
                             "use object_store, shm_file or collective")
        if kind == "cpu" and (why := precision.slow_bf16_warning(value_of(cfg.model.dtype))):
            log.warning(why)
        log.info("model %s, %d train / %d eval prompts, reward %s, device %s", model_path, len(train_examples),
                 len(eval_examples), grader.describe(), kind)
        with StopRequest() as stop:
            job = Job(cfg, run_dir, model_path, kind, tokenizer, train_examples, eval_examples, grader, logger, stop)
            with_restarts(lambda restarts: train(job, restarted=restarts > 0), cfg.trainer.max_restarts)
    finally:
        logger.close()
        grader.close()
    evals = logger.evals()
    summary = {
        "eval/accuracy_start": evals[0],
        "eval/accuracy_final": final_accuracy(evals),
        **evaluation.pass_at_k_summary(logger.records),
        "steps": cfg.trainer.total_steps,
        "time/wall_s": time.monotonic() - started,
    }
    log.info("%s", evaluation.describe(summary))
    if cfg.trainer.plots and cfg.trainer.total_steps and (folder := plots.plot_finished_run(run_dir)):
        log.info("plots in %s", folder)
    return summary
