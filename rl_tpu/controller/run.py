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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
import yaml
from omegaconf import OmegaConf

from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.cluster import placement
from rl_tpu.cluster.placement import start_ray
from rl_tpu.config import RunConfig, Tracker, cache_path
from rl_tpu.controller import evaluation, memory_plan
from rl_tpu.controller.actors import ActorHandles, start_actors, tool_settings
from rl_tpu.controller.checks import RESUME_MAY_CHANGE, check_resume_files, check_resumed_settings, validate
from rl_tpu.controller.recording import Recorder
from rl_tpu.controller.recovery import RunInterrupted, SkippedStepGuard, StopRequest, with_restarts
from rl_tpu.controller.rollouts import GeneratedRollouts, RolloutQueue
from rl_tpu.controller.step import grpo_step
from rl_tpu.controller.watch import RunWatch
from rl_tpu.data.arithmetic import ensure_arithmetic_dataset
from rl_tpu.data.datasets import Example, batches, load_examples
from rl_tpu.data.reasoning_gym import ensure_reasoning_gym_dataset
from rl_tpu.episodes.tools import ToolBox
from rl_tpu.grader.grader import Grader, custom_reward
from rl_tpu.models import precision
from rl_tpu.models.hf import bundle_bytes
from rl_tpu.models.resolve import check_context, check_decoder, resolve_model_path
from rl_tpu.outputs import checkpoints, plots, tracking
from rl_tpu.outputs.export import push_to_hub, write_model_card
from rl_tpu.outputs.metrics import MetricsLogger, final_accuracy
from rl_tpu.sync.registry import transport_class

log = logging.getLogger(__name__)

LORA_SENDS = {
    "adapter": "the adapter, served by vLLM's LoRA support",
    "merged": "the base with the adapter merged in (actor.lora.sync=merged, or a TPU engine: adapters not tried there)",
}


def training_data(cfg: RunConfig) -> str:
    """What the run trains on, in words."""
    task = cfg.data.reasoning_gym.task
    return cfg.data.train_files or (f"reasoning-gym's {task} task" if task else "the arithmetic task")


def dataset_paths(cfg: RunConfig, cache_dir: Path) -> tuple[Path, Path]:
    d = cfg.data
    if d.train_files:
        if not d.val_files:
            raise ValueError("data.train_files is set but data.val_files is not; held-out accuracy needs a val file")
        for key, path in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
            if not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"{key}={path}: no such file")
        return Path(d.train_files), Path(d.val_files)
    if d.reasoning_gym.task:
        return ensure_reasoning_gym_dataset(cache_dir / "data", d.reasoning_gym, d.num_eval, d.seed)
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
    settings: str  # the run's settings as given, as YAML: saved with each checkpoint
    # a resume trains on the checkpoint's queued generations: none of the settings that made them changed
    replay_queued: bool = True
    watch: RunWatch = field(default_factory=RunWatch)  # what reads each step (the preflight); a plain run: nothing


def save_checkpoint(job: Job, actors: ActorHandles, step: int, queue: RolloutQueue, signal: LearningSignal) -> Path:
    folder = checkpoints.folder_for(job.run_dir, step)
    checkpoints.check_room(job.run_dir)  # a full disk named as such, before anything is written
    # the batches queued ahead, generated: a resumed run trains on them as this one will (async: older weights)
    queued = [batch.to_dict() for batch in queue.generated_ahead(job.cfg.ray.call_timeout_s)]
    # the driver's part goes inside before the folder is complete: a checkpoint is whole or is not one
    driver = checkpoints.driver_files(queue.taken, signal.kl_coef, job.settings, queued)
    actors.on_trainers("save_checkpoint", f"saving checkpoint {folder}", str(folder), driver)
    checkpoints.prune(job.run_dir, job.cfg.trainer.keep_last)
    return folder


