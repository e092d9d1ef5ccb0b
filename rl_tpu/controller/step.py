"""One GRPO step as the driver runs it: collect, score, train, publish, install, each phase timed (`Phases`)."""

from __future__ import annotations

import statistics

from rl_tpu.algorithms import outcomes
from rl_tpu.algorithms.learning_signal import LearningSignal
from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import ActorHandles
from rl_tpu.controller.phases import Phases
from rl_tpu.controller.recording import Recorder, Trained
from rl_tpu.controller.rollouts import RolloutQueue, StepRollouts, collect, episode_metrics
from rl_tpu.grader.grader import Grader
from rl_tpu.records import WeightBundle


def grpo_step(
    step: int,
    queue: RolloutQueue,
    actors: ActorHandles,
    tokenizer,
    grader: Grader,
    cfg: RunConfig,
    signal: LearningSignal,
    recorder: Recorder | None = None,
) -> tuple[dict[str, float], Trained]:
    """One step: the batch's rollouts, graded and scored (`signal`: rewards, shaping, the KL in the reward, the
    advantages), the update, the weights to the sampler. Returns the step's metrics and what it trained on, with the
    trainer's figures of the rows `recorder` records."""
    phases = Phases()
    sampled = collect(step, queue, tokenizer, grader, signal, phases)  # phases generate and grade
    with phases("score"):
        actors.release_devices()
        batch, kl_metrics = signal.train_batch(sampled.batch, actors.token_kl)
        batch = recorder.mark(sampled.batch, batch) if recorder else batch
    with phases("train"):
        train = actors.train(batch)
        figures = recorder.take_figures(actors, batch) if recorder else {}
    with phases("publish"):
        bundle = actors.publish(step)
    with phases("install"):
        # async: the engines install while the trainer goes on to the next step, which reports this install's figures.
        # Its canary is checked once the next batch is on its way (run.py): the trainer's scoring runs meanwhile
        received = actors.install(bundle, wait=not cfg.trainer.is_async)
    timings = time_metrics(phases, train, sum(len(r.completion_ids) for r in sampled.generated.rollouts))
    return {
        **rollout_metrics(step, sampled),
        **train,
        **kl_metrics,
        **timings,
        **sync_metrics(bundle, phases),
        **install_metrics(received),
        **sampled.shares,
    }, Trained(sampled.batch, batch, figures)


def rollout_metrics(step: int, sampled: StepRollouts) -> dict[str, float]:
    """The rewards and lengths of everything generated for the step, the batch's size and its weights' age."""
    generated = sampled.generated.rollouts  # what the policy produced, before any group was dropped
    scores = sampled.generated.grades.scores
    oldest_used = min(r.weight_version for r in sampled.batch.rollouts)
    return {
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores),
        **sampled.generated.grades.metrics("reward"),
        **sampled.metrics(),
        "rollout/samples": float(len(sampled.batch.rollouts)),
        "response/length_mean": sum(len(r.completion_ids) for r in generated) / len(generated),
        "response/truncated_frac": statistics.fmean(r.finish_reason == "length" for r in generated),
        **episode_metrics(generated, "episode"),
        **outcomes.step_metrics(generated, sampled.generated.grades.retries),
        "rollout/weight_version": float(oldest_used),
        "rollout/staleness": float(step - 1 - oldest_used),
    }


def time_metrics(phases: Phases, train: dict[str, float], gen_tokens: int) -> dict[str, float]:
    """The phases' seconds under the step's metric keys, and the rates they give."""
    step_s, publish_s = phases.elapsed(), phases["publish"]
    return {
        "time/generate_s": phases["generate"],  # waiting for the sampler (its work may have started earlier)
        "time/reward_s": phases["grade"] + phases["score"],  # grading, shaping, the KL in the reward, the advantages
        "time/train_step_s": phases["train"],
        "time/sync_s": publish_s + phases["install"],
        "time/publish_s": publish_s,  # the trainer's part of the sync; the engines' is sync/receive_s
        "time/step_s": step_s,
        # no rank computed: waiting for rollouts, grades and the engines' install (async mode hides generation)
        "time/trainer_idle_s": max(0.0, step_s - train["time/train_s"] - publish_s),
        "perf/gen_tokens_per_s": gen_tokens / phases["generate"],
        "perf/train_tokens_per_s": train["perf/train_tokens"] / train["time/train_s"],
    }


def sync_metrics(bundle: WeightBundle, phases: Phases) -> dict[str, float]:
    """What the step published: its version, transport, buckets, bytes and the rate over publish and install."""
    return {
        "sync/version": float(bundle.version),
        "sync/transport": bundle.transport,
        "sync/buckets": float(len(bundle.buckets)),
        "sync/bytes": float(bundle.num_bytes),
        "sync/mb_per_s": bundle.num_bytes / 2**20 / (phases["publish"] + phases["install"]),
    }


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
