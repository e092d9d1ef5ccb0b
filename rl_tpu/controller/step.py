"""One GRPO step as the driver runs it: rollouts, grades, advantages, the update, the weights to the engines."""

from __future__ import annotations

import dataclasses
import statistics
import time

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms.kl_reward import KLInReward
from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import Workers
from rl_tpu.controller.batch_shaping import GradedBatch
from rl_tpu.controller.rollouts import RolloutQueue, collect, episode_metrics
from rl_tpu.grader.grader import Grader
from rl_tpu.records import Rollout, TrainBatch


def lost(rollout: Rollout) -> bool:
    """An episode whose tool instance was lost with its worker: its state and tool reward are gone."""
    return rollout.episode is not None and rollout.episode.lost_instance is not None


def loss_mask(rollouts: list[Rollout], overlong_filter: bool) -> list[bool] | None:
    """Per sequence, whether it is in the loss (None: all are). Overlong filtering leaves truncated completions out,
    and an episode that lost its tool instance is always left out: its reward is not what its actions earned."""
    keep = [not (overlong_filter and r.finish_reason == "length") and not lost(r) for r in rollouts]
    return keep if overlong_filter or not all(keep) else None


def advantage_groups(rollouts: list[Rollout]) -> list[int]:
    """Each sequence's group for the advantages: an episode that lost its tool instance is alone in a group of its
    own, so that its unknown reward does not move its prompt's statistics (it is out of the loss)."""
    alone = max(r.group for r in rollouts) + 1
    return [alone + i if lost(r) else r.group for i, r in enumerate(rollouts)]


def grpo_step(
    step: int,
    queue: RolloutQueue,
    workers: Workers,
    tokenizer,
    grader: Grader,
    cfg: RunConfig,
    kl: KLInReward | None = None,
) -> tuple[dict[str, float], GradedBatch]:
    """One step: the batch's rollouts (graded, shaped), advantages (less `kl`'s penalties when the reward holds
    the KL), the update, the weights to the sampler. Returns the step's metrics and what it trained on."""
    t0 = time.perf_counter()
    sampled = collect(step, queue, tokenizer, grader, cfg)
    rollouts, grades = sampled.batch.rollouts, sampled.batch.grades
    t1 = time.perf_counter()
    lengths = [len(r.completion_ids) for r in rollouts]
    in_loss = loss_mask(rollouts, cfg.algorithm.overlong_filter)
    masks = [r.model_mask for r in rollouts] if cfg.episode.enable else None  # tool results: out of the loss
    batch = TrainBatch(  # advantages filled in below: the KL in the reward needs the batch first
        [r.prompt_ids for r in rollouts],
        [r.completion_ids for r in rollouts],
        [r.logprobs for r in rollouts],
        [[0.0] * n for n in lengths],
        cfg.sampler.temperature,
        algorithms.rollout_is_level(cfg.actor, cfg.trainer.is_async),
        cfg.actor.rollout_is_threshold,
        in_loss,
        masks,
    )
    workers.release_devices()
    penalties, kl_metrics = kl.penalties(workers.token_kl(batch), masks) if kl else (None, {})
    advantages = algorithms.advantages(
        grades.scores, advantage_groups(rollouts), lengths, cfg.algorithm, grades.components, penalties, masks
    )
    t2 = time.perf_counter()
    train = workers.train(dataclasses.replace(batch, advantages=advantages))
    t3 = time.perf_counter()
    bundle = workers.publish(step)
    publish_s = time.perf_counter() - t3
    # async: the engines install while the trainer goes on to the next step, which reports this install's figures
    received = workers.install(bundle, wait=not cfg.trainer.is_async)
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
        **episode_metrics(generated, "episode"),
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
    }, sampled.batch


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