def resume(job: Job, actors: ActorHandles, restarted: bool) -> tuple[int, Path | None]:
    """Load the trainer state and give the sampler the same weights; returns the step to continue after, and
    the checkpoint of that step (None: the run starts).

    `trainer.resume=auto` and a restart continue this run folder (its metrics too); `trainer.resume_from`
    starts a new folder from another run's checkpoint.
    """
    t = job.cfg.trainer
    checkpoint = checkpoints.resume_point(job.run_dir, restarted or t.resume == "auto", t.resume_from)
    if checkpoint is None:
        job.logger.truncate_after(None)
        return 0, None
    step = checkpoints.step_of(checkpoint)
    actors.on_trainers("load_checkpoint", f"loading checkpoint {checkpoint}", str(checkpoint))
    actors.install(actors.publish(step))
    actors.samplers.settle_canary()  # the engines serve the checkpoint's weights before anything is generated
    job.logger.truncate_after(step if checkpoints.in_folder(checkpoint, job.run_dir) else None)
    log.info("resumed from %s at step %d", checkpoint, step)
    return step, checkpoint


def stop_early(
    job: Job, actors: ActorHandles, step: int, saved: int, queue: RolloutQueue, signal: LearningSignal
) -> None:
    """A signal asked the run to stop: save after `step` unless that is saved already, and stop."""
    checkpoint = checkpoints.folder_for(job.run_dir, saved) if saved else None
    if step > saved:
        checkpoint = save_checkpoint(job, actors, step, queue, signal)
    raise RunInterrupted(step, job.stop.requested, checkpoint)


def train(job: Job, restarted: bool) -> None:
    """One attempt at the run: start the actors, continue from the resume point, run the remaining steps."""
    cfg, logger = job.cfg, job.logger
    total, timeout = cfg.trainer.total_steps, cfg.ray.call_timeout_s
    checkpoint_every = checkpoints.every(cfg.trainer.checkpoint_every, total)
    actors = start_actors(cfg, job.model_path, job.run_dir, job.kind)
    try:
        start_step, checkpoint = resume(job, actors, restarted)
        # a resumed run's install checked its canary; a new run's engines are checked before they evaluate
        canary = actors.start_canary() if checkpoint is None else {}
        taken = checkpoints.data_position(checkpoint) if checkpoint else 0
        signal = LearningSignal(cfg, checkpoints.kl_coef(checkpoint) if cfg.algorithm.use_kl_in_reward else None)
        recorder = Recorder(cfg.trainer, job.run_dir, job.tokenizer)
        if not logger.records:  # a run continuing its own folder has its evaluation at start_step already
            first = evaluation.start_eval(actors.samplers, job.eval_examples, cfg, with_samples=True)
            evaluated = first.finish(job.tokenizer, job.grader, timeout)
            logger.log(start_step, {**evaluated, "sync/version": float(start_step), **canary})
            recorder.write_eval(start_step, first.greedy_graded)
        order_seed = cfg.data.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed
        prompt_batches = batches(job.train_examples, cfg.data.train_batch_size, order_seed)
        for _ in range(taken):  # the same batches a run that never stopped would see next
            next(prompt_batches)
        generated = [] if checkpoint is None or not job.replay_queued else checkpoints.queued_generations(checkpoint)
        queue = RolloutQueue(actors, prompt_batches, cfg, taken, [GeneratedRollouts.from_dict(b) for b in generated])
        guard, saved = SkippedStepGuard(cfg.trainer.max_skipped_steps), start_step
        for step in range(start_step + 1, total + 1):
            if job.stop.requested:
                stop_early(job, actors, step - 1, saved, queue, signal)
            metrics, trained = grpo_step(step, queue, actors, job.tokenizer, job.grader, cfg, signal, recorder)
            guard.observe(step, metrics, trained.graded.prompts)
            recorder.write_train(step, trained)
            pending_eval = None
            if step % cfg.trainer.eval_every == 0 or step == total:
                pending_eval = evaluation.start_eval(actors.samplers, job.eval_examples, cfg, step == total)
            queue.fill_after(step)  # behind the evaluation on the sampler: this step's weights or older
            metrics.update(actors.samplers.settle_canary())  # the install's canary (async: the install before's)
            if pending_eval is not None:
                metrics.update(pending_eval.finish(job.tokenizer, job.grader, timeout))
                recorder.write_eval(step, pending_eval.greedy_graded)
            # with the step's canary and evaluation; before the log, which refuses a non-finite figure
            job.watch.step(step, metrics, trained.graded)
            logger.log(step, {**metrics, "time/record_s": recorder.take_seconds()})
            if (checkpoint_every and step % checkpoint_every == 0) or (step == total and cfg.trainer.checkpoint_final):
                save_checkpoint(job, actors, step, queue, signal)
                saved = step
        actors.samplers.finish_install()  # async: the last step's (its evaluation waited for it already)
        actors.samplers.settle_canary()
        if cfg.trainer.export:
            actors.on_trainers("export", "exporting the policy", str(job.run_dir / "export"))
            adapter = cfg.lora_sync is not None  # the export is the adapter, in fp32 (its master weights)
            dtype = "float32" if adapter else cfg.model.dtype
            write_model_card(job.run_dir / "export", job.run_dir, dtype, adapter=adapter)
            if cfg.trainer.push_to_hub:
                push_to_hub(job.run_dir / "export", cfg.trainer.push_to_hub, public=cfg.export.public)
    finally:
        actors.shutdown()


def check_inputs(cfg: RunConfig, model_path: Path, train_examples: list[Example]) -> None:
    """What the model and the data decide, checked before Ray starts."""
    if cfg.data.train_batch_size > len(train_examples):
        raise ValueError(
            f"data.train_batch_size={cfg.data.train_batch_size} is larger than the "
            f"{len(train_examples)} usable prompts of {training_data(cfg)}"
        )
    check_decoder(model_path, cfg.model.fp32_residual and cfg.model.dtype != "float32")
    check_context(model_path, cfg.data.max_prompt_length, cfg.completion_tokens, cfg.completion_keys)


def load_datasets(
    cfg: RunConfig, paths: tuple[Path, Path], tokenizer, tools: list[dict] | None
) -> tuple[list[Example], list[Example]]:
    """The train and held-out examples, the tools' schemas (`tool_schemas`) in their prompts."""
    train_path, val_path = paths
    train = load_examples(train_path, tokenizer, cfg.data, tools=tools)
    held_out = load_examples(val_path, tokenizer, cfg.data, max_rows=cfg.data.val_max_samples, tools=tools)
    return train, held_out


def tool_schemas(cfg: RunConfig) -> list[dict] | None:
    """The episode's tools, loaded once in a worker process before Ray starts (a tool that cannot load fails
    now, naming its file): their schemas, which a chat template puts in the prompt. None without episodes."""
    if not cfg.episode.enable:
        return None
    toolbox = ToolBox(dataclasses.replace(tool_settings(cfg), num_workers=1))
    try:
        return list(toolbox.schemas.values())
    finally:
        toolbox.close()


def check_reward_plugin(cfg: RunConfig) -> None:
    """A reward plugin is loaded once in a worker process now, so that one that cannot load fails before the model
    is resolved (which may build it: minutes), naming its file; the grader loads it again for the run."""
    if custom_reward(cfg.reward, cfg.custom_reward_function) is not None:
        Grader(dataclasses.replace(cfg.reward, num_workers=1), cfg.custom_reward_function).close()


def run(
    cfg: RunConfig,
    run_dir: Path,
    show_progress: bool = True,
    on_checked: Callable[[], None] = lambda: None,
    watch: RunWatch | None = None,
) -> dict[str, float]:
    """Train as configured, writing metrics and the export into `run_dir`; returns the summary.

    Every check comes first, writing nothing: a refused run leaves `run_dir` as it was. `on_checked` is called once
    they have all passed, before anything is written into `run_dir` or started. `watch` is shown the run's inputs
    before Ray starts and each step's metrics and batch (rl_tpu/controller/watch.py).
    Raises `RunInterrupted` when SIGTERM or SIGINT stopped it early (after saving a checkpoint).
    """
    from transformers import AutoTokenizer

    started = time.monotonic()
    validate(cfg)
    settings = OmegaConf.to_yaml(OmegaConf.structured(cfg))  # as given: before anything is derived from them
    resuming = checkpoints.resume_point(run_dir, cfg.trainer.resume == "auto", cfg.trainer.resume_from)
    changed = {}
    if resuming is not None:
        own = checkpoints.in_folder(resuming, run_dir)
        changed = check_resumed_settings(resuming, yaml.safe_load(settings), cfg.trainer.resume_allow_changes, own)
    # a change the user allowed may change what the queued generations would be: they are made again
    replay_queued = all(key.startswith(RESUME_MAY_CHANGE) for key in changed)
    if resuming is not None:
        check_resume_files(resuming, cfg.algorithm.use_kl_in_reward, replay_queued)
    cache_dir = cache_path(cfg)
    # what fails in seconds is checked before what may take minutes (resolving the model may build it)
    tools = tool_schemas(cfg)
    check_reward_plugin(cfg)
    paths = dataset_paths(cfg, cache_dir)
    model_path = resolve_model_path(cfg.model, cfg.data, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_examples, eval_examples = load_datasets(cfg, paths, tokenizer, tools)
    check_inputs(cfg, model_path, train_examples)
    memory_plan.check(cfg, model_path)  # logged, and refused past a device's memory, before Ray starts
    on_checked()
    for key, (old, new) in sorted(changed.items()):
        log.info("resuming from %s with %s=%r (it was written with %r)", resuming, key, new, old)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    grader = Grader(cfg.reward, cfg.custom_reward_function, str(run_dir / "logs"), cfg.algorithm.outcomes)
    show_progress = show_progress and Tracker.console in cfg.trainer.logger
    logger = MetricsLogger(run_dir, cfg.trainer.total_steps, show_progress, tracking.for_run(cfg, run_dir), started)
    watch = watch or RunWatch()
    try:
        watch.inputs(tokenizer, train_examples, tools)
        # before the signal handlers: ray.init installs a SIGTERM handler of its own
        start_ray(cfg.ray, bundle_bytes(model_path, cfg.model.torch_dtype))
        kind = placement.device_kind(cfg.device, ray.cluster_resources())
        transport_class(cfg.sync.transport).check_device(cfg, kind)
        if kind == "cpu" and (why := precision.slow_bf16_warning(cfg.model.dtype)):
            log.warning(why)
        if cfg.actor.lora.enabled:  # the actors get the resolved device, from which `lora_sync` decides the same
            sends = LORA_SENDS[dataclasses.replace(cfg, device=kind).lora_sync]
            log.info("LoRA rank %d: each weight sync sends %s", cfg.actor.lora.lora_rank, sends)
        log.info(
            "model %s, %d train / %d eval prompts, reward %s, device %s",
            model_path,
            len(train_examples),
            len(eval_examples),
            grader.describe(),
            kind,
        )
        with StopRequest() as stop:
            inputs = (tokenizer, train_examples, eval_examples, grader)
            job = Job(cfg, run_dir, model_path, kind, *inputs, logger, stop, settings, replay_queued, watch)
            with_restarts(lambda restarts: train(job, restarted=restarts > 0), cfg.trainer.max_restarts)
    finally:
        logger.close()
        grader.close()
    evals = logger.evals()
    summary = {
        "eval/accuracy_start": evals[0],
        "eval/start_step": float(next(r["step"] for r in logger.records if "eval/accuracy" in r)),
        "eval/accuracy_final": final_accuracy(evals),
        **evaluation.pass_at_k_summary(logger.records),
        "steps": cfg.trainer.total_steps,
        "time/wall_s": time.monotonic() - started,
    }
    log.info("%s", evaluation.describe(summary))
    if cfg.trainer.plots and cfg.trainer.total_steps and (folder := plots.plot_finished_run(run_dir)):
        log.info("plots in %s", folder)
    return summary
